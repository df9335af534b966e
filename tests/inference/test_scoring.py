"""Scores of given translations (aiayn.inference.scoring and ``TextTranslator.score_pairs``):
the log-probabilities search decodes with, teacher-forced; what greedy and beam search report
for their own outputs; batch invariance; the errors that name the line."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import DecodeConfig, load_config
from aiayn.data.collate import BOS_ID, PAD_ID, collate_pairs
from aiayn.inference.scoring import batches_by_tokens, f32_sum, score_of, token_log_probs
from aiayn.inference.translator import Translator
from aiayn.model.transformer import Transformer
from tests.inference.test_translator import CharTokenizer, random_words, sentences

# Letters 'a'..'h' only: every output of the copy model is text that tokenises back to it.
TOKENIZER = CharTokenizer()


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(*overrides: str) -> Transformer:
    config = load_config(overrides=["preset=tiny", "model.dropout=0", *overrides])
    return Transformer(config.model)


@pytest.fixture(scope="module")
def model() -> Transformer:
    """A tiny model trained for a few dozen steps to copy its input (its outputs end with EOS
    at various lengths)."""
    torch.manual_seed(0)
    rng = random.Random(0)
    model = tiny()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3, betas=(0.9, 0.98))
    for _ in range(60):
        src = [TOKENIZER.encode(random_words(rng, 1, 6)) for _ in range(32)]
        batch = collate_pairs(src, src)
        logits = model(batch.src_ids, batch.src_pad, batch.tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def reference(model: Transformer, source: list[int], target: list[int]) -> list[float]:
    """One pair alone, the plain way: the log-softmax of the full logits, gathered."""
    batch = collate_pairs([source], [target])
    with torch.inference_mode():
        logits = model(batch.src_ids, batch.src_pad, batch.tgt_in)[0]
    log_probs = torch.log_softmax(logits.double(), -1)
    return log_probs.gather(-1, batch.tgt_out[0][:, None])[:, 0].tolist()


def test_token_log_probs_are_the_teacher_forced_distributions(model: Transformer) -> None:
    rng = random.Random(4)
    sources = [TOKENIZER.encode(random_words(rng, 1, 12)) for _ in range(9)]
    targets = [TOKENIZER.encode(random_words(rng, 0, 12)) for _ in range(9)]  # one may be empty
    got = token_log_probs(model, sources, targets, device=torch.device("cpu"))
    for source, target, lps in zip(sources, targets, got, strict=True):
        assert len(lps) == len(target) + 1
        assert lps == pytest.approx(reference(model, source, target), abs=2e-5)


def test_a_model_without_bos_output_is_renormalised(model: Transformer) -> None:
    """``model.bos_output = false``: each probability divided by 1 - p(BOS), as
    never_pad_or_bos decodes."""
    sources, targets = [TOKENIZER.encode("abc")], [TOKENIZER.encode("cab")]
    [plain] = token_log_probs(model, sources, targets, device=torch.device("cpu"))
    [renormalised] = token_log_probs(
        model, sources, targets, device=torch.device("cpu"), bos_output=False
    )
    batch = collate_pairs(sources, targets)
    with torch.inference_mode():
        p_bos = torch.softmax(model(batch.src_ids, batch.src_pad, batch.tgt_in)[0], -1)[:, BOS_ID]
    expected = [lp - float(torch.log1p(-p)) for lp, p in zip(plain, p_bos, strict=True)]
    assert renormalised == pytest.approx(expected, abs=2e-5)
    assert all(r > p for r, p in zip(renormalised, plain, strict=True))


@pytest.mark.parametrize("beam", [1, 4])
def test_scoring_the_searched_output_gives_its_log_prob(model: Transformer, beam: int) -> None:
    """Greedy search's output (and beam search's n-best), scored as text: the tokens emitted,
    and the log-probability search reported, to float32 rounding."""
    decode = DecodeConfig(beam_size=beam, alpha=0.0, max_len_b=6, batch_tokens=60)
    translator = Translator(model, TOKENIZER, decode, nbest=beam)
    lines = sentences(40, seed=3, longest=10)
    results = translator.translate_nbest(lines)
    ended = [
        len(h.tokens) < len(line) + 6
        for line, hyps in zip(lines, results, strict=True)
        for h in hyps
    ]
    assert sum(ended) > 20  # hypotheses that ended with EOS, not at the limit
    pairs = [(line, h) for line, hyps in zip(lines, results, strict=True) for h in hyps]
    pairs = [(line, h) for line, h in pairs if h.text]  # an empty output is no text to score
    scores = translator.score_pairs([line for line, _ in pairs], [h.text for _, h in pairs])
    for (_, hyp), score in zip(pairs, scores, strict=True):
        assert score.tokens == hyp.tokens
        assert score.log_prob == pytest.approx(hyp.log_prob, abs=1e-4)
        assert score.mean == pytest.approx(hyp.log_prob / (len(hyp.tokens) + 1), abs=1e-4)
    # The same scores attached to the translations (translate --word-scores), empty ones too.
    sources = [TOKENIZER.encode(line) for line in lines]
    scored = translator.with_word_scores(sources, results)
    for hyps, plain in zip(scored, results, strict=True):
        for h, p in zip(hyps, plain, strict=True):
            assert (h.tokens, h.text, h.score, p.token_log_probs) == (
                p.tokens,
                p.text,
                p.score,
                None,
            )
            assert h.token_log_probs is not None and len(h.token_log_probs) == len(h.tokens) + 1
            assert f32_sum(h.token_log_probs) == pytest.approx(h.log_prob, abs=1e-4)


def test_scores_do_not_depend_on_the_batch(model: Transformer) -> None:
    rng = random.Random(8)
    sources = [random_words(rng, 1, 14) for _ in range(30)]
    targets = [random_words(rng, 1, 14) for _ in range(30)]
    small = Translator(model, TOKENIZER, DecodeConfig(batch_tokens=16))  # a pair or two
    large = Translator(model, TOKENIZER, DecodeConfig(batch_tokens=4096))  # all at once
    batches: list[int] = []
    small.on_batch = batches.append
    apart, together = small.score_pairs(sources, targets), large.score_pairs(sources, targets)
    assert len(batches) > 10 and sum(batches) == 30
    # translate --word-scores' extra pass is no progress of the translation's lines
    ids = [TOKENIZER.encode(line) for line in sources]
    small.with_word_scores(ids, small.translations(small.search_ids(ids)))
    assert sum(batches) == 60 and small.on_batch is not None
    for a, b in zip(apart, together, strict=True):
        assert a.tokens == b.tokens
        assert a.token_log_probs == pytest.approx(b.token_log_probs, abs=2e-5)


def test_batches_by_tokens() -> None:
    rng = random.Random(2)
    sources = [[5] * rng.randint(1, 20) for _ in range(50)]
    targets = [[6] * rng.randint(0, 20) for _ in range(50)]
    batches = batches_by_tokens(sources, targets, 40)
    assert sorted(i for batch in batches for i in batch) == list(range(50))
    widths = [max(len(s), len(t)) + 1 for s, t in zip(sources, targets, strict=True)]
    for batch in batches:
        assert len(batch) * max(widths[i] for i in batch) <= 40
    assert [widths[i] for batch in batches for i in batch] == sorted(widths, reverse=True)
    assert batches_by_tokens([[5] * 30], [[6]], 8) == [[0]]  # one pair over the budget alone


def test_score_of_sums_in_float32() -> None:
    score = score_of([7, 8], [-0.1, -0.2, -0.3])
    assert score.log_prob == float(torch.tensor([-0.1, -0.2, -0.3]).sum())
    assert score.mean == pytest.approx(-0.2)
    with pytest.raises(ValueError, match="2 target tokens need 3 log-probabilities"):
        score_of([7, 8], [-0.1, -0.2])


def test_bad_pairs_name_the_line(model: Transformer) -> None:
    warnings: list[str] = []
    translator = Translator(tiny("model.max_positions=8"), TOKENIZER, warn=warnings.append)
    with pytest.raises(ValueError, match="line 12: the target is empty"):
        translator.score_pairs(["ab", "cd"], ["ab", " "], first_line=11)
    with pytest.raises(ValueError, match="line 1: the source is empty"):
        translator.score_pairs([""], ["ab"])
    with pytest.raises(ValueError, match="2 source lines but 1 target lines"):
        translator.score_pairs(["ab", "cd"], ["ab"])
    with pytest.raises(ValueError, match=r"line 2: the target's 8 tokens .* 8 positions"):
        translator.score_pairs(["ab", "cd"], ["ab", "abcdefgh"])
    with pytest.raises(TypeError, match="takes a list of lines"):
        translator.score_pairs("ab", "cd")
    # A source longer than the positions is cut to fit, as translate cuts it.
    [score] = translator.score_pairs(["abcdefghab"], ["abcdefg"])
    assert len(score.token_log_probs) == 8
    assert warnings and "line 1" in warnings[0]


class TargetSideTokenizer(CharTokenizer):
    """A tokenizer whose target side has its own encoder (as a Marian model's): the letters
    reversed in order."""

    def encode_target_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text)[::-1] for text in texts]


def test_targets_are_encoded_by_the_target_side(model: Transformer) -> None:
    translator = Translator(model, TargetSideTokenizer(), DecodeConfig())
    [score] = translator.score_pairs(["abc"], ["abd"])
    assert score.tokens == TOKENIZER.encode("dba")


@pytest.mark.parametrize("arch", ["bahdanau", "luong"])
def test_the_rnn_baselines_score_as_their_logits_say(arch: str) -> None:
    from aiayn.model.families import build_model

    config = load_config(overrides=["preset=tiny", "model.dropout=0", f"model.arch={arch}"])
    torch.manual_seed(3)
    rnn = build_model(config.model).eval()
    translator = Translator(rnn, TOKENIZER, DecodeConfig(batch_tokens=30))
    rng = random.Random(6)
    sources = [random_words(rng, 1, 9) for _ in range(7)]
    targets = [random_words(rng, 1, 9) for _ in range(7)]
    for src, tgt, score in zip(
        sources, targets, translator.score_pairs(sources, targets), strict=True
    ):
        expected = reference(rnn, TOKENIZER.encode(src), TOKENIZER.encode(tgt))
        assert score.token_log_probs == pytest.approx(expected, abs=2e-5)
