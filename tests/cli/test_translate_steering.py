"""``aiayn translate --constraints FILE --target-prefix FILE``: a tiny model's translations hold
every phrase and start with every prefix, line by line; bad files are one-line errors that name
the file and the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.cli.translate import _rest_command
from tests.helpers import TINY, WORDS

pytestmark = pytest.mark.usefixtures("single_thread")

OPTIONS = ["--max-len-b", "4", "--batch-tokens", "16", "--device", "cpu"]


@pytest.fixture(scope="module")
def run(reverse_data_dir, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """A tiny model of one update (a word is one token of its tokenizer)."""
    out = tmp_path_factory.mktemp("steering") / "run"
    argv = ["train", "--config", TINY, "--data", str(reverse_data_dir), "--out", str(out)]
    assert main([*argv, "train.max_steps=1", "train.valid_interval=0", "--no-progress"]) == 0
    return out


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "in.txt"
    path.write_text("".join(" ".join(WORDS[i % 4 : i % 4 + 1 + i % 3]) + "\n" for i in range(9)))
    return path


def _translate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# Line i's phrases: none, one word, two words as one phrase, two phrases, two phrases that
# share their first word.
PHRASES = [[], ["golf"], ["hotel india"], ["echo", "delta"], ["bravo alpha", "bravo golf"]]


@pytest.mark.parametrize("beam", ["1", "4"])
def test_constraints_and_prefixes_line_by_line(
    run: Path, source: Path, tmp_path: Path, beam: str, capsys: pytest.CaptureFixture[str]
) -> None:
    constraints = [PHRASES[i % len(PHRASES)] for i in range(9)]
    prefixes = ["" if i % 3 else "india india" for i in range(9)]
    given = tmp_path / "terms.tsv"
    given.write_text("".join("\t".join(p) + "\n" for p in constraints), encoding="utf-8")
    starts = tmp_path / "prefix.txt"
    starts.write_text("".join(p + "\n" for p in prefixes), encoding="utf-8")
    base = ["translate", str(run), "-i", str(source), "--beam", beam, *OPTIONS]
    code, plain, _ = _translate(base, capsys)
    assert code == 0
    code, out, err = _translate([*base, "--constraints", str(given)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 9
    for line, phrases, before in zip(lines, constraints, plain.splitlines(), strict=True):
        assert all(p in line for p in phrases), (line, phrases)
        if not phrases:
            assert line == before  # unchanged by the option
    argv = [*base, "--constraints", str(given), "--target-prefix", str(starts)]
    code, out, err = _translate(argv, capsys)
    assert code == 0, err
    for line, phrases, prefix in zip(out.splitlines(), constraints, prefixes, strict=True):
        assert line.startswith(prefix) and all(p in line for p in phrases), line
    # The rest of an interrupted run reads the rest of each line file too.
    rest = _rest_command(_Args(["translate", str(run), "-i", str(source), *argv[5:]]), 4)
    assert f"--constraints <(tail -n +5 {given})" in rest
    assert f"--target-prefix <(tail -n +5 {starts})" in rest


class _Args:
    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.checkpoint = argv[1]
        self.input = argv[3]


def test_a_constraint_that_cannot_fit_is_told_and_dropped(
    run: Path, source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    given = tmp_path / "terms.tsv"
    given.write_text("\n" * 2 + " ".join(WORDS) + "\n" + "\n" * 6, encoding="utf-8")
    base = ["translate", str(run), "-i", str(source), "--beam", "2", *OPTIONS]
    code, plain, _ = _translate(base, capsys)
    code, out, err = _translate([*base, "--constraints", str(given)], capsys)
    assert code == 0 and out == plain
    assert (
        "warning: line 3: its constraints need 9 output tokens after the prefix, more than "
        "its limit of 7; translated without them"
    ) in err


def test_bad_files_are_one_line_errors(
    run: Path, source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["translate", str(run), "-i", str(source), *OPTIONS]
    short = tmp_path / "short.tsv"
    short.write_text("golf\n\n", encoding="utf-8")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"golf\n" * 4 + b"\xc3\x28\n" + b"\n" * 4)
    empty = tmp_path / "empty.tsv"
    empty.write_text("golf\n\ngolf\t\techo\n" + "\n" * 6, encoding="utf-8")
    cases = [
        (["--constraints", str(short)], f"{short}: line 3 is missing: --constraints needs one "),
        (["--target-prefix", str(short)], f"{short}: line 3 is missing: --target-prefix needs"),
        (["--constraints", str(bad)], f"{bad}: line 5 is not valid UTF-8"),
        (["--target-prefix", str(bad)], f"{bad}: line 5 is not valid UTF-8"),
        (["--constraints", str(empty)], f"{empty}: line 3: an empty phrase"),
        (["--constraints", str(tmp_path / "none")], "none: no such file"),
        (
            ["--constraints", str(short), "--engine", "ctranslate2"],
            "CTranslate2 has no constrained search: for --constraints, use --engine torch",
        ),
    ]
    for extra, message in cases:
        code, out, err = _translate([*base, *extra], capsys)
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (extra, err)
    long = tmp_path / "long.txt"
    long.write_text("\n" * 10, encoding="utf-8")
    code, _, err = _translate([*base, "--target-prefix", str(long)], capsys)
    assert code == 2 and f"{long}: it is longer: --target-prefix needs one line per input" in err


def test_constraints_need_a_file_or_a_pipe_and_come_in_every_nbest_entry(
    run: Path,
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io
    import sys

    given = tmp_path / "terms.tsv"
    given.write_text("golf\techo\n" * 9, encoding="utf-8")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    code, out, err = _translate(["translate", str(run), "--constraints", str(given)], capsys)
    assert code == 2 and out == "" and "give --input FILE (or pipe the text in)" in err
    argv = ["translate", str(run), "-i", str(source), "--beam", "3", "--nbest", "3", *OPTIONS]
    code, out, err = _translate([*argv, "--constraints", str(given)], capsys)
    assert code == 0, err
    rows = [line.split("\t") for line in out.splitlines()]
    assert len(rows) == 27 and all("golf" in r[2] and "echo" in r[2] for r in rows if r[2])
    assert all(r[2] for r in rows[::3])  # every line has a best hypothesis
