"""Corpus BLEU and chrF with sacreBLEU, each with its signature; and, labelled as such, the
paper-style tokenised BLEU.

sacreBLEU scores detokenised text with its own fixed tokenisation, so its numbers can be
compared across papers; its signature records every setting. The paper's BLEU (like
tensor2tensor's ``get_ende_bleu.sh``) was computed on tokenised text with hyphenated compounds
split (``Haus-Boot`` → ``Haus ##AT##-##AT## Boot``) by ``multi-bleu.perl``; that number is
usually higher and is not comparable with sacreBLEU's. :func:`tokenized_bleu` approximates it
with sacreBLEU's 13a tokeniser (the Moses tokeniser itself is not a dependency).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from sacrebleu.metrics.bleu import BLEU
from sacrebleu.metrics.chrf import CHRF
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

from aiayn.progress import counted

TOKENIZED_NOTE = "paper-style tokenised BLEU, not comparable with sacreBLEU"

_COMPOUND = re.compile(r"(\S)-(\S)")


@dataclass(frozen=True)
class MetricScore:
    """One corpus-level score: ``line`` is the full report, signature included."""

    name: str
    score: float
    signature: str
    line: str


def _check(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    """A TypeError or ValueError for what sacreBLEU would misread or fail on: one string for
    the hypotheses (a line per character) or for a reference set, references given as one set
    (a list of strings, not a list of sets), no lines at all, sets of other lengths."""
    if isinstance(hypotheses, str):
        raise TypeError("hypotheses: a list of lines, not one string")
    if isinstance(references, str):
        raise TypeError(
            "references: a list of reference sets (each a list of lines), not one string"
        )
    if not references:
        raise ValueError("references: a list of reference sets (each a list of lines) is needed")
    if isinstance(references[0], str):
        raise TypeError(
            "references: a list of reference sets, each a list of lines parallel to the "
            "hypotheses; for one set, pass [references]"
        )
    if not hypotheses:
        raise ValueError("no hypotheses: nothing to score")
    for i, refs in enumerate(references, start=1):
        if isinstance(refs, str):
            raise TypeError(f"reference set {i}: a list of lines, not one string")
        if len(refs) != len(hypotheses):
            raise ValueError(
                f"{counted(len(hypotheses), 'hypothesis', 'hypotheses')} but "
                f"{counted(len(refs), 'line')} in reference set {i}"
            )


def sacrebleu_bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> MetricScore:
    """sacreBLEU's corpus BLEU (13a tokenisation, mixed case, exponential smoothing).
    ``references`` is a list of reference sets, each parallel to ``hypotheses``."""
    _check(hypotheses, references)
    metric = BLEU()
    result = metric.corpus_score(list(hypotheses), [list(r) for r in references])
    signature = str(metric.get_signature())
    return MetricScore("BLEU", result.score, signature, result.format(signature=signature))


def sacrebleu_chrf(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> MetricScore:
    """sacreBLEU's corpus chrF (character 6-grams, β = 2)."""
    _check(hypotheses, references)
    metric = CHRF()
    result = metric.corpus_score(list(hypotheses), [list(r) for r in references])
    signature = str(metric.get_signature())
    return MetricScore("chrF2", result.score, signature, result.format(signature=signature))


def paper_tokenize(line: str) -> str:
    """13a tokens with hyphenated compounds split as in tensor2tensor's ``get_ende_bleu.sh``
    (``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g``)."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", Tokenizer13a()(line.strip()))


def tokenized_bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> MetricScore:
    """The paper-style tokenised BLEU (see the module docstring): BLEU over
    :func:`paper_tokenize` tokens, case-sensitive, without smoothing (``multi-bleu.perl``)."""
    _check(hypotheses, references)
    metric = BLEU(tokenize="none", smooth_method="none", force=True)
    hyps = [paper_tokenize(h) for h in hypotheses]
    refs = [[paper_tokenize(r) for r in ref_set] for ref_set in references]
    result = metric.corpus_score(hyps, refs)
    signature = f"{metric.get_signature()}|pretok:13a+compound-split"
    numbers = result.format(score_only=False).split(" = ", 1)[1]
    line = f"tokenized-BLEU|{signature} = {numbers}  ({TOKENIZED_NOTE})"
    return MetricScore("tokenized BLEU", result.score, signature, line)


def score_corpus(
    hypotheses: Sequence[str], references: Sequence[Sequence[str]], *, tokenized: bool = False
) -> list[MetricScore]:
    """sacreBLEU BLEU and chrF, plus the paper-style tokenised BLEU when ``tokenized``."""
    scores = [sacrebleu_bleu(hypotheses, references), sacrebleu_chrf(hypotheses, references)]
    if tokenized:
        scores.append(tokenized_bleu(hypotheses, references))
    return scores
