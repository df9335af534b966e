"""Search driven by fixed log-probability tables, against hand-computed beams and scores and a
plain per-sentence reference implementation of the documented rules."""

from __future__ import annotations

import math
import random
import typing
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from aiayn import native
from aiayn.inference import search
from aiayn.inference.search import (
    BEAM_RULES,
    Hypothesis,
    beam_search,
    filter_logits,
    gnmt_length_penalty,
    greedy_search,
    max_output_lengths,
    sample,
)

BOS, EOS, A, B = 2, 3, 4, 5
V = 6
NEG = float("-inf")

# A distribution over next tokens for one (sentence, prefix); prefix excludes BOS.
LogProbFn = Callable[[int, tuple[int, ...]], list[float]]


class PrefixCache:
    """Stands in for the decoder cache: each row remembers its sentence and output prefix."""

    def __init__(self, sentence_of_row: list[int]) -> None:
        self.rows: list[tuple[int, tuple[int, ...] | None]] = [(s, None) for s in sentence_of_row]
        self.batch_sizes: list[int] = []

    def reorder(self, rows: Tensor) -> None:
        assert rows.numel() == len(self.rows)
        self.rows = [self.rows[i] for i in rows.tolist()]

    def keep(self, rows: Tensor) -> None:
        assert rows.numel() <= len(self.rows)
        self.rows = [self.rows[i] for i in rows.tolist()]


def step_fn(logp: LogProbFn) -> Callable[[Tensor, PrefixCache], Tensor]:
    def step(tokens: Tensor, cache: PrefixCache) -> Tensor:
        assert tokens.numel() == len(cache.rows)
        cache.batch_sizes.append(len(cache.rows))
        rows, out = [], []
        for (sentence, prefix), token in zip(cache.rows, tokens.tolist(), strict=True):
            if prefix is None:
                assert token == BOS
                prefix = ()
            else:
                prefix = (*prefix, token)
            rows.append((sentence, prefix))
            out.append(logp(sentence, prefix))
        cache.rows = rows
        return torch.tensor(out)

    return step


def table(entries: dict[tuple[int, ...], dict[int, float]], default: dict[int, float]) -> LogProbFn:
    """Log-probabilities from per-prefix probability tables (absent tokens: probability 0)."""

    def logp(sentence: int, prefix: tuple[int, ...]) -> list[float]:
        probs = entries.get(prefix, default)
        return [math.log(probs[v]) if probs.get(v, 0.0) > 0 else NEG for v in range(V)]

    return logp


def run_beam(logp: LogProbFn, n: int, k: int, **kwargs: object) -> tuple[list, PrefixCache]:
    cache = PrefixCache([i for i in range(n) for _ in range(k)])
    return beam_search(step_fn(logp), cache, n, beam_size=k, **kwargs), cache  # type: ignore[arg-type]


def run_greedy(logp: LogProbFn, n: int, **kwargs: object) -> list[Hypothesis]:
    return greedy_search(step_fn(logp), PrefixCache(list(range(n))), n, **kwargs)  # type: ignore[arg-type]


def lp(n: int, alpha: float) -> float:
    return ((5 + n) / 6) ** alpha


# Step 0 prefers stopping at once; going on with A and then EOS is a little less probable but
# one token longer, so a length penalty can make it the winner.
SHORT_OR_LONG = table(
    {
        (): {EOS: 0.40, A: 0.38, B: 0.22},
        (A,): {EOS: 0.98, A: 0.01, B: 0.01},
        (B,): {EOS: 0.50, A: 0.25, B: 0.25},
    },
    default={EOS: 1.0},
)


def test_length_penalty_formula() -> None:
    assert gnmt_length_penalty(1, 0.6) == 1.0
    assert gnmt_length_penalty(7, 0.6) == pytest.approx(2.0**0.6)
    assert gnmt_length_penalty(10, 0.0) == 1.0


def test_without_length_penalty_the_short_hypothesis_wins() -> None:
    [[best]], cache = run_beam(SHORT_OR_LONG, 1, 2, alpha=0.0, max_len=10)
    assert best.tokens == []
    assert best.log_prob == pytest.approx(math.log(0.40))
    assert best.score == pytest.approx(math.log(0.40))
    # Early termination: after step 0 the best live hypothesis (A, log 0.38) cannot beat the
    # finished one (log 0.40) without a length penalty, so only one step runs.
    assert cache.batch_sizes == [2]


@pytest.mark.parametrize("rule", BEAM_RULES)
def test_length_penalty_changes_the_winner(rule: str) -> None:
    [[best]], cache = run_beam(SHORT_OR_LONG, 1, 2, alpha=0.6, max_len=10, rule=rule)
    logp_long = math.log(0.38) + math.log(0.98)
    assert best.tokens == [A]
    assert best.log_prob == pytest.approx(logp_long, rel=1e-6)
    assert best.score == pytest.approx(logp_long / lp(2, 0.6), rel=1e-6)
    # The short one scores log(0.40) / lp(1) = log(0.40), worse than logp_long / lp(2).
    assert math.log(0.40) / lp(1, 0.6) < best.score
    # Step 1 finishes [A] and [B]. By fairseq's rule three finished hypotheses spend a beam of
    # two; by the paper's, the live [B, A] and [B, B] (log 0.22 + log 0.25 each) cannot beat [A]
    # even at the longest length, 11 positions. Either way the search stops there.
    assert cache.batch_sizes == [2, 2]
    assert (math.log(0.22) + math.log(0.25)) / lp(11, 0.6) < best.score


@pytest.mark.parametrize("rule", BEAM_RULES)
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_nbest_lists_are_ordered_by_score(alpha: float, rule: str) -> None:
    [hyps], _ = run_beam(SHORT_OR_LONG, 1, 2, alpha=alpha, max_len=10, nbest=2, rule=rule)
    expected = {
        (): math.log(0.40) / lp(1, alpha),
        (A,): (math.log(0.38) + math.log(0.98)) / lp(2, alpha),
        (B,): (math.log(0.22) + math.log(0.50)) / lp(2, alpha),
    }
    best_two = sorted(expected, key=lambda y: -expected[y])[:2]
    assert [tuple(h.tokens) for h in hyps] == best_two
    assert [h.score for h in hyps] == pytest.approx([expected[y] for y in best_two], rel=1e-6)
    assert hyps[0].score > hyps[1].score


# Greedy takes A, then A (0.36 beats 0.34 and EOS 0.30); the beam also keeps B, whose EOS is
# far more probable, and finds a better sentence.
GREEDY_TRAP = table(
    {
        (): {A: 0.50, B: 0.40, EOS: 0.10},
        (A,): {A: 0.36, B: 0.34, EOS: 0.30},
        (B,): {EOS: 0.90, A: 0.05, B: 0.05},
    },
    default={EOS: 1.0},
)


def test_beam_finds_what_greedy_misses() -> None:
    [greedy] = run_greedy(GREEDY_TRAP, 1, max_len=10)
    assert greedy.tokens == [A, A]
    assert greedy.log_prob == pytest.approx(math.log(0.50) + math.log(0.36))
    [[beam]], _ = run_beam(GREEDY_TRAP, 1, 2, alpha=0.0, max_len=10)
    assert beam.tokens == [B]
    assert beam.log_prob == pytest.approx(math.log(0.40) + math.log(0.90))
    [[paper]], _ = run_beam(GREEDY_TRAP, 1, 2, alpha=0.0, max_len=10, rule="paper")
    assert paper == beam
    [[one]], _ = run_beam(GREEDY_TRAP, 1, 1, alpha=0.0, max_len=10, rule="fairseq")
    assert one.tokens == greedy.tokens


# EOS is improbable everywhere: every hypothesis runs to its maximum length.
ENDLESS = table({}, default={A: 0.7, B: 0.2999, EOS: 0.0001})


@pytest.mark.parametrize("rule", BEAM_RULES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_max_len_is_honoured_per_sentence(k: int, rule: str) -> None:
    limits = torch.tensor([0, 1, 3, 5])
    results, cache = run_beam(ENDLESS, 4, k, alpha=0.6, max_len=limits, rule=rule)
    for hyps, limit in zip(results, limits.tolist(), strict=True):
        best = hyps[0]
        assert best.tokens == [A] * limit
        # The forced EOS keeps the model's log-probability (no renormalisation).
        logp = limit * math.log(0.7) + math.log(0.0001)
        assert best.log_prob == pytest.approx(logp, rel=1e-5)
        assert best.score == pytest.approx(logp / lp(limit + 1, 0.6), rel=1e-5)
    # Finished sentences leave the batch: limits 0, 1, 3, 5 end at steps 0, 1, 3, 5.
    assert cache.batch_sizes == [4 * k, 3 * k, 2 * k, 2 * k, k, k]
    greedy = run_greedy(ENDLESS, 4, max_len=limits)
    assert [len(h.tokens) for h in greedy] == [0, 1, 3, 5]


def test_max_output_lengths() -> None:
    src = torch.tensor([0, 3, 10])
    assert max_output_lengths(src, 1.0, 50).tolist() == [50, 53, 60]
    assert max_output_lengths(src, 1.5, 2, limit=12).tolist() == [2, 6, 12]


# -- against a plain reference implementation, on pseudo-random tables ----------------------


def random_table(seed: int) -> LogProbFn:
    """Prefix-dependent random distributions; EOS grows more likely with length."""

    def logp(sentence: int, prefix: tuple[int, ...]) -> list[float]:
        rng = random.Random(hash((seed, sentence, prefix)))
        logits = [rng.gauss(0.0, 1.5) for _ in range(V)]
        logits[EOS] += 0.4 * len(prefix) - 1.0
        logits[BOS] = logits[0] = NEG
        top = max(logits)
        norm = top + math.log(sum(math.exp(x - top) for x in logits))
        return [x - norm for x in logits]

    return logp


def reference_beam(
    logp: LogProbFn, sentence: int, k: int, alpha: float, max_len: int, nbest: int, rule: str
) -> list[tuple[tuple[int, ...], float]]:
    """The rules of the search module, one sentence at a time, written plainly."""
    live: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    finished: list[tuple[tuple[int, ...], float]] = []
    n_finished = 0
    t = 0
    while True:
        candidates = []
        for prefix, score in live:
            row = logp(sentence, prefix)
            if t >= max_len:
                row = [x if v == EOS else NEG for v, x in enumerate(row)]
            candidates += [(score + x, prefix, v) for v, x in enumerate(row)]
        candidates.sort(key=lambda c: -c[0])
        top = candidates[: 2 * k]
        # The paper's rule finishes EOS among the best 2K candidates, fairseq's among the best K.
        for score, prefix, v in top[: 2 * k if rule == "paper" else k]:
            if v == EOS and score > NEG:
                finished.append((prefix, score / lp(t + 1, alpha)))
                n_finished += 1
        live = [((*prefix, v), score) for score, prefix, v in top if v != EOS][:k]
        finished = sorted(finished, key=lambda h: -h[1])[:nbest]
        worst = finished[-1][1] if len(finished) == nbest else NEG
        bound = live[0][1] / max(lp(max_len + 1, alpha), lp(t + 2, alpha))
        spent = rule == "fairseq" and n_finished >= k  # only fairseq's rule stops on a count
        if spent or t >= max_len or worst >= bound:
            return finished
        t += 1


@pytest.mark.parametrize("rule", BEAM_RULES)
@pytest.mark.parametrize(("k", "alpha", "nbest"), [(1, 0.0, 1), (3, 0.6, 2), (4, 1.0, 4)])
def test_batched_beam_matches_reference(k: int, alpha: float, nbest: int, rule: str) -> None:
    logp = random_table(seed=k)
    limits = [4, 9, 1, 12, 7, 0, 12, 5]
    n = len(limits)
    results, cache = run_beam(
        logp, n, k, alpha=alpha, max_len=torch.tensor(limits), nbest=nbest, rule=rule
    )
    assert cache.batch_sizes[0] == n * k and cache.batch_sizes[-1] < n * k
    for i, hyps in enumerate(results):
        expected = reference_beam(logp, i, k, alpha, limits[i], nbest, rule)
        assert [tuple(h.tokens) for h in hyps] == [y for y, _ in expected]
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)  # best first
        assert [h.score for h in hyps] == pytest.approx([s for _, s in expected], abs=1e-4)
        for h in hyps:
            assert len(h.tokens) <= limits[i]
            logp_sum = sum(
                logp(i, tuple(h.tokens[:j]))[([*h.tokens, EOS])[j]]
                for j in range(len(h.tokens) + 1)
            )
            assert h.log_prob == pytest.approx(logp_sum, abs=1e-4)
            assert h.score == pytest.approx(h.log_prob / lp(len(h.tokens) + 1, alpha), abs=1e-4)


@pytest.mark.parametrize("rule", BEAM_RULES)
def test_one_transfer_per_step_gives_the_same_search(
    rule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The search as on a GPU (the merge every step, one transfer) against the CPU's (the
    # merge only where a candidate finished).
    table = random_table(seed=5)

    def logp(sentence: int, prefix: tuple[int, ...]) -> list[float]:
        row = table(sentence, prefix)
        return [NEG if v == EOS and len(prefix) < 3 else x for v, x in enumerate(row)]

    # No EOS in the first three steps: nothing finishes there, which the CPU skips.
    limits = torch.tensor([4, 9, 3, 12, 7, 3, 12, 5])
    args = dict(alpha=0.6, max_len=limits, nbest=2, rule=rule)
    calls = []
    merge = search._merge
    monkeypatch.setattr(search, "_merge", lambda *a, **kw: calls.append(1) or merge(*a, **kw))
    host, _ = run_beam(logp, 8, 3, **args)
    host_calls = len(calls)
    monkeypatch.setattr(search, "SYNC_FREE_DEVICES", frozenset())
    transfer, _ = run_beam(logp, 8, 3, **args)
    assert transfer == host
    assert len(calls) - host_calls > host_calls  # the merge ran on more steps


@pytest.mark.parametrize("rule", BEAM_RULES)
def test_results_do_not_depend_on_batch_composition(rule: str) -> None:
    logp = random_table(seed=7)
    limits = torch.tensor([6, 2, 11, 8, 3])
    together, _ = run_beam(logp, 5, 3, alpha=0.6, max_len=limits, nbest=3, rule=rule)
    # Sentence i alone: a one-sentence table that answers for sentence i.
    for i in range(5):

        def alone(_: int, prefix: tuple[int, ...], i: int = i) -> list[float]:
            return logp(i, prefix)

        [single], _ = run_beam(alone, 1, 3, alpha=0.6, max_len=int(limits[i]), nbest=3, rule=rule)
        assert single == together[i]


def test_beam_size_one_equals_greedy_by_fairseqs_rule() -> None:
    logp = random_table(seed=11)
    limits = torch.tensor([3, 10, 10, 0, 7, 10])
    [*beams], _ = run_beam(logp, 6, 1, alpha=0.6, max_len=limits, rule="fairseq")
    greedy = run_greedy(logp, 6, max_len=limits, alpha=0.6)
    for [beam], g in zip(beams, greedy, strict=True):
        assert beam.tokens == g.tokens
        assert beam.log_prob == pytest.approx(g.log_prob, abs=1e-5)
        assert beam.score == pytest.approx(g.score, abs=1e-5)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nbest"):
        run_beam(SHORT_OR_LONG, 1, 2, max_len=5, nbest=3)
    with pytest.raises(ValueError, match="beam_size"):
        run_beam(SHORT_OR_LONG, 1, 0, max_len=5)
    assert run_beam(SHORT_OR_LONG, 0, 2, max_len=5)[0] == []
    with pytest.raises(ValueError, match="'paper', 'fairseq'"):
        run_beam(SHORT_OR_LONG, 1, 2, max_len=5, rule="t2t")
    assert typing.get_args(search.BeamRule) == BEAM_RULES


# -- the paper's rule against exhaustive search -------------------------------------------------


def small_table(seed: int, outputs: tuple[int, ...]) -> LogProbFn:
    """Random distributions over the few tokens ``outputs`` (EOS among them), each a function of
    the seed, the sentence and the whole prefix; every other token has probability 0."""

    def logp(sentence: int, prefix: tuple[int, ...]) -> list[float]:
        rng = random.Random(hash((seed, sentence, prefix)))
        logits = [rng.gauss(0.0, 1.5) if v in outputs else NEG for v in range(V)]
        top = max(logits)
        norm = top + math.log(sum(math.exp(x - top) for x in logits))
        return [x - norm for x in logits]

    return logp


def exhaustive(
    logp: LogProbFn, sentence: int, alpha: float, max_len: int
) -> list[tuple[tuple[int, ...], float]]:
    """Every output sequence of probability above 0 and its score (``Hypothesis.score``:
    ``log P(Y) / lp(|Y|)``, EOS counted), best first: the sequences that end in EOS within
    ``max_len`` output tokens, the EOS after ``max_len`` forced as beam search forces it."""
    found: list[tuple[tuple[int, ...], float]] = []

    def extend(prefix: tuple[int, ...], logp_sum: float) -> None:
        for v, x in enumerate(logp(sentence, prefix)):
            if x == NEG or (v != EOS and len(prefix) >= max_len):
                continue
            if v == EOS:
                found.append((prefix, (logp_sum + x) / lp(len(prefix) + 1, alpha)))
            else:
                extend((*prefix, v), logp_sum + x)

    extend((), 0.0)
    return sorted(found, key=lambda y: -y[1])


# (output tokens, longest max_len, K): K is the number of live prefixes of the longest length,
# (len(outputs) - 1) ** max_len, so the beam holds every prefix and the best 2K candidates every
# candidate; only the stopping rule can then miss a sequence.
EXHAUSTIVE_BEAMS = [((EOS, A, B), 2, 4), ((EOS, A, B), 4, 16), ((1, EOS, A, B), 3, 27)]


@pytest.mark.parametrize("nbest", [1, 3, "K"])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0, 2.0])
@pytest.mark.parametrize(("outputs", "max_len", "k"), EXHAUSTIVE_BEAMS)
def test_paper_rule_with_an_exhaustive_beam_is_exhaustive_search(
    outputs: tuple[int, ...], max_len: int, k: int, alpha: float, nbest: int | str
) -> None:
    # 24 random tables (one per sentence), limits max_len, max_len - 1, max_len - 2 (down to 0).
    # The n-best list is the exhaustive top n, up to n = K.
    nbest = k if nbest == "K" else nbest
    n = 24
    limits = [max(0, max_len - i % 3) for i in range(n)]
    logp = small_table(seed=max_len + k, outputs=outputs)
    results, _ = run_beam(
        logp, n, k, alpha=alpha, max_len=torch.tensor(limits), nbest=nbest, rule="paper"
    )
    for i, hyps in enumerate(results):
        best = exhaustive(logp, i, alpha, limits[i])[:nbest]
        assert [tuple(h.tokens) for h in hyps] == [y for y, _ in best]
        assert [h.score for h in hyps] == pytest.approx([s for _, s in best], abs=1e-5)


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0, 2.0])
@pytest.mark.parametrize("k", [1, 2])
def test_paper_rule_scores_between_fairseqs_and_the_optimum(
    k: int, alpha: float, full: bool
) -> None:
    # Outputs UNK, EOS, A and B, 40 random tables, limits 4 and 3: the search is far from
    # exhaustive with K = 1 or 2. The paper's live beams are fairseq's, its finished pool holds
    # all of fairseq's, and it stops only when nothing better can come: never worse, entry by
    # entry of the n-best list (n = 1, or n = K when ``full``).
    n, nbest = 40, k if full else 1
    limits = [4 - i % 2 for i in range(n)]
    logp = small_table(seed=100 + k, outputs=(1, EOS, A, B))
    kwargs = {"alpha": alpha, "max_len": torch.tensor(limits), "nbest": nbest}
    paper, _ = run_beam(logp, n, k, rule="paper", **kwargs)
    fairseq, _ = run_beam(logp, n, k, rule="fairseq", **kwargs)
    better = 0
    for i in range(n):
        optimum = exhaustive(logp, i, alpha, limits[i])
        assert len(paper[i]) == len(fairseq[i]) == nbest
        for p, f, (_, best) in zip(paper[i], fairseq[i], optimum, strict=False):
            assert f.score <= p.score + 1e-6
            assert p.score <= best + 1e-6
        better += paper[i][0].score > fairseq[i][0].score + 1e-6
    assert better > 0  # the two rules differ on some of these tables


# Step 0 prefers stopping at once (0.45) to A (0.40); A goes on with A (0.95), then stops (0.97).
# B stops at once. Fairseq's rule with K = 2: step 0 finishes [] (EOS is among the best two);
# step 1's best two candidates are [A, A] (0.40 · 0.95 = 0.38) and [B] + EOS (0.15): [B] is the
# second hypothesis to finish, the beam is spent, and [] wins. With K = 1 fairseq's rule stops at
# step 0, as greedy search does. The paper's rule goes on (the live [A] and then [A, A] could
# still beat [] at the longest length) and finds [A, A], better once normalised (α = 1).
SHORT_THEN_LONG = table(
    {
        (): {EOS: 0.45, A: 0.40, B: 0.15},
        (A,): {A: 0.95, EOS: 0.05},
        (B,): {EOS: 1.0},
        (A, A): {EOS: 0.97, A: 0.03},
    },
    default={EOS: 1.0},
)


@pytest.mark.parametrize("k", [1, 2])
def test_paper_rule_finds_the_long_hypothesis_fairseqs_misses(k: int) -> None:
    alpha = 1.0
    short = math.log(0.45) / lp(1, alpha)
    long_logp = math.log(0.40) + math.log(0.95) + math.log(0.97)
    long = long_logp / lp(3, alpha)
    assert short < long
    # The bounds of steps 0 and 1 (best live [A], then [A, A]; 11 positions at most) do not
    # stop the search: [] is the best finished hypothesis at both.
    assert short < math.log(0.40) / lp(11, alpha)
    assert short < math.log(0.38) / lp(11, alpha)

    [[f]], fairseq_cache = run_beam(SHORT_THEN_LONG, 1, k, alpha=alpha, max_len=10, rule="fairseq")
    assert f.tokens == []
    assert f.score == pytest.approx(short, rel=1e-6)
    assert fairseq_cache.batch_sizes == [k] * k  # K hypotheses finished after K steps

    [[p]], paper_cache = run_beam(SHORT_THEN_LONG, 1, k, alpha=alpha, max_len=10, rule="paper")
    assert p.tokens == [A, A]
    assert p.log_prob == pytest.approx(long_logp, rel=1e-6)
    assert p.score == pytest.approx(long, rel=1e-6)
    # Step 2 finishes [A, A]; the live [A, A, A] (0.38 · 0.03) cannot beat it even at the
    # longest length: the search stops there, not at the length limit.
    assert math.log(0.38 * 0.03) / lp(11, alpha) < long
    assert paper_cache.batch_sizes == [k] * 3


# A short hypothesis [] is likely at the first step; a long one [A, A, A, A] scores better with
# a large alpha, although each of its steps has a lower log-probability than [] had.
LONG_AT_LARGE_ALPHA = table(
    {
        (): {EOS: 0.6, A: 0.4},
        (A,): {A: 0.999, EOS: 0.001},
        (A, A): {A: 0.999, EOS: 0.001},
        (A, A, A): {A: 0.999, EOS: 0.001},
    },
    default={EOS: 0.999, A: 0.001},
)


def test_the_bound_divides_by_the_largest_length_penalty_still_reachable() -> None:
    # By the paper's rule (fairseq's stops here at its second finished hypothesis). The live
    # [A] (log 0.4) divided by the penalty of its own next length (2 positions) is below the
    # finished []'s score, but divided by the largest reachable one (11 positions) it is
    # above it: the search must go on, to [A, A, A, A].
    alpha = 2.0
    short = math.log(0.6) / lp(1, alpha)
    assert math.log(0.4) / lp(2, alpha) < short < math.log(0.4) / lp(11, alpha)
    long_logp = math.log(0.4) + 3 * math.log(0.999) + math.log(0.999)
    assert long_logp / lp(5, alpha) > short
    [[best]], _ = run_beam(LONG_AT_LARGE_ALPHA, 1, 2, alpha=alpha, max_len=10, rule="paper")
    assert best.tokens == [A, A, A, A]
    assert best.score == pytest.approx(long_logp / lp(5, alpha), rel=1e-6)


# -- sampling ----------------------------------------------------------------------------------


def test_filter_logits() -> None:
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True]]
    # Nucleus 0.6: 0.5 alone falls short, 0.5 + 0.3 reaches it; the 0.2 token goes.
    assert torch.isinf(filter_logits(logits, top_p=0.6)).tolist() == [[False, False, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.5)).tolist() == [[False, True, True]]
    assert torch.equal(filter_logits(logits), logits)


def test_sampling_follows_the_distribution() -> None:
    coin = table({(): {A: 0.7, B: 0.3}}, default={EOS: 1.0})
    n = 2000
    gen = torch.Generator().manual_seed(0)
    hyps = sample(step_fn(coin), PrefixCache(list(range(n))), n, max_len=5, generator=gen)
    share_a = sum(h.tokens == [A] for h in hyps) / n
    # Binomial standard deviation sqrt(0.7 * 0.3 / 2000) ≈ 0.010: allow five of them.
    assert abs(share_a - 0.7) < 0.05
    assert all(h.tokens in ([A], [B]) for h in hyps)
    for h in hyps:
        assert h.log_prob == pytest.approx(math.log(0.7 if h.tokens == [A] else 0.3))


def test_sampling_with_top_k_one_is_greedy() -> None:
    logp = random_table(seed=3)
    limits = torch.tensor([8, 8, 3, 8])
    greedy = run_greedy(logp, 4, max_len=limits)
    sampled = sample(
        step_fn(logp), PrefixCache(list(range(4))), 4, max_len=limits, top_k=1, temperature=2.0
    )
    assert [h.tokens for h in sampled] == [h.tokens for h in greedy]
    with pytest.raises(ValueError, match="temperature"):
        sample(step_fn(logp), PrefixCache([0]), 1, max_len=3, temperature=0.0)


# -- the two-stage top-k of beam search ------------------------------------------------------


@pytest.mark.parametrize(("k", "vocab"), [(4, 8000), (3, 1000), (4, 1037), (2, 70), (5, 100)])
def test_top_candidates_equal_topk_over_the_sum(k: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab + k)
    b, m = 6, 2 * k
    log_probs = torch.randn(b, k, vocab, generator=gen).log_softmax(-1)
    log_probs[1, :, :] = torch.round(log_probs[1] * 2) / 2  # many equal scores
    log_probs[2, :, 1:] = NEG  # a sentence at its limit: only EOS (token 0 here) left
    log_probs[3, :, vocab - 3 :] += 20.0  # the best tokens sit after the last whole block
    live = torch.randn(b, k, generator=gen).sort(dim=1, descending=True).values
    live[0, 1:] = NEG  # the first step: one live beam
    score, index = search.top_candidates(log_probs, live, m)
    candidates = (live[:, :, None] + log_probs).view(b, k * vocab)
    expected = candidates.topk(m, dim=1).values
    assert torch.equal(score, expected)
    assert torch.equal(candidates.gather(1, index), score)  # the indices point at the scores
    finite = score > NEG
    for row, used in zip(index.tolist(), finite.tolist(), strict=True):
        kept = [i for i, f in zip(row, used, strict=True) if f]
        assert len(set(kept)) == len(kept)  # no candidate twice


@pytest.mark.parametrize("rule", BEAM_RULES)
@pytest.mark.parametrize(("k", "nbest"), [(3, 2), (4, 4)])
def test_beam_with_one_token_blocks_matches_reference(
    k: int, nbest: int, rule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With V = 6 the two-stage path needs blocks of one token (at least 2K blocks).
    monkeypatch.setattr(search, "TOPK_BLOCK", 1)
    calls = []
    amax = Tensor.amax
    monkeypatch.setattr(
        Tensor, "amax", lambda self, *a, **kw: calls.append(1) or amax(self, *a, **kw)
    )
    test_batched_beam_matches_reference(k, 0.6, nbest, rule)
    assert calls  # the block maxima were taken


# -- greedy's choice by blocks ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "vocab"), [(8, 8005), (64, 8000), (9, 1037), (8, 2 * search.ARGMAX_BLOCK), (33, 200)]
)
def test_first_argmax_is_the_first_maximum_as_max_gives_it(rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    scores = torch.randint(-3, 3, (rows, vocab), generator=gen).float()  # ties in every row
    scores[0] = NEG  # a row with nothing allowed but the first token's -inf
    scores[1, -1] = 100.0  # the maximum at the last token (after the last whole block if any)
    scores[2, :] = 7.0  # the maximum everywhere: the first index
    scores[3, 5] = scores[3, vocab - 1] = float("nan")  # NaN counts as the maximum
    scores[4, vocab - 1] = float("nan")
    scores[5, 70] = scores[5, vocab - 2] = 50.0  # equal maxima in a block and in the tail
    used = []
    amax = Tensor.amax
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Tensor, "amax", lambda self, *a, **kw: used.append(1) or amax(self, *a, **kw))
        got = search.first_argmax(scores)
    assert used  # by blocks
    assert torch.equal(got, scores.max(dim=-1).indices)
    assert torch.equal(search.first_argmax(scores.t().contiguous().t()), got)  # strided rows


def test_first_argmax_over_few_rows_is_max() -> None:
    scores = torch.randn(search.ARGMAX_ROWS - 1, 8000)
    used = []
    amax = Tensor.amax
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Tensor, "amax", lambda self, *a, **kw: used.append(1) or amax(self, *a, **kw))
        assert torch.equal(search.first_argmax(scores), scores.max(dim=-1).indices)
    assert not used


def test_greedy_search_by_blocks_equals_greedy_by_max(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    batch, vocab, steps = 16, 300, 6
    table = torch.randn(steps + 1, batch, vocab, generator=gen).log_softmax(-1)
    table = torch.round(table * 2) / 2  # equal log-probabilities: ties for the first maximum
    table[:, :, EOS] += 2.0 * torch.rand(steps + 1, batch, generator=gen)  # some finish early

    class Rows:  # the sentence of each row; finished ones leave (keep)
        def __init__(self) -> None:
            self.sentences, self.t = torch.arange(batch), 0

        def reorder(self, rows: Tensor) -> None:
            self.sentences = self.sentences[rows]

        def keep(self, rows: Tensor) -> None:
            self.sentences = self.sentences[rows]

    def step(tokens: Tensor, cache: Rows) -> Tensor:
        cache.t += 1
        return table[cache.t - 1, cache.sentences]

    def run() -> list[tuple[list[int], float]]:
        hyps = greedy_search(step, Rows(), batch, max_len=steps)
        return [(h.tokens, h.score) for h in hyps]

    used = []
    amax = Tensor.amax
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Tensor, "amax", lambda self, *a, **kw: used.append(1) or amax(self, *a, **kw))
        by_blocks = run()
    assert used  # greedy chose by blocks
    assert len({len(tokens) for tokens, _ in by_blocks}) > 1  # rows left at different steps
    monkeypatch.setattr(search, "ARGMAX_ROWS", batch + 1)  # max(dim) at every step
    assert run() == by_blocks
    # A native kernel registered for the choice (aiayn.native) is what greedy search calls.
    calls: list[int] = []

    def kernel(scores: Tensor) -> Tensor:
        calls.append(scores.shape[0])
        return scores.max(dim=-1).indices

    native.register_first_argmax(kernel)
    try:
        assert search.native_first_argmax() is kernel
        assert run() == by_blocks
    finally:
        native.register_first_argmax(None)
    assert calls and calls[0] == batch
    assert search.native_first_argmax() is None


# -- beam search with its bookkeeping on the host ---------------------------------------------


def hashed_table(seed: int, vocab: int, tied: bool) -> LogProbFn:
    """Prefix-dependent scores over ``vocab`` tokens: halves (so that sums and finished
    scores tie often, and some tokens are impossible) or Gaussian ones; EOS grows more likely
    with length."""

    def logp(sentence: int, prefix: tuple[int, ...]) -> list[float]:
        rng = random.Random(hash((seed, vocab, tied, sentence, prefix)))
        if tied:
            row = [rng.choice((-0.5, -1.0, -1.5, -2.0, NEG)) for _ in range(vocab)]
            row[EOS] = rng.choice((-0.5, -1.0, -2.5)) + (0.5 if len(prefix) > 3 else -1.0)
            if rng.random() < 0.15:
                row[EOS] = NEG  # no EOS here, not even at the length limit
        else:
            row = [rng.gauss(-3.0, 1.5) for _ in range(vocab)]
            row[EOS] += 0.4 * len(prefix) - 1.0
        row[BOS] = row[0] = NEG
        return row

    return logp


@pytest.mark.parametrize("rule", BEAM_RULES)
@pytest.mark.parametrize(
    ("k", "alpha", "nbest"), [(1, 0.0, 1), (2, 0.6, 1), (3, 0.6, 2), (4, 1.0, 4), (5, 1.3, 3)]
)
@pytest.mark.parametrize(("vocab", "block"), [(6, 32), (9, 32), (80, 8)])
def test_host_beam_search_equals_the_tensor_search(
    k: int,
    alpha: float,
    nbest: int,
    rule: str,
    vocab: int,
    block: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(search, "TOPK_BLOCK", block)  # (80, 8): the two-stage top-k
    hosted = []
    on_host = search._host_beam_search
    monkeypatch.setattr(
        search, "_host_beam_search", lambda *a, **kw: hosted.append(1) or on_host(*a, **kw)
    )
    rng = random.Random(k * 100 + vocab)
    for seed in range(12):
        n = 1 + seed % 3
        limits = torch.tensor([rng.randint(0, 12) for _ in range(n)])
        logp = hashed_table(seed, vocab, tied=seed % 2 == 0)
        args = dict(alpha=alpha, max_len=limits, nbest=nbest, rule=rule)
        monkeypatch.setattr(search, "HOST_SEARCH_SENTENCES", n)
        host, host_cache = run_beam(logp, n, k, **args)
        monkeypatch.setattr(search, "HOST_SEARCH_SENTENCES", n - 1)
        tensors, tensor_cache = run_beam(logp, n, k, **args)
        assert len(hosted) == seed + 1  # the first search only
        assert host == tensors  # tokens, scores and log-probabilities, to the bit
        assert host_cache.batch_sizes == tensor_cache.batch_sizes  # sentences left alike
        assert host_cache.rows == tensor_cache.rows


def test_host_beam_search_runs_for_one_sentence_on_the_cpu() -> None:
    calls = []
    on_host = search._host_beam_search
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            search, "_host_beam_search", lambda *a, **kw: calls.append(1) or on_host(*a, **kw)
        )
        run_beam(random_table(seed=3), search.HOST_SEARCH_SENTENCES, 3, max_len=6)
        assert len(calls) == 1
        run_beam(random_table(seed=3), search.HOST_SEARCH_SENTENCES + 1, 3, max_len=6)
        assert len(calls) == 1


def test_the_host_bound_is_the_tensor_bound() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 4000
    live = -torch.rand(n, generator=gen) * torch.logspace(-3, 3, n)
    live[:3] = torch.tensor([NEG, 0.0, -0.0])
    limits = torch.randint(0, 300, (n,), generator=gen)
    for alpha in (0.0, 0.6, 1.0, 1.7):
        lp_limit = gnmt_length_penalty(limits + 1.0, alpha)
        for t in (0, 1, 7, 40, 299):
            expected = (live / lp_limit.clamp(min=gnmt_length_penalty(t + 2.0, alpha))).tolist()
            got = [
                search._host_bound(x, y, t, alpha)
                for x, y in zip(live.tolist(), lp_limit.tolist(), strict=True)
            ]
            assert got == expected
    assert search._f32(1e39) == math.inf and search._f32(1 / 3) != 1 / 3


@pytest.mark.parametrize("alpha", [0.0, 0.6])
@pytest.mark.parametrize("vocab", [6, 80])
def test_host_greedy_search_equals_the_tensor_search(
    alpha: float, vocab: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    hosted = []
    on_host = search._host_greedy_search
    monkeypatch.setattr(
        search, "_host_greedy_search", lambda *a, **kw: hosted.append(1) or on_host(*a, **kw)
    )
    rng = random.Random(vocab)
    lengths: list[int] = []
    for seed in range(8):
        n = 1 + seed % 3
        limits = torch.tensor([rng.randint(0, 12) for _ in range(n)])
        logp = hashed_table(seed, vocab, tied=seed % 2 == 0)
        caches = []
        results = []
        for host in (n, n - 1):
            monkeypatch.setattr(search, "HOST_SEARCH_SENTENCES", host)
            cache = PrefixCache(list(range(n)))
            results.append(
                greedy_search(step_fn(logp), cache, n, max_len=limits, alpha=alpha)  # type: ignore[arg-type]
            )
            caches.append(cache)
        assert len(hosted) == seed + 1  # the first search only
        assert results[0] == results[1]  # tokens, scores and log-probabilities, to the bit
        assert caches[0].batch_sizes == caches[1].batch_sizes
        lengths += [len(h.tokens) for h in results[0]]
    assert len(set(lengths)) > 2  # sentences ended at several steps


def test_tied_n_best_lists_do_not_depend_on_the_batch() -> None:
    # Equal scores in a sentence's n-best list keep their order when other sentences finish
    # hypotheses at other steps (the merge is a stable sort).
    for seed in range(10):
        logp = hashed_table(seed, 9, tied=True)
        limits = torch.tensor([7, 3, 10, 5])
        together, _ = run_beam(logp, 4, 4, alpha=0.0, max_len=limits, nbest=4, rule="paper")
        for i in range(4):

            def alone(
                _: int, prefix: tuple[int, ...], i: int = i, logp: LogProbFn = logp
            ) -> list[float]:
                return logp(i, prefix)

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(search, "HOST_SEARCH_SENTENCES", 0)  # the tensor search alone too
                [single], _ = run_beam(alone, 1, 4, alpha=0.0, max_len=int(limits[i]), nbest=4)
            assert single == together[i]


def test_search_does_not_depend_on_the_default_dtype() -> None:
    logp = hashed_table(3, 9, tied=False)
    limits = torch.tensor([6, 9, 4])

    def searches() -> list[object]:
        out: list[object] = []
        for host in (0, 3):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(search, "HOST_SEARCH_SENTENCES", host)
                out.append(run_beam(logp, 3, 3, alpha=0.6, max_len=limits, nbest=2)[0])
                out.append(run_greedy(logp, 3, max_len=limits, alpha=0.6))
        return out

    in_float32 = searches()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert searches() == in_float32
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("host", [0, 1])
def test_greedy_stops_at_the_limit_where_eos_is_impossible(
    host: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(search, "HOST_SEARCH_SENTENCES", host)

    def no_eos(sentence: int, prefix: tuple[int, ...]) -> list[float]:
        return [NEG, -1.0, NEG, NEG, -2.0, -0.5]  # token 5 always, EOS never

    [hyp] = run_greedy(no_eos, 1, max_len=3, alpha=0.6)
    assert hyp.tokens == [5, 5, 5]
    assert hyp.log_prob == NEG and hyp.score == NEG  # the forced EOS had no probability

    def nan(sentence: int, prefix: tuple[int, ...]) -> list[float]:
        return [NEG, -1.0, NEG, float("nan") if prefix else -2.0, -2.0, -0.5]

    [hyp] = run_greedy(nan, 1, max_len=5)
    assert hyp.tokens == [5] and math.isnan(hyp.log_prob)  # NaN counts as the maximum


@pytest.mark.parametrize("sentences", [1, 3])  # on the host, and as tensors
@pytest.mark.parametrize("how", ["beam", "greedy", "sample"])
def test_search_holds_no_step_output_into_the_next_step(sentences: int, how: str) -> None:
    """Each step's log-probabilities are let go of before the next step is asked for, so that
    the step may free its own and reuse that memory; forcing EOS at the length limit writes
    into them instead of copying them (sampling's filters copy them anyway)."""
    import weakref

    given: list[weakref.ref[Tensor]] = []
    step = step_fn(random_table(seed=5))

    def watched(tokens: Tensor, cache: PrefixCache) -> Tensor:
        assert all(ref() is None for ref in given)
        out = step(tokens, cache)
        given.append(weakref.ref(out))
        return out

    limits = torch.tensor([2, 5, 3][:sentences])
    rows = [i for i in range(sentences) for _ in range(2 if how == "beam" else 1)]
    run: dict[str, Callable[[PrefixCache], object]] = {
        "beam": lambda c: beam_search(watched, c, sentences, beam_size=2, max_len=limits),
        "greedy": lambda c: greedy_search(watched, c, sentences, max_len=limits),
        "sample": lambda c: sample(watched, c, sentences, max_len=limits, generator=None),
    }
    copies: list[int] = []  # vocabulary-wide copies by masked_fill
    masked_fill = Tensor.masked_fill

    def fill(self: Tensor, *args: typing.Any, **kwargs: typing.Any) -> Tensor:
        copies.extend([1] if self.dim() > 1 and self.size(-1) == V else [])
        return masked_fill(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Tensor, "masked_fill", fill)
        run[how](PrefixCache(rows))
    assert len(given) >= 3
    assert copies == [] or how == "sample"
