"""``aiayn score``: one line per pair, 'LOG_PROB<TAB>MEAN[<TAB>WORD_SCORES]'; the score it
gives the model's greedy output is what ``translate --beam 1 --alpha 0 --word-scores`` and
``translate --nbest`` print for it; bad files are one-line errors naming the file and line;
``--engine ctranslate2`` prints what the PyTorch engine prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.inference.translator import Translator
from tests.helpers import TINY, WORDS

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def run(reverse_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of a few updates of the reversal task."""
    out = tmp_path_factory.mktemp("score") / "run"
    argv = ["train", "--config", TINY, "--data", str(reverse_data_dir), "--out", str(out)]
    assert main([*argv, "train.max_steps=30", "train.valid_interval=0", "--no-progress"]) == 0
    return out


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "src.txt"
    path.write_text("".join(" ".join(WORDS[i % 5 : i % 5 + 2 + i % 4]) + "\n" for i in range(12)))
    return path


def call(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def test_score_agrees_with_translate(
    run: Path, source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--device", "cpu", "--batch-tokens", "16"]
    code, lines, _ = call(
        capsys,
        *("translate", str(run), "-i", str(source), "--beam", "1", "--alpha", "0"),
        *("--nbest", "1", "--word-scores", *common),
    )
    assert code == 0 and len(lines) == 12
    fields = [line.split("\t") for line in lines]
    assert all(len(f) == 4 for f in fields)  # text, log-prob, mean, word scores
    # The lines whose text tokenises back to the tokens emitted (an empty one has no score).
    translator, _ = Translator.from_checkpoint(run, decode_overrides={"beam_size": 1})
    src_lines = source.read_text().splitlines()
    emitted = [hyps[0] for hyps in translator.translate_nbest(src_lines)]
    same = [
        i
        for i, h in enumerate(emitted)
        if h.text and translator.tokenizer.encode(h.text) == h.tokens
    ]
    assert len(same) >= 6
    assert [fields[i][0] for i in same] == [emitted[i].text for i in same]
    pair_src, pair_tgt = tmp_path / "pairs.src", tmp_path / "pairs.tgt"
    pair_src.write_text("".join(src_lines[i] + "\n" for i in same))
    pair_tgt.write_text("".join(fields[i][0] + "\n" for i in same))
    argv = ["score", str(run), "--src", str(pair_src), "--tgt", str(pair_tgt), *common]
    code, scored, err = call(capsys, *argv)
    assert code == 0 and f"scored {len(same)} pairs" in err, err
    assert all(len(line.split("\t")) == 2 for line in scored)
    code, with_words, _ = call(capsys, *argv, "--word-scores")
    for row, i in enumerate(same):
        log_prob, mean, words = fields[i][1:]
        assert [float(v) for v in scored[row].split("\t")] == pytest.approx(
            [float(log_prob), float(mean)], abs=2e-4
        )
        assert with_words[row].startswith(scored[row] + "\t")
        theirs = with_words[row].split("\t")[2].split()
        assert [float(v) for v in theirs] == pytest.approx(
            [float(v) for v in words.split()], abs=2e-4
        )
        assert len(theirs) == len(emitted[i].tokens) + 1
        assert sum(float(v) for v in theirs) == pytest.approx(float(log_prob), abs=2e-3)
    # translate --nbest prints, at alpha 0, the log-probability that score gives its text
    code, nbest, _ = call(
        capsys,
        *("translate", str(run), "-i", str(source), "--beam", "2", "--alpha", "0"),
        *("--beam-rule", "fairseq", "--nbest", "2", *common),
    )
    assert code == 0 and len(nbest) == 24
    rows = [
        (src_lines[n // 2], float(score), text)
        for n, (_, score, text) in enumerate(line.split("\t") for line in nbest)
        if text and translator.tokenizer.decode(translator.tokenizer.encode(text)) == text
    ]
    pair_src.write_text("".join(src + "\n" for src, _, _ in rows))
    pair_tgt.write_text("".join(text + "\n" for _, _, text in rows))
    code, rescored, _ = call(capsys, *argv)
    compared = 0
    for (_, score, _), line in zip(rows, rescored, strict=True):
        assert float(line.split("\t")[0]) == pytest.approx(score, abs=2e-4)
        compared += 1
    assert compared >= 4


@pytest.mark.parametrize(
    ("src", "tgt", "said"),
    [
        (b"a b\nc d\n", b"a b\n", r"tgt.txt: line 2 is missing: .*tgt.txt has 1 line, "),
        (b"a b\nc d\n", b"a b\nc d\ne\n", r"src.txt: line 3 is missing"),
        (b"a b\n\n", b"a b\nc d\n", r"src.txt: line 2 is empty"),
        (b"a b\nc d\n", b"a b\n  \n", r"tgt.txt: line 2 is empty"),
        (b"a b\nc d\n", b"a b\nc \xff\n", r"tgt.txt: line 2 is not valid UTF-8"),
    ],
)
def test_bad_files_are_one_line(
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    src: bytes,
    tgt: bytes,
    said: str,
) -> None:
    (tmp_path / "src.txt").write_bytes(src)
    (tmp_path / "tgt.txt").write_bytes(tgt)
    argv = ["score", str(run), "--src", str(tmp_path / "src.txt")]
    code, out, err = call(capsys, *argv, "--tgt", str(tmp_path / "tgt.txt"))
    assert code == 2 and out == []
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("aiayn score: error: ")
    assert re.search(said, err)


def test_the_ctranslate2_engine_prints_the_same(
    run: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip(
        "ctranslate2", reason="CTranslate2 is not installed (pip install 'aiayn[interop]')"
    )
    argv = ["score", str(run), "--src", str(source), "--tgt", str(source), "--word-scores"]
    code, ours, _ = call(capsys, *argv, "--device", "cpu")
    assert code == 0
    code, theirs, _ = call(capsys, *argv, "--engine", "ctranslate2", "--threads", "1")
    assert code == 0 and len(theirs) == len(ours) == 12
    for a, b in zip(ours, theirs, strict=True):
        mine, other = a.split("\t"), b.split("\t")
        assert [float(v) for v in other[:2]] == pytest.approx(
            [float(v) for v in mine[:2]], abs=2e-4
        )
        assert len(other[2].split()) == len(mine[2].split())


def test_interactive_translation_with_word_scores(
    run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiayn.cli import translate as translate_command

    translator, _ = Translator.from_checkpoint(run, decode_overrides={"beam_size": 1})
    typed = iter(["alpha bravo charlie", ""])

    def next_line() -> str:
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", next_line)
    translate_command._interactive(translator, 1, True)
    first, empty = capsys.readouterr().out.splitlines()
    [hyp] = translator.translate_nbest(["alpha bravo charlie"])[0]
    text, log_prob, mean, words = first.split("\t")
    assert text == hyp.text and float(log_prob) == pytest.approx(hyp.log_prob, abs=1e-4)
    assert len(words.split()) == len(hyp.tokens) + 1
    assert float(mean) == pytest.approx(hyp.log_prob / (len(hyp.tokens) + 1), abs=1e-4)
    assert empty == "\t0.0000\t0.0000\t"


def test_the_word_score_fields_of_translate() -> None:
    from aiayn.cli.translate import format_translations
    from aiayn.inference.translator import Translation

    hyp = Translation("ab", -0.5, -1.5, [4, 5], [-1.0, -0.25, -0.25])
    assert format_translations([[hyp]], 1, True) == [
        "ab\t-1.5000\t-0.5000\t-1.0000 -0.2500 -0.2500"
    ]
    assert format_translations([[hyp], []], 2, True) == [
        "1\t-0.5000\tab\t-1.5000\t-0.5000\t-1.0000 -0.2500 -0.2500",
        "2\t-inf\t\t0.0000\t0.0000\t",  # a missing hypothesis
        "1\t0.0000\t\t0.0000\t0.0000\t",  # an empty input line
        "2\t0.0000\t\t0.0000\t0.0000\t",
    ]
    assert format_translations([[hyp], []], 1) == ["ab", ""]  # without: as before
