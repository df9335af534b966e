import random
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.data.corpus import load_manifest, tokenizer_path
from aiayn.data.sources import bible
from aiayn.data.text import TextCorpus
from aiayn.data.tokenizer import Tokenizer

WORDS = "sun moon star sky sea land fire water stone wind rain snow cloud light dark".split()


@pytest.fixture
def files(tmp_path):
    """train/valid text (lm) and labelled text (classify) in tmp_path."""
    rng = random.Random(1)

    def write(name: str, n: int, labelled: bool) -> str:
        lines = []
        for _ in range(n):
            text = " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))
            lines.append(f"{'hot' if 'fire' in text else 'cold'}\t{text}" if labelled else text)
        (tmp_path / name).write_text("".join(line + "\n" for line in lines))
        return str(tmp_path / name)

    return {
        "lm": (write("train.txt", 200, False), write("valid.txt", 20, False)),
        "classify": (write("train.tsv", 200, True), write("valid.tsv", 20, True)),
    }


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _error(code: int, err: str) -> str:
    assert code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("aiayn prepare: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _text_args(task: str, train: str, valid: str, out: Path, *extra: str) -> list[str]:
    return [
        "prepare",
        "--task",
        task,
        "--train",
        train,
        "--valid",
        valid,
        "--out",
        str(out),
        *extra,
    ]


def test_prepare_lm_then_classify_with_its_tokenizer(files, tmp_path, capsys):
    code, out, err = _run(
        _text_args("lm", *files["lm"], tmp_path / "lm", "--vocab-size", "60"), capsys
    )
    assert code == 0, err
    assert "text for the lm task, vocabulary 60 (bpe)" in out
    assert "train        200 lines" in out and "valid         20 lines" in out
    assert "training a bpe vocabulary of 60" in err
    assert Tokenizer.load(tokenizer_path(tmp_path / "lm")).has_mask

    model = str(tokenizer_path(tmp_path / "lm"))
    args = _text_args("classify", *files["classify"], tmp_path / "cls", "--tokenizer", model)
    code, out, err = _run(args, capsys)
    assert code == 0, err
    assert f"vocabulary 60 (from {Path(model).resolve()})" in out
    hot = sum("fire" in t for t in TextCorpus.open(tmp_path / "cls", "train").texts())
    assert "2 classes" in out and f"    hot   {hot:>10,}" in out
    assert load_manifest(tmp_path / "cls")["labels"] == ["cold", "hot"]
    code, out, err = _run(args, capsys)
    assert code == 0 and "up to date" in err and "2 classes" in out


def test_text_task_usage_errors(files, tmp_path, capsys):
    train, valid = files["lm"]
    out = tmp_path / "x"
    cases = [
        (_text_args("lm", train, valid, out, "--src", "en"), "--src: only for translation"),
        (_text_args("lm", train, valid, out, "--max-len", "9"), "--max-len: only for translation"),
        (_text_args("lm", train, valid, out, "--label", "book"), "--label goes with --task"),
        (_text_args("lm", train, valid, out, "--lang", "es"), "go with --corpus bible"),
        (
            _text_args("lm", train, valid, out, "--tokenizer", "m", "--vocab-size", "50"),
            "drop --vocab-size",
        ),
        (["prepare", "--task", "lm", "--train", train, "--out", str(out)], "missing --valid"),
        (["prepare", "--task", "lm", "--corpus", "wmt14", "--out", str(out)], "no --corpus wmt14"),
        (
            ["prepare", "--train", train, "--valid", valid, "--src", "a", "--tgt", "b",
             "--tokenizer", "m", "--out", str(out)],
            "--tokenizer m: checkpoint m does not exist",
        ),
    ]  # fmt: skip
    for argv, needle in cases:
        code, _, err = _run(argv, capsys)
        assert needle in _error(code, err), (argv, err)


def test_text_data_errors_name_file_and_line(files, tmp_path, capsys):
    train, valid = files["classify"]
    Path(valid).write_text("cold\tsun\nwarm\tsea\n")
    code, _, err = _run(_text_args("classify", train, valid, tmp_path / "x"), capsys)
    assert f"{valid}, line 2: label 'warm' is not one of the 2 classes" in _error(code, err)
    lm_train, lm_valid = files["lm"]
    code, _, err = _run(
        _text_args("lm", lm_train, lm_valid, tmp_path / "y", "--tokenizer", train), capsys
    )
    assert f"{train}: not a usable sentencepiece model" in _error(code, err)


def test_prepare_bible_classify_by_book(tmp_path, capsys, request):
    if not bible.sword_paths(None):
        pytest.skip("the SWORD modules (sword-text-web, sword-text-sparv) are not installed")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "bible").symlink_to(request.getfixturevalue("bible_cache") / "bible")
    argv = ["prepare", "--task", "classify", "--corpus", "bible", "--label", "book"]
    argv += ["--vocab-size", "500", "--cache-dir", str(cache), "--out", str(tmp_path / "data")]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    assert "66 classes" in out and "\n    Gen " in out and "\n    Rev " in out
    assert load_manifest(tmp_path / "data")["labels"][:3] == ["Gen", "Exod", "Lev"]
