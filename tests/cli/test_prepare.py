import random
import re
import tempfile
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.data.corpus import Corpus, load_manifest

WORDS = "sun moon star sky sea land fire water stone wind rain snow cloud light dark".split()


def _write(prefix: Path, n: int, seed: int, src: str = "en", tgt: str = "fr") -> str:
    rng = random.Random(seed)
    lines = [rng.choices(WORDS, k=rng.randint(2, 10)) for _ in range(n)]
    Path(f"{prefix}.{src}").write_text("".join(" ".join(w) + "\n" for w in lines))
    Path(f"{prefix}.{tgt}").write_text(
        "".join(" ".join(x.upper() for x in reversed(w)) + "\n" for w in lines)
    )
    return str(prefix)


@pytest.fixture
def prefixes(tmp_path):
    return _write(tmp_path / "train", 300, 1), _write(tmp_path / "valid", 20, 2)


def _prepare_args(train: str, valid: str, out: Path, *extra: str) -> list[str]:
    return [
        "prepare", "--train", train, "--valid", valid, "--src", "en", "--tgt", "fr",
        "--vocab-size", "80", "--out", str(out), *extra,
    ]  # fmt: skip


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_prepare_command_writes_data_and_a_summary(prefixes, tmp_path, capsys, monkeypatch):
    train, valid = prefixes
    # No folder in the system's temporary folder, where a killed run would leave it.
    made: list[str] = []
    real = tempfile.mkdtemp

    def mkdtemp(suffix=None, prefix=None, dir=None):
        path = real(suffix, prefix, dir)
        if dir is None:
            made.append(path)
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    code, out, err = _run(_prepare_args(train, valid, tmp_path / "data"), capsys)
    assert code == 0
    assert "train" in out and "300 pairs" in out and "valid" in out and "20 pairs" in out
    # Progress goes to stderr: off a terminal, one summary line per stage.
    assert re.search(r"^aiayn prepare: encoding train: 300 lines in [0-9.]+ s", err, re.M), err
    assert re.search(r"^aiayn prepare: training a joint bpe .*: done in [0-9.]+ s$", err, re.M)
    assert len(Corpus.open(tmp_path / "data", "train")) == 300
    assert load_manifest(tmp_path / "data")["vocab_size"] == 80
    code, out, err = _run(_prepare_args(train, valid, tmp_path / "data"), capsys)
    assert code == 0 and "up to date" in err and "300 pairs" in out
    assert made == []


def _assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("aiayn prepare: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_bad_inputs_give_one_line_errors(prefixes, tmp_path, capsys):
    train, valid = prefixes
    # Different line counts.
    target = Path(f"{valid}.fr")
    target.write_text(target.read_text() + "EXTRA LINE\n")
    code, _, err = _run(_prepare_args(train, valid, tmp_path / "d1"), capsys)
    _assert_one_line_error(code, err, f"{valid}.en", f"{valid}.fr", "20", "21")
    _write(Path(valid), 20, 2)

    # Invalid UTF-8.
    source = Path(f"{train}.en")
    source.write_bytes(source.read_bytes().replace(b"sun", b"s\xc3n", 1))
    code, _, err = _run(_prepare_args(train, valid, tmp_path / "d2"), capsys)
    bad_line = next(
        i for i, line in enumerate(source.read_bytes().split(b"\n"), 1) if b"\xc3n" in line
    )
    _assert_one_line_error(code, err, f"{train}.en, line {bad_line}", "invalid UTF-8")
    code, _, err = _run(
        _prepare_args(train, valid, tmp_path / "d2", "--encoding-errors", "replace"), capsys
    )
    assert code == 0
    _write(Path(train), 300, 1)

    # Missing file, unwritable output, vocabulary too large.
    code, _, err = _run(_prepare_args(train, str(tmp_path / "nope"), tmp_path / "d3"), capsys)
    _assert_one_line_error(code, err, "nope.en", "not found")
    (tmp_path / "blocker").write_text("")
    code, _, err = _run(_prepare_args(train, valid, tmp_path / "blocker" / "out"), capsys)
    _assert_one_line_error(code, err, "blocker")
    argv = _prepare_args(train, valid, tmp_path / "d4")
    argv[argv.index("--vocab-size") + 1] = "100000"
    code, _, err = _run(argv, capsys)
    _assert_one_line_error(code, err, "100000", "--vocab-size")


def test_usage_errors(prefixes, tmp_path, capsys):
    train, valid = prefixes
    code, _, err = _run(["prepare", "--train", train, "--out", str(tmp_path / "x")], capsys)
    _assert_one_line_error(code, err, "--valid", "--src", "--tgt")
    code, _, err = _run(
        ["prepare", "--corpus", "bible", "--train", train, "--out", str(tmp_path / "x")], capsys
    )
    _assert_one_line_error(code, err, "--train")
    code, _, err = _run([*_prepare_args(train, valid, tmp_path / "x"), "--download"], capsys)
    _assert_one_line_error(code, err, "--corpus bible")
    code, _, err = _run(
        ["prepare", "--corpus", "bible", "--src", "en", "--tgt", "de", "--out", str(tmp_path)],
        capsys,
    )
    _assert_one_line_error(code, err, "English-Spanish")
    # Settings out of their range: refused before any work, not recorded or left to
    # sentencepiece.
    for extra, message in (
        (["--max-len", "0"], "--max-len must be at least 1"),
        (["--max-len-ratio", "-1"], "--max-len-ratio must be 0 (off) or a finite 1 or more"),
        (["--max-len-ratio", "0.5"], "got 0.5"),
        (["--max-len-ratio", "inf"], "got inf"),
        (
            ["--input-sentence-size", "100"],
            "--input-sentence-size must be 0 (every sentence) or at least 101",
        ),
        (["--character-coverage", "2"], "--character-coverage must be above 0 and at most 1"),
        (["--character-coverage", "0"], "got 0"),
    ):
        code, _, err = _run([*_prepare_args(train, valid, tmp_path / "y"), *extra], capsys)
        _assert_one_line_error(code, err, message)
        assert not (tmp_path / "y").exists()
