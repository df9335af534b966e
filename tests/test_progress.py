import io
import re

import pytest

from aiayn import progress
from aiayn.progress import Report, as_report, counted, parameter_count


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def ticking(monkeypatch):
    """time.monotonic advancing by one second per call."""
    now = iter(range(1000))
    monkeypatch.setattr(progress.time, "monotonic", lambda: float(next(now)))


def test_meter_redraws_on_a_terminal_then_leaves_one_summary_line(ticking):
    stream = Terminal()
    report = Report("aiayn prepare: ", stream)
    meter = report.meter("encoding train", 300)
    for _ in range(3):
        meter.advance(100)
    meter.finish()
    text = stream.getvalue()
    draws = text.split("\r\033[K")
    assert draws[0].startswith("aiayn prepare: encoding train: 100/300 lines (33%)")
    assert "lines/s, 0:00:02 left" in draws[0]  # 100 lines in 1 s, 200 to go
    assert draws[2].startswith("aiayn prepare: encoding train: 300/300 lines (100%)")
    assert re.fullmatch(
        r"aiayn prepare: encoding train: 300 lines in \d\.\d s \(\d+ lines/s\)\n", draws[3]
    )
    assert text.count("\n") == 1


def test_meter_off_a_terminal_writes_only_the_summary(ticking):
    stream = io.StringIO()
    meter = Report("", stream).meter("downloading x.tgz", 3_000_000, "MB", 10**6)
    meter.advance(2_000_000)
    meter.advance(1_000_000)
    meter.finish()
    assert stream.getvalue() == "downloading x.tgz: 3.0 MB in 1.0 s (3.0 MB/s)\n"


def test_a_plain_function_gets_messages_and_summaries_but_no_redraws(ticking):
    got: list[str] = []
    report = as_report(got.append)
    assert as_report(report) is report
    report("reading train")
    with report.stage("training a vocabulary"):
        pass
    meter = report.meter("encoding train", 0)
    meter.advance(5)
    meter.finish()
    assert got == [
        "reading train",
        "training a vocabulary",
        "training a vocabulary: done in 1.0 s",
        "encoding train: 5 lines in 1.0 s (5 lines/s)",
    ]
    as_report(None)("nothing happens")


def test_a_message_after_a_redraw_replaces_the_drawn_line(ticking):
    stream = Terminal()
    report = Report("", stream)
    report.meter("translating", 10).advance(4)
    report("a warning")
    assert stream.getvalue().endswith("\r\033[Ka warning\n")


def test_counts_take_the_number_of_their_count():
    assert counted(1, "line") == "1 line"
    assert counted(0, "line") == "0 lines"
    assert counted(2_000, "picture") == "2,000 pictures"
    assert counted(2, "index", "indices") == "2 indices"
    assert parameter_count(45_952) == "45,952 parameters"
    assert parameter_count(1) == "1 parameter"
    assert parameter_count(44_140_000) == "44.1M parameters"
