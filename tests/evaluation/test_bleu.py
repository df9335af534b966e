"""BLEU, chrF and the paper-style tokenised BLEU, against n-gram counts done by hand."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.evaluation.bleu import (
    paper_tokenize,
    sacrebleu_bleu,
    sacrebleu_chrf,
    score_corpus,
    tokenized_bleu,
)


def test_sacrebleu_bleu_by_hand() -> None:
    hyp = ["the cat sat on the mat"]
    ref = [["the cat sat on a mat"]]
    # Clipped n-gram matches: 1-grams 5/6 (one 'the' only), 2-grams 3/5, 3-grams 2/4,
    # 4-grams 1/3; equal lengths, so no brevity penalty.
    expected = 100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** (1 / 4)
    score = sacrebleu_bleu(hyp, ref)
    assert score.score == pytest.approx(expected)
    assert score.signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert score.line.startswith(f"BLEU|{score.signature} = {expected:.2f}")


def test_brevity_penalty_by_hand() -> None:
    hyp = ["a b c d e f"]
    ref = [["a b c d e f g h"]]
    # All n-grams match; BP = exp(1 - r/c) = exp(1 - 8/6).
    assert sacrebleu_bleu(hyp, ref).score == pytest.approx(100 * math.exp(1 - 8 / 6))


def test_chrf_perfect_and_signature() -> None:
    score = sacrebleu_chrf(["Ein Haus am See."], [["Ein Haus am See."]])
    assert score.score == pytest.approx(100.0)
    assert score.line.startswith("chrF2|nrefs:1|")


def test_paper_tokenize_splits_compounds() -> None:
    assert paper_tokenize("Das Haus-Boot (neu).") == "Das Haus ##AT##-##AT## Boot ( neu ) ."
    # As with the perl s///g of tensor2tensor's script: matches do not overlap.
    assert paper_tokenize("a-b-c") == "a ##AT##-##AT## b-c"


def test_tokenized_bleu_by_hand() -> None:
    hyp = ["Das Haus-Boot."]
    ref = [["Das Haus-Boot!"]]
    # Tokens: Das Haus ##AT##-##AT## Boot . / ! — 1-grams 4/5, 2-grams 3/4, 3-grams 2/3,
    # 4-grams 1/2.
    expected = 100 * (4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** (1 / 4)
    score = tokenized_bleu(hyp, ref)
    assert score.score == pytest.approx(expected)
    assert score.line.startswith("tokenized-BLEU|")
    assert "not comparable with sacreBLEU" in score.line
    # No smoothing (multi-bleu.perl): without a matching 4-gram the score is 0.
    assert tokenized_bleu(["a b c"], [["a b c"]]).score == 0.0
    assert len(score_corpus(hyp, ref)) == 2
    assert len(score_corpus(hyp, ref, tokenized=True)) == 3


def test_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 hypotheses but 1 line in"):
        sacrebleu_bleu(["a", "b"], [["a"]])


@pytest.mark.parametrize(
    ("hypotheses", "references", "error", "message"),
    [
        ([], [[]], ValueError, "no hypotheses: nothing to score"),
        ("abc", [["a", "b", "c"]], TypeError, "hypotheses: a list of lines, not one string"),
        (["a b", "c d"], ["a b", "c d"], TypeError, "for one set, pass \\[references\\]"),
        (["a b"], [], ValueError, "a list of reference sets"),
        (["a b"], "a b", TypeError, "reference sets \\(each a list of lines\\), not one string"),
        (["abc"], [["abc"], "abc"], TypeError, "reference set 2: a list of lines"),
    ],
)
def test_what_would_be_misread_is_refused(hypotheses, references, error, message) -> None:
    for metric in (sacrebleu_bleu, sacrebleu_chrf, tokenized_bleu):
        with pytest.raises(error, match=message):
            metric(hypotheses, references)


def test_bleu_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hyp = tmp_path / "hyp.txt"
    ref = tmp_path / "ref.txt"
    hyp.write_text("the cat sat on the mat\nDas Haus-Boot.\n", encoding="utf-8")
    ref.write_text("the cat sat on a mat\nDas Haus-Boot!\n", encoding="utf-8")
    assert main(["bleu", str(hyp), str(ref), "--tokenized"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0] for line in lines] == ["BLEU", "chrF2", "tokenized-BLEU"]

    short = tmp_path / "short.txt"
    short.write_text("one line\n", encoding="utf-8")
    assert main(["bleu", str(hyp), str(short)]) == 2
    assert "short.txt has 1 line but" in capsys.readouterr().err

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\n\xff\xfe broken\n")
    assert main(["bleu", str(bad), str(ref)]) == 2
    assert "bad.txt: line 2 is not valid UTF-8" in capsys.readouterr().err


def test_bleu_reads_hypotheses_from_stdin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-` reads the hypotheses from stdin, as sacrebleu does: the same scores as the file."""
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("the cat sat on the mat\nDas Haus-Boot.\n", encoding="utf-8")
    ref.write_text("the cat sat on a mat\nDas Haus-Boot!\n", encoding="utf-8")
    assert main(["bleu", str(hyp), str(ref)]) == 0
    from_file = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(hyp.read_bytes())))
    assert main(["bleu", "-", str(ref)]) == 0
    assert capsys.readouterr().out == from_file
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"one\n")))
    assert main(["bleu", "-", str(ref)]) == 2
    assert "ref.txt has 2 lines but stdin has 1" in capsys.readouterr().err
    assert main(["bleu", str(hyp), "-"]) == 2
    assert "only HYPOTHESES may be -" in capsys.readouterr().err
