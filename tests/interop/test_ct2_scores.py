"""The CTranslate2 engine's scores and forced prefix: ``score_pairs`` and word scores through
CTranslate2's ``score_batch`` equal the PyTorch engine's; a prefix goes to CTranslate2's
``target_prefix``, is kept whole, and is scored (CTranslate2's own score leaves it out);
constraints are refused in one line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "ctranslate2", reason="CTranslate2 is not installed (pip install 'aiayn[interop]')"
)

from aiayn.config import DecodeConfig
from aiayn.data.collate import EOS_ID, collate_pairs
from aiayn.data.tokenizer import Tokenizer
from aiayn.inference.steering import Steering
from aiayn.inference.translator import Translator
from aiayn.interop.ct2 import export_ct2
from aiayn.interop.ct2_translator import Ct2Translator
from aiayn.model.transformer import Transformer
from tests.interop.reversal import sentence, trained_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def exported(tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_ct2(
        trained_model(tokenizer), tmp_path_factory.mktemp("ct2") / "ct2", tokenizer=tokenizer
    )


def teacher_forced(model: Transformer, source: list[int], target: list[int]) -> torch.Tensor:
    """The full distributions (T + 1, V) at each position of ``target`` and its EOS."""
    batch = collate_pairs([source], [target])
    with torch.inference_mode():
        return torch.log_softmax(model(batch.src_ids, batch.src_pad, batch.tgt_in)[0], -1)


def engines(
    tokenizer: Tokenizer, exported: Path, decode: DecodeConfig, nbest: int = 1
) -> tuple[Translator, Ct2Translator]:
    model = trained_model(tokenizer)
    return (
        Translator(model, tokenizer, decode, nbest=nbest, accelerated=False),
        Ct2Translator(exported, tokenizer, decode, model.config, nbest=nbest, threads=1),
    )


def test_scores_equal_the_pytorch_engines(tokenizer: Tokenizer, exported: Path) -> None:
    rng = random.Random(3)
    sources = [sentence(rng) for _ in range(12)]
    targets = [sentence(rng, 1, 10) for _ in range(12)]
    ours, theirs = engines(tokenizer, exported, DecodeConfig(beam_size=1, batch_tokens=20))
    mine, other = ours.score_pairs(sources, targets), theirs.score_pairs(sources, targets)
    for a, b in zip(mine, other, strict=True):
        assert b.tokens == a.tokens and len(b.token_log_probs) == len(a.tokens) + 1
        assert b.token_log_probs == pytest.approx(a.token_log_probs, abs=2e-5)
        assert b.log_prob == pytest.approx(a.log_prob, abs=1e-4)
    # translate's word scores: what CTranslate2's search summed, token by token
    ids = [tokenizer.encode(line) for line in sources]
    for hyps in theirs.with_word_scores(ids, theirs.translations(theirs.search_ids(ids))):
        assert hyps[0].token_log_probs is not None
        assert sum(hyps[0].token_log_probs) == pytest.approx(hyps[0].log_prob, abs=1e-4)


@pytest.mark.parametrize("beam", [1, 4])
def test_a_forced_prefix_is_kept_and_scored(
    beam: int, tokenizer: Tokenizer, exported: Path
) -> None:
    rng = random.Random(11)
    sources = [tokenizer.encode(sentence(rng, 2, 7)) for _ in range(8)]
    prefixes = [tuple(tokenizer.encode(sentence(rng, 1, 3))) for _ in sources]
    prefixes[3] = ()  # a sentence without one, in the same batch
    decode = DecodeConfig(beam_size=beam, beam_rule="fairseq", alpha=0.6, max_len_b=5)
    ours, theirs = engines(tokenizer, exported, decode, nbest=beam)
    steering = [Steering(prefix=p) for p in prefixes]
    found = theirs._search_batch(list(sources), steering=steering)
    model = trained_model(tokenizer)
    for source, prefix, hyps in zip(sources, prefixes, found, strict=True):
        assert len(hyps) == beam
        for h in hyps:
            assert tuple(h.tokens[: len(prefix)]) == prefix
            # the log-probability is the whole output's, prefix included, teacher-forced
            [score] = ours.score_ids([source], [h.tokens])
            assert h.log_prob == pytest.approx(score.log_prob, abs=1e-4)
        if beam == 1:  # after the prefix, greedy: the most probable token at each step
            h = hyps[0]
            dist = teacher_forced(model, source, h.tokens)
            limit = max(len(prefix), len(source) + 5)
            ended = len(h.tokens) < limit  # else EOS was forced at the limit
            chosen = [*h.tokens, EOS_ID][len(prefix) : len(h.tokens) + ended]
            assert dist[len(prefix) : len(h.tokens) + ended].argmax(-1).tolist() == chosen
    [alone] = theirs._search_batch([sources[3]])  # no prefix: as without one
    assert [h.tokens for h in found[3]] == [h.tokens for h in alone]
    assert [h.log_prob for h in found[3]] == pytest.approx([h.log_prob for h in alone], abs=1e-5)


def test_a_prefix_longer_than_the_limit_is_kept_whole(tokenizer: Tokenizer, exported: Path) -> None:
    decode = DecodeConfig(beam_size=1, max_len_a=0.0, max_len_b=1)
    _, theirs = engines(tokenizer, exported, decode)
    prefix = tuple(tokenizer.encode("alpha bravo charlie"))
    [[h]] = theirs._search_batch([tokenizer.encode("delta echo")], [Steering(prefix=prefix)])
    assert tuple(h.tokens) == prefix  # its limit is the prefix: EOS follows it


def test_constraints_are_refused_in_one_line(tokenizer: Tokenizer, exported: Path) -> None:
    _, theirs = engines(tokenizer, exported, DecodeConfig(beam_size=1))
    steering = [Steering(constraints=((5,),))]
    with pytest.raises(ValueError, match="no constrained search") as err:
        theirs._search_batch([[5, 6]], steering=steering)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"engine": "ctranslate2"}, "no constrained search: for --constraints, use --engine"),
        ({"quantize": "int8"}, r"search \(--quantize int8 decodes with CTranslate2\): for"),
    ],
)
def test_the_command_line_refuses_constraints_with_ctranslate2(
    options: dict[str, str], said: str
) -> None:
    import argparse

    from aiayn.cli.engines import check_engine_options
    from aiayn.errors import CLIError

    given = {"engine": None, "quantize": None, "threads": None, "device": None, **options}
    args = argparse.Namespace(**given, constraints="terms.tsv")
    with pytest.raises(CLIError, match=said):
        check_engine_options(args)
    check_engine_options(argparse.Namespace(**given))  # without constraints: accepted
