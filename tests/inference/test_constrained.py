"""Steered search (terminology constraints by dynamic beam allocation, a forced prefix) on
pseudo-random log-probability tables: every hypothesis holds every phrase whole, starts with
its prefix and is scored along all its tokens; and it reduces to beam search where nothing
steers."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import DecodeConfig, replace
from aiayn.data.collate import PAD_ID, collate_pairs
from aiayn.inference.constrained import (
    progress_after,
    remaining,
    remaining_host,
    steered_search,
    tokens_needed,
)
from aiayn.inference.search import BEAM_RULES, Hypothesis, beam_search, greedy_search
from aiayn.inference.steering import Steering
from aiayn.inference.translator import Translator
from tests.inference.test_search import PrefixCache, step_fn
from tests.inference.test_translator import CharTokenizer, random_words, sentences, tiny_model

BOS, EOS = 2, 3
V = 12  # tokens 4 .. 11 are words
NEG = float("-inf")


def table(seed: int):  # type: ignore[no-untyped-def]
    """Prefix-dependent random distributions; EOS grows more likely with length."""

    def logp(sentence: int, prefix: tuple[int, ...]) -> list[float]:
        rng = random.Random(hash((seed, sentence, prefix)))
        logits = [rng.gauss(0.0, 2.0) for _ in range(V)]
        logits[EOS] += 0.5 * len(prefix) - 1.0
        logits[BOS] = logits[0] = NEG
        top = max(logits)
        norm = top + math.log(sum(math.exp(x - top) for x in logits))
        return [x - norm for x in logits]

    return logp


def search(
    seed: int, steering: list[Steering], k: int, limits: list[int], **kwargs: object
) -> list[list[Hypothesis]]:
    cache = PrefixCache([i for i in range(len(steering)) for _ in range(k)])
    return steered_search(
        step_fn(table(seed)),
        cache,  # type: ignore[arg-type]
        steering,
        beam_size=k,
        max_len=torch.tensor(limits),
        **kwargs,  # type: ignore[arg-type]
    )


def contains(tokens: list[int], phrase: tuple[int, ...]) -> bool:
    n = len(phrase)
    return any(tuple(tokens[i : i + n]) == phrase for i in range(len(tokens) - n + 1))


def log_prob_of(seed: int, sentence: int, tokens: list[int]) -> float:
    """The table's log-probability of ``tokens`` and EOS, summed in float32 as search does."""
    logp = table(seed)
    total = torch.zeros((), dtype=torch.float32)
    for i, token in enumerate([*tokens, EOS]):
        total += torch.tensor(logp(sentence, tuple(tokens[:i]))[token], dtype=torch.float32)
    return float(total)


STEERINGS = [
    Steering(((7,),)),  # one token
    Steering(((5, 9, 6),)),  # several tokens
    Steering(((8,), (10, 4))),  # two phrases
    Steering(((6, 4), (6, 11))),  # two phrases that share their first token
    Steering(((4, 4, 5),)),  # a phrase that repeats its first token
    Steering((), (9, 9, 10)),  # a prefix
    Steering(((11, 5),), (7, 11)),  # a prefix that starts a phrase
    Steering(),  # nothing
]


@pytest.mark.parametrize("rule", BEAM_RULES)
@pytest.mark.parametrize(("k", "nbest"), [(1, 1), (2, 2), (4, 1), (4, 3)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_hypothesis_meets_its_constraints_and_prefix(
    k: int, nbest: int, rule: str, seed: int
) -> None:
    limits = [3, 6, 5, 4, 9, 8, 12, 7]
    found = search(seed, STEERINGS, k, limits, nbest=nbest, rule=rule, alpha=0.6)
    for i, (steer, hyps) in enumerate(zip(STEERINGS, found, strict=True)):
        assert 1 <= len(hyps) <= nbest
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:
            assert len(h.tokens) <= limits[i] and EOS not in h.tokens
            assert h.tokens[: len(steer.prefix)] == list(steer.prefix)
            for phrase in steer.constraints:
                assert contains(h.tokens, phrase), (i, phrase, h.tokens)
            # Scored along every token, the prefix's too, and normalised as beam search does.
            assert h.log_prob == pytest.approx(log_prob_of(seed, i, h.tokens), abs=1e-5)
            assert h.score == pytest.approx(h.log_prob / ((6 + len(h.tokens)) / 6) ** 0.6)


@pytest.mark.parametrize("rule", BEAM_RULES)
@pytest.mark.parametrize("k", [2, 4])
def test_without_steering_it_is_beam_search(k: int, rule: str) -> None:
    limits = [3, 9, 1, 12, 6, 0]
    for seed in range(3):
        steered = search(seed, [Steering()] * len(limits), k, limits, rule=rule, nbest=2)
        cache = PrefixCache([i for i in range(len(limits)) for _ in range(k)])
        plain = beam_search(
            step_fn(table(seed)),
            cache,  # type: ignore[arg-type]
            len(limits),
            beam_size=k,
            max_len=torch.tensor(limits),
            rule=rule,
            nbest=2,
        )
        assert [[h.tokens for h in hyps] for hyps in steered] == [
            [h.tokens for h in hyps] for hyps in plain
        ]
        for a, b in zip(steered, plain, strict=True):
            assert [h.score for h in a] == pytest.approx([h.score for h in b])


def test_beam_one_with_a_prefix_is_greedy_search_from_it() -> None:
    prefix = (9, 4)
    limits = [10, 3, 7]
    found = search(3, [Steering((), prefix)] * 3, 1, limits, rule="fairseq")
    for i, hyps in enumerate(found):
        (h,) = hyps
        assert tuple(h.tokens[:2]) == prefix
        # After the prefix: the best token each step, until EOS or the limit.
        logp = table(3)
        tokens = list(prefix)
        while len(tokens) < limits[i]:
            row = logp(i, tuple(tokens))
            best = max(range(V), key=lambda v: row[v])
            if best == EOS:
                break
            tokens.append(best)
        assert h.tokens == tokens
    # Nothing steered at beam 1: greedy search's tokens.
    plain = greedy_search(
        step_fn(table(3)),
        PrefixCache([0, 1, 2]),  # type: ignore[arg-type]
        3,
        max_len=torch.tensor(limits),
    )
    unsteered = search(3, [Steering()] * 3, 1, limits, rule="fairseq")
    assert [hyps[0].tokens for hyps in unsteered] == [h.tokens for h in plain]


def test_constraints_that_just_fit_are_met_at_the_limit() -> None:
    steering = [Steering(((5, 6), (7,))), Steering(((8, 9, 10),), (4,))]
    for k in (1, 4):
        found = search(4, steering, k, [3, 4])
        assert sorted(found[0][0].tokens) == [5, 6, 7]
        assert found[1][0].tokens[0] == 4 and contains(found[1][0].tokens, (8, 9, 10))


def test_constraints_beyond_the_limit_are_refused() -> None:
    with pytest.raises(ValueError, match=r"sentence 1: .* need 4 output tokens, more than"):
        search(0, [Steering(((4,),)), Steering(((5, 6), (7, 8)))], 2, [5, 3])
    with pytest.raises(ValueError, match="need 3 output tokens"):
        search(0, [Steering((), (4, 5, 6))], 2, [2])


def test_progress_and_what_remains() -> None:
    phrases = [(4, 4, 5), (4, 6)]
    assert progress_after(phrases, [4]) == [1, 1]
    assert progress_after(phrases, [4, 4]) == [2, 1]
    assert progress_after(phrases, [4, 4, 4]) == [1, 1]  # broken: restarts from its first token
    assert progress_after(phrases, [4, 6, 7]) == [0, 2]  # met stays met
    assert progress_after(phrases, [4, 4, 5]) == [3, 0]
    # The whole of each unmet phrase, less the furthest progress.
    assert remaining_host(phrases, [2, 1]) == 5 - 2
    assert remaining_host(phrases, [3, 1]) == 1
    assert remaining_host(phrases, [3, 2]) == 0
    lengths = torch.tensor([3, 2])
    progress = torch.tensor([[2, 1], [3, 1], [3, 2], [0, 0]])
    assert remaining(progress, lengths).tolist() == [3, 1, 0, 5]
    assert tokens_needed(Steering(tuple(phrases), (4, 4))) == 2 + 1 + 2
    assert tokens_needed(Steering()) == 0


def test_one_sentence_does_not_depend_on_its_batch() -> None:
    limits = [3, 6, 5, 4, 9, 8, 12, 7]
    together = search(5, STEERINGS, 4, limits)
    for i in (1, 3, 6):
        cache = PrefixCache([i] * 4)
        alone = steered_search(
            step_fn(table(5)),
            cache,  # type: ignore[arg-type]
            [STEERINGS[i]],
            beam_size=4,
            max_len=torch.tensor([limits[i]]),
        )
        assert [h.tokens for h in alone[0]] == [h.tokens for h in together[i]]


# -- the translator: text constraints and prefixes, with a tiny model that copies ------------


@pytest.fixture(scope="module")
def copier() -> Translator:
    """A tiny model trained a few dozen steps to copy its input (letters and spaces)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = random.Random(0)
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3, betas=(0.9, 0.98))
    model.train()
    for _ in range(80):
        src = [CharTokenizer().encode(random_words(rng, 1, 6)) for _ in range(32)]
        batch = collate_pairs(src, src)
        logits = model(batch.src_ids, batch.src_pad, batch.tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    decode = DecodeConfig(max_len_b=6, batch_tokens=60)
    return Translator(model.eval(), CharTokenizer(), decode, accelerated=False)


def with_beam(translator: Translator, beam: int, **decode: object) -> Translator:
    translator.decode = replace(translator.decode, beam_size=beam, **decode)
    translator.nbest = 1
    return translator


LINE_CONSTRAINTS = [["z"], ["hz", "gx"], ["ab", "ac"], ["xyz"], ["a"]]


@pytest.mark.parametrize("beam", [1, 4])
def test_every_line_meets_its_constraints_and_the_others_are_unchanged(
    copier: Translator, beam: int
) -> None:
    translator = with_beam(copier, beam)
    lines = sentences(20, seed=beam, longest=10)
    # Every other line is constrained: phrases of one letter, of several, two phrases, two
    # that share their first letter; the batches mix them.
    constraints = [LINE_CONSTRAINTS[i // 2 % 5] if i % 2 else [] for i in range(len(lines))]
    out = translator.translate(lines, constraints=constraints)
    for text, phrases in zip(out, constraints, strict=True):
        assert all(p in text for p in phrases), (text, phrases)
    plain = translator.translate(lines)
    assert [o for o, c in zip(out, constraints, strict=True) if not c] == [
        p for p, c in zip(plain, constraints, strict=True) if not c
    ]
    assert any(p != o for p, o in zip(plain, out, strict=True))


@pytest.mark.parametrize("beam", [1, 4])
def test_a_prefix_is_kept_and_scored(copier: Translator, beam: int) -> None:
    translator = with_beam(copier, beam, alpha=0.0)
    lines = ["abc dea", "hgf", "bad cab fed"]
    prefixes = ["zz", "", "bad x"]
    results = translator.translate_nbest(lines, prefixes=prefixes, constraints=[[], [], ["e"]])
    assert results[1] == translator.translate_nbest(lines[1:2])[0]
    model = translator.model
    for line, prefix, hyps in zip(lines, prefixes, results, strict=True):
        (best,) = hyps
        assert best.text.startswith(prefix)
        # The score is the model's log-probability of every output token and EOS.
        batch = collate_pairs([CharTokenizer().encode(line)], [best.tokens])
        with torch.no_grad():
            logits = model(batch.src_ids, batch.src_pad, batch.tgt_in)
        logp = logits.log_softmax(-1).gather(2, batch.tgt_out[:, :, None]).sum()
        assert best.log_prob == pytest.approx(float(logp), abs=1e-4)
        assert best.score == pytest.approx(best.log_prob)  # alpha 0
    assert "e" in results[2][0].text


def test_constraints_that_cannot_fit_are_dropped_with_a_warning(copier: Translator) -> None:
    warnings: list[str] = []
    translator = with_beam(copier, 4, max_len_a=1.0, max_len_b=2)
    translator.warn = warnings.append
    lines = ["ab", "cd"]
    out = translator.translate(lines, first_line=7, constraints=[[], ["abcdefgh"]])
    assert out == translator.translate(lines)
    assert warnings == [
        "line 8: its constraints need 8 output tokens after the prefix, more than its limit "
        "of 4; translated without them"
    ]


def test_bad_constraints_and_prefixes(copier: Translator) -> None:
    with pytest.raises(ValueError, match=r"constraints needs one entry per line \(2\), got 1"):
        copier.translate(["ab", "cd"], constraints=[["a"]])
    with pytest.raises(ValueError, match="prefixes needs one entry per line"):
        copier.translate(["ab"], prefixes="a")
    with pytest.raises(TypeError, match="line 1: constraints are a list of phrases"):
        copier.translate(["ab"], constraints=["abc"])
    with pytest.raises(ValueError, match=r"line 2: constraint 2 \(' '\) is empty"):
        copier.translate(["ab", "cd"], constraints=[[], ["a", " "]])
    with pytest.raises(ValueError, match="steering needs one entry per source"):
        copier.search_ids([[4, 5]], [])


def test_a_hypothesis_that_has_met_everything_may_end_though_others_score_higher() -> None:
    """The constraint is improbable and ends the sentence at once; the model prefers to go on
    with one token: the hypothesis that meets it finishes from its bank, whatever the best 2K
    candidates by score are."""
    x, a = 7, 4

    def logp(sentence: int, prefix: tuple[int, ...]) -> list[float]:
        if x in prefix:
            probs = {EOS: 0.99, a: 0.01}
        else:  # many better tokens than x (and its EOS), which never ends
            probs = {a: 0.5, 5: 0.08, 6: 0.08, 8: 0.08, 9: 0.08, 10: 0.08, 11: 0.0999, x: 1e-4}
        return [math.log(probs[v]) if v in probs else NEG for v in range(V)]

    for k in (1, 4):
        cache = PrefixCache([0] * k)
        (hyps,) = steered_search(
            step_fn(logp),
            cache,  # type: ignore[arg-type]
            [Steering(((x,),))],
            beam_size=k,
            alpha=0.0,
            max_len=20,
            rule="fairseq" if k == 1 else "paper",
        )
        assert hyps[0].tokens == [x]
        assert hyps[0].log_prob == pytest.approx(math.log(1e-4) + math.log(0.99), abs=1e-5)


def test_a_phrase_encodes_as_it_does_inside_a_sentence(tmp_path: Path) -> None:
    """sentencepiece marks a word's start with its space piece and encodes a phrase alone
    with it: the phrase's tokens are those it has after a space inside a sentence."""
    from aiayn.data.tokenizer import train_tokenizer

    rng = random.Random(1)
    words = ["hund", "katze", "baumwolle", "fahrrad", "mann", "frau", "kind", "ball"]
    text = tmp_path / "text.txt"
    text.write_text(
        "\n".join(" ".join(rng.choice(words) for _ in range(8)) for _ in range(400)),
        encoding="utf-8",
    )
    tokenizer = train_tokenizer([text], 60, tmp_path / "spm", "bpe")
    translator = Translator(tiny_model(), tokenizer, DecodeConfig(), accelerated=False)
    for phrase in ["hund", "baumwolle", "frau kind", "ball mann hund"]:
        ids = translator.encode_target(phrase)
        assert tokenizer.piece(ids[0]).startswith("▁")
        inside = translator.encode_target(f"katze {phrase} fahrrad")
        assert any(inside[i : i + len(ids)] == ids for i in range(len(inside))), phrase
        steer = translator.encode_steering([5, 6], [phrase], "")
        assert steer.constraints == (tuple(ids),)
