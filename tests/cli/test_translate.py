"""``aiayn translate`` of a file: translations written in input order window by window, so that
an interrupt (Ctrl-C, SIGTERM) keeps the lines finished and says how to translate the rest;
and a hint when most translations are empty."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.cli import translate as translate_command
from aiayn.inference.translator import TextTranslator
from tests.helpers import TINY, WORDS, cli_env

pytestmark = pytest.mark.usefixtures("single_thread")

# Greedy, with outputs of source length + 2 tokens (a model of one update never ends them),
# so that each output line's length tells which input line it belongs to.
OPTIONS = ["--beam", "1", "--max-len-b", "2", "--batch-tokens", "8", "--device", "cpu"]


@pytest.fixture(scope="module")
def run(reverse_data_dir, tmp_path_factory) -> Path:
    """A tiny model of one update: it never ends a translation by itself at beam 1, and at
    beam 4 ends every one at once (an empty translation)."""
    out = tmp_path_factory.mktemp("translate") / "run"
    argv = ["train", "--config", TINY, "--data", str(reverse_data_dir), "--out", str(out)]
    assert main([*argv, "train.max_steps=1", "train.valid_interval=0", "--no-progress"]) == 0
    return out


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "in.txt"
    path.write_text("".join(" ".join(WORDS[: 1 + i % 6]) + "\n" for i in range(30)))
    return path


def _translate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _signal_at_search(monkeypatch: pytest.MonkeyPatch, signum: int, call: int) -> None:
    """The process receives ``signum`` during the ``call``-th search of a window."""
    search = TextTranslator.search_ids
    calls = [0]

    def searching(self, sources):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == call:
            os.kill(os.getpid(), signum)
        return search(self, sources)

    monkeypatch.setattr(TextTranslator, "search_ids", searching)


@pytest.mark.parametrize(
    ("signum", "code", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "stopped by SIGTERM")],
)
def test_an_interrupted_translation_keeps_its_lines(
    run, source, capsys, monkeypatch, signum, code, said
):
    monkeypatch.setattr(translate_command, "WINDOW_BATCHES", 1)  # windows of 2 or 3 lines
    argv = ["translate", str(run), "--input", str(source), *OPTIONS]
    done, whole, _ = _translate(argv, capsys)
    assert done == 0
    whole_lines = whole.splitlines()
    assert len(whole_lines) == 30
    # Output lengths follow the input's (2 more tokens a line): the order is the input's.
    lengths = [len(line.split()) for line in whole_lines]
    assert lengths == [len(line.split()) + 2 for line in source.read_text().splitlines()]

    _signal_at_search(monkeypatch, signum, call=4)
    stopped, kept, err = _translate(argv, capsys)
    assert stopped == code
    written = len(kept.splitlines())
    assert 0 < written < 30 and kept.splitlines() == whole_lines[:written]
    message = err.splitlines()[-1]
    assert message.startswith(f"aiayn translate: {said}: the translations of the first {written} ")
    assert "of 30 lines are written, in order; to translate the rest: tail -n +" in message
    rest = re.search(r"tail -n \+(\d+) (\S+) \| aiayn (.*) >> OUTPUT$", message)
    assert rest is not None, message
    assert int(rest.group(1)) == written + 1 and rest.group(2) == str(source)
    assert "--input" not in rest.group(3) and rest.group(3).split()[:2] == ["translate", str(run)]
    # The command it gives, followed, translates the rest.
    monkeypatch.undo()
    monkeypatch.setattr(translate_command, "WINDOW_BATCHES", 1)
    tail = source.parent / "rest.txt"
    tail.write_text("".join(source.read_text().splitlines(keepends=True)[written:]))
    follow = [*rest.group(3).split(), "--input", str(tail)]
    assert follow[2:-2] == OPTIONS
    done, remainder, _ = _translate(follow, capsys)
    assert done == 0 and kept + remainder == whole


def test_a_signal_while_a_window_is_written_ends_after_it(run, source, capsys, monkeypatch):
    """The output holds whole windows: a signal during a write takes effect after it, and the
    count said is the count written."""
    monkeypatch.setattr(translate_command, "WINDOW_BATCHES", 1)
    write = translate_command._write
    calls = [0]

    def writing(out, lines):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGINT)
        write(out, lines)

    monkeypatch.setattr(translate_command, "_write", writing)
    argv = ["translate", str(run), "--input", str(source), *OPTIONS]
    stopped, kept, err = _translate(argv, capsys)
    assert stopped == 130
    written = len(kept.splitlines())
    assert written > 2 and f"the first {written} of 30 lines" in err


def test_most_translations_empty_says_what_helps(run, source, capsys):
    argv = ["translate", str(run), "--input", str(source), "--max-len-b", "2"]
    done, out, err = _translate([*argv, "--beam", "4"], capsys)
    assert done == 0 and out == "\n" * 30
    assert (
        "warning: 30 of 30 non-empty lines have an empty translation: the model ends them at "
        "once, as one trained too briefly does; train longer; beam search (beam 4)"
    ) in err and "--beam 1" in err
    done, out, err = _translate([*argv, "--beam", "1"], capsys)
    assert done == 0 and "" not in out.splitlines() and "empty translation" not in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_under_the_output_is_one_line(run, source):
    command = f"{sys.executable} -m aiayn translate {run} --input {source} > /dev/full"
    done = subprocess.run(
        ["bash", "-c", command + " " + " ".join(OPTIONS)],
        capture_output=True, text=True, env=cli_env(),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith(
        "aiayn translate: error: no space left on the device of stdout: the translations of "
        "the first 0 of 30 lines are written (and perhaps part of the next: keep the first "
        "lines only); free some space, then translate the rest: tail -n +1 "
    ), done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


def test_a_full_disk_keeps_whole_lines(run, source, tmp_path, capsys, monkeypatch):
    """The window whose write failed is cut from the output file: it ends with the lines said."""
    import errno

    monkeypatch.setattr(translate_command, "WINDOW_BATCHES", 1)
    argv = ["translate", str(run), "--input", str(source), *OPTIONS]
    whole = _translate(argv, capsys)[1].splitlines(keepends=True)
    output = tmp_path / "out.txt"
    calls = [0]

    def writing(out, lines):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:
            out.write(lines[0][:3])
            out.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        out.write("".join(line + "\n" for line in lines))
        out.flush()

    silenced = []
    monkeypatch.setattr(translate_command, "_write", writing)
    monkeypatch.setattr(translate_command, "_stdout_file", lambda: output)
    monkeypatch.setattr("aiayn.cli.silence_stdout", lambda: silenced.append(True))
    with output.open("w") as handle:
        monkeypatch.setattr(sys, "stdout", handle)
        code = main(argv)
    monkeypatch.undo()
    err = capsys.readouterr().err
    kept = output.read_text().splitlines(keepends=True)
    assert code == 2 and silenced and 0 < len(kept) < 30 and kept == whole[: len(kept)]
    assert f"no space left on the device of stdout ({output}): the translations of the " in err
    assert f"{len(kept)} of 30 lines are written; free some space, then translate the rest: " in err
