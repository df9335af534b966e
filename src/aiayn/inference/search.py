"""Model-agnostic decoding: beam search, greedy search and sampling.

Search knows nothing of the model. It drives a ``step_fn(tokens, cache) -> log_probs``: given
the last token of every row, (rows,), it returns next-token log-probabilities, (rows, V) (which
search may write into, and lets go of before it asks for the next step), and advances
``cache``, an object with two methods: ``reorder(rows)`` (row i becomes old row
``rows[i]``, same number of rows) and ``keep(rows)`` (only the listed rows stay, in that order).
:meth:`aiayn.model.transformer.Transformer.log_probs_step` with a
:class:`aiayn.model.cache.DecoderCache` is one such pair.

Every search is vectorised over sentences (and beams); a sentence that is done leaves the batch
through ``cache.keep`` so the work shrinks as sentences finish. Each sentence is decoded on its
own: its result does not depend on which other sentences share the batch. Beam and greedy
search over a single sentence on the CPU keep their bookkeeping in Python lists instead
(:data:`HOST_SEARCH_SENTENCES`), with the same results.

Beam search (§6.1 of the paper, after GNMT and tensor2tensor), for each sentence with beam
size K:

- Hypotheses are ranked by their summed log-probability. At each step every live hypothesis is
  extended by every token; the next live beam is the best K of these candidates that do not end
  in EOS (the best 2K hold at least K such, since at most K end in EOS).
- A candidate that ends in EOS is *finished*: scored ``log P(Y) / lp(|Y|)`` with the GNMT
  length penalty ``lp(n) = ((5 + n) / 6) ** alpha`` (``|Y|`` counts the output tokens and the
  final EOS), it goes into the sentence's n-best list, which keeps the ``nbest`` best scores.
- Which candidates finish, and when the sentence is done, is the ``rule``:

  - ``"paper"`` (the default; tensor2tensor's ``beam_search`` with ``stop_early``, the code of
    the paper): every candidate among the best 2K that ends in EOS finishes. The sentence is
    done when (a) its n-best list is full and no live hypothesis can beat the worst entry even
    at the most favourable length (log-probabilities only decrease, so the best it can do is
    its current log-probability divided by the largest length penalty it can still reach), or
    (b) its maximum output length is reached: the step after ``max_len`` output tokens allows
    EOS only. However many hypotheses have finished, the search goes on until (a) or (b).
  - ``"fairseq"``: only the candidates among the best K that end in EOS finish, and the
    sentence is also done as soon as K hypotheses have finished (the beam is spent).

The paper's rule is the default because it searches what the paper decoded with, and a short
hypothesis that finishes early cannot end the search before a better-scoring longer one is found.
With K = 1 the fairseq rule is greedy search exactly (the first time EOS is the best token, the
beam is spent); the paper rule keeps the EOS among the best two candidates and may continue past
a first EOS, to a longer hypothesis with a better score.

Terminology constraints and a forced prefix are met by another choice of the next beam, with
the same rules for finishing and stopping: :mod:`aiayn.inference.constrained`.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, overload

import torch
from torch import Tensor

from aiayn import native as native_kernels
from aiayn.data.collate import BOS_ID, EOS_ID, PAD_ID


class SearchCache(Protocol):
    """What search needs of a decoder state."""

    def reorder(self, rows: Tensor) -> None: ...

    def keep(self, rows: Tensor) -> None: ...


CacheT = TypeVar("CacheT", bound=SearchCache)

# Beam search's rules for finishing hypotheses and stopping (see the module docstring).
BeamRule = Literal["paper", "fairseq"]
BEAM_RULES: tuple[BeamRule, ...] = ("paper", "fairseq")


@dataclass(frozen=True)
class Hypothesis:
    """One output sequence.

    ``tokens`` are the output tokens without BOS and EOS; ``log_prob`` is the summed
    log-probability of the tokens and the final EOS; ``score`` is ``log_prob`` divided by the
    length penalty of ``len(tokens) + 1`` positions (what beam search ranks by).
    """

    tokens: list[int]
    score: float
    log_prob: float


@overload
def gnmt_length_penalty(length: float, alpha: float) -> float: ...


@overload
def gnmt_length_penalty(length: Tensor, alpha: float) -> Tensor: ...


def gnmt_length_penalty(length: float | Tensor, alpha: float) -> float | Tensor:
    """GNMT's length penalty ``lp(|Y|) = ((5 + |Y|) / 6) ** alpha`` (Wu et al., 2016, Eq. 14)."""
    return ((5 + length) / 6) ** alpha


def never_pad_or_bos(
    step_fn: Callable[[Tensor, CacheT], Tensor], bos_output: bool = True
) -> Callable[[Tensor, CacheT], Tensor]:
    """``step_fn`` whose log-probabilities of PAD and BOS are -inf: they are never output.

    What ``aiayn translate`` and validation BLEU decode with, so that both search the same
    outputs. The row is changed in place (the step's buffer, see ``log_probs_step``). With
    ``bos_output=False`` (``model.bos_output``) the distribution is first renormalised
    without BOS, as if its logit were -inf: a model imported from Marian, whose BOS row
    stands for the decoder-start token and is no output there."""
    banned: dict[torch.device, Tensor] = {}

    def step(tokens: Tensor, cache: CacheT) -> Tensor:
        log_probs = step_fn(tokens, cache)  # (rows, V)
        if not bos_output:  # log p_v - log(1 - p_BOS)
            log_probs -= torch.log1p(-log_probs[:, BOS_ID : BOS_ID + 1].exp())
        ids = banned.get(log_probs.device)
        if ids is None:
            ids = banned[log_probs.device] = torch.tensor([PAD_ID, BOS_ID], device=log_probs.device)
        return log_probs.index_fill_(1, ids, float("-inf"))

    return step


def kept_in_place(done: Tensor) -> Tensor:
    """The sentences not ``done`` (b,), in the order that moves fewest cache rows: of the n
    that stay, each keeps its place among the first n, and the places of finished ones there
    are taken by the ones beyond n. ``cache.keep`` then copies a row per finished sentence at
    most, instead of every row after the first finished one."""
    stay = ~done
    n = int(stay.sum())
    order = torch.arange(n, device=done.device)
    order[done[:n].nonzero().squeeze(1)] = stay[n:].nonzero().squeeze(1) + n
    return order


def max_output_lengths(src_lengths: Tensor, a: float, b: int, limit: int | None = None) -> Tensor:
    """Per-sentence output limits ``floor(a * src_len + b)``, capped at ``limit`` when given."""
    lengths = torch.floor(src_lengths.double() * a + b).long().clamp(min=0)
    return lengths.clamp(max=limit) if limit is not None else lengths


def _limits(max_len: int | Tensor, batch_size: int, device: torch.device) -> Tensor:
    if isinstance(max_len, Tensor):
        if max_len.shape != (batch_size,):
            raise ValueError(f"max_len must be an int or a ({batch_size},) tensor")
        limits = max_len.to(device=device, dtype=torch.long)
    else:
        limits = torch.full((batch_size,), int(max_len), dtype=torch.long, device=device)
    if batch_size and int(limits.min()) < 0:
        raise ValueError("max_len must not be negative")
    return limits


def _device(device: torch.device | str | None, max_len: int | Tensor) -> torch.device:
    if device is not None:
        return torch.device(device)
    return max_len.device if isinstance(max_len, Tensor) else torch.device("cpu")


def _force_eos(log_probs: Tensor, forced: Tensor, eos_id: int) -> Tensor:
    """Rows where ``forced`` (broadcast over the leading dims) may only emit EOS, in place
    (a copy would be the step's largest tensor once more) where PyTorch allows it: not on an
    inference tensor outside inference mode."""
    others = torch.ones(log_probs.size(-1), dtype=torch.bool, device=log_probs.device)
    others[eos_id] = False
    mask = forced.view(forced.shape + (1,) * (log_probs.dim() - forced.dim())) & others
    if log_probs.is_inference() and not torch.is_inference_mode_enabled():
        return log_probs.masked_fill(mask, float("-inf"))
    return log_probs.masked_fill_(mask, float("-inf"))


# Devices whose tensors the host reads at no cost (beam search checks each step's finished
# candidates before merging them, instead of one transfer per step).
SYNC_FREE_DEVICES = frozenset({"cpu"})
# Two-stage top-k: blocks of this many consecutive tokens of one beam.
TOPK_BLOCK = 32


# A few tables (K × V int64 each, on the device they were made for) stay cached.
@functools.lru_cache(maxsize=4)
def _block_candidates(
    k: int, vocab: int, width: int, device: torch.device
) -> tuple[Tensor, Tensor | None]:
    """For :func:`top_candidates`: the candidate indices ``j * V + v`` of each block, (K × nb,
    width), block ``j * nb + i`` being tokens ``i * width ..`` of beam j; and those of the
    tokens after the last whole block of every beam, (1, K × rest), or None."""
    n_blocks = vocab // width
    whole = n_blocks * width
    beams = torch.arange(k, device=device)[:, None] * vocab  # (K, 1)
    starts = torch.arange(0, whole, width, device=device)  # (nb,)
    offsets = torch.arange(width, device=device)
    blocks = ((beams + starts).view(-1, 1) + offsets).contiguous()
    if whole == vocab:
        return blocks, None
    return blocks, (beams + torch.arange(whole, vocab, device=device)).view(1, -1)


def top_candidates(log_probs: Tensor, live_scores: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """The ``m`` best of the candidate scores ``live_scores[:, j] + log_probs[:, j, v]``:
    (b, m) scores, best first, and their indices ``j * V + v`` into the (b, K × V) candidates.

    ``log_probs`` is (b, K, V), ``live_scores`` (b, K). The same as ``topk`` over the whole
    (b, K × V) sum, without forming it: the maximum of each block of ``TOPK_BLOCK`` tokens of
    a beam (one pass over ``log_probs``) plus that beam's score bounds every candidate in the
    block, so the best ``m`` candidates lie in the ``m`` best blocks (a block outside them
    holds nothing better than the m-th best block maximum, which is already a candidate), and
    ``topk`` runs over those ``m × TOPK_BLOCK`` candidates and the tokens after the last whole
    block. Equal scores may come out in another order than ``topk`` over the sum would give.
    """
    b, k, vocab = log_probs.shape
    width = TOPK_BLOCK
    n_blocks = vocab // width
    if k * n_blocks < 2 * m:  # too few blocks: plain top-k over the sum
        candidates = (live_scores[:, :, None] + log_probs).reshape(b, k * vocab)
        return candidates.topk(m, dim=1)
    whole = n_blocks * width
    block_max = log_probs[:, :, :whole].reshape(b, k, n_blocks, width).amax(-1)  # (b, K, nb)
    block_max += live_scores[:, :, None]
    best = block_max.view(b, k * n_blocks).topk(m, dim=1).indices  # (b, m)
    blocks, rest = _block_candidates(k, vocab, width, log_probs.device)
    index = blocks[best].view(b, m * width)
    if rest is not None:  # the tokens after the last whole block, of every beam
        index = torch.cat([index, rest.expand(b, -1)], dim=1)
    scores = log_probs.reshape(b, k * vocab).gather(1, index)
    scores += live_scores.gather(1, index // vocab)
    top_score, pick = scores.topk(m, dim=1)
    return top_score, index.gather(1, pick)


@dataclass
class NBestLists:
    """The n-best lists of finished hypotheses of a batched beam search's active sentences
    (``score``, ``logp``, ``length``: (b, N); ``tokens``: (b, N, L); -inf scores where a
    list has room), and the lists of the sentences that are done, by input position
    (``out_*``). Shared by :func:`beam_search` and
    :func:`aiayn.inference.constrained.steered_search`."""

    score: Tensor
    logp: Tensor
    length: Tensor
    tokens: Tensor
    out_score: Tensor
    out_logp: Tensor
    out_len: Tensor
    out_tok: Tensor

    @classmethod
    def empty(cls, batch_size: int, n_keep: int, width: int, device: torch.device) -> NBestLists:
        def scores() -> Tensor:  # float32 whatever the default dtype
            return torch.full(
                (batch_size, n_keep), float("-inf"), device=device, dtype=torch.float32
            )

        def lengths() -> Tensor:
            return torch.zeros(batch_size, n_keep, dtype=torch.long, device=device)

        def tokens() -> Tensor:
            return torch.zeros(batch_size, n_keep, width, dtype=torch.long, device=device)

        return cls(scores(), scores(), lengths(), tokens(), scores(), scores(), lengths(), tokens())

    def add(
        self, merged_score: Tensor, pick: Tensor, fin_tok: Tensor, fin_logp: Tensor, t: int
    ) -> None:
        """Take the finished hypotheses ``fin_tok`` (b, n_fin, t + 1: EOS last) of
        log-probability ``fin_logp`` into the lists, as :func:`_merge` of their scores chose
        (``merged_score``, ``pick``)."""
        b, n_fin = fin_logp.shape
        pick_tok = pick[:, :, None].expand(-1, -1, t + 1)
        self.tokens[:, :, : t + 1] = torch.cat([self.tokens[:, :, : t + 1], fin_tok], 1).gather(
            1, pick_tok
        )
        self.logp = torch.cat([self.logp, fin_logp], 1).gather(1, pick)
        fin_len = torch.full((b, n_fin), t, dtype=torch.long, device=fin_logp.device)
        self.length = torch.cat([self.length, fin_len], 1).gather(1, pick)
        self.score = merged_score

    def retire(self, done: Tensor, ids: Tensor) -> Tensor:
        """Move the lists of the sentences ``done`` (b,) to the results at their input
        positions ``ids[done]``, keep the others' and return their rows
        (:func:`kept_in_place`)."""
        gone = done.nonzero().squeeze(1)
        where = ids[gone]
        self.out_score[where] = self.score[gone]
        self.out_logp[where] = self.logp[gone]
        self.out_len[where] = self.length[gone]
        self.out_tok[where] = self.tokens[gone]
        stay = kept_in_place(done)
        self.score, self.logp = self.score[stay], self.logp[stay]
        self.length, self.tokens = self.length[stay], self.tokens[stay]
        return stay

    def hypotheses(self) -> list[list[Hypothesis]]:
        """The results as host-side lists (:func:`_hypotheses`)."""
        return _hypotheses(self.out_tok, self.out_len, self.out_score, self.out_logp)


def check_beam_arguments(beam_size: int, nbest: int, rule: str) -> None:
    """ValueError for a beam size below 1, an n-best outside 1 to the beam size, or a rule
    not in :data:`BEAM_RULES` (the beam searches' arguments)."""
    if beam_size < 1:
        raise ValueError(f"beam_size must be at least 1, got {beam_size}")
    if not 1 <= nbest <= beam_size:
        raise ValueError(f"nbest must be between 1 and beam_size={beam_size}, got {nbest}")
    if rule not in BEAM_RULES:
        raise ValueError(f"rule must be one of {', '.join(map(repr, BEAM_RULES))}, got {rule!r}")


def beam_search(
    step_fn: Callable[[Tensor, CacheT], Tensor],
    cache: CacheT,
    batch_size: int,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len: int | Tensor,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    nbest: int = 1,
    rule: BeamRule = "paper",
    device: torch.device | str | None = None,
) -> list[list[Hypothesis]]:
    """Beam search over ``batch_size`` sentences with ``rule`` ``"paper"`` (tensor2tensor's)
    or ``"fairseq"`` (both are in the module docstring).

    ``cache`` holds ``batch_size * beam_size`` rows, the beams of sentence i in rows
    ``i * beam_size .. (i + 1) * beam_size - 1``, all alike at the start (for the model's
    cache: ``init_cache(memory, src_pad, max_len, beam_size=K)``, which stores each sentence's
    memory once for its K rows). ``cache.reorder`` only ever moves rows within a sentence's
    K rows.
    ``max_len`` is the most output tokens (EOS not counted) per sentence: an int or a
    (batch_size,) tensor; the cache must hold ``max_len + 1`` positions. Returns, per sentence
    in input order, up to ``nbest`` hypotheses, best score first.
    """
    check_beam_arguments(beam_size, nbest, rule)
    # Of the best 2K candidates, the first ``n_fin`` may finish: all of them by the paper's
    # rule, the best K by fairseq's (which also stops a sentence once K have finished).
    fairseq = rule == "fairseq"
    n_fin = beam_size if fairseq else 2 * beam_size
    dev = _device(device, max_len)
    limits = _limits(max_len, batch_size, dev)
    if batch_size == 0:
        return []
    k, n_keep = beam_size, nbest
    if dev.type == "cpu" and batch_size <= HOST_SEARCH_SENTENCES:
        return _host_beam_search(
            step_fn, cache, limits, k, alpha, bos_id, eos_id, n_keep, n_fin, fairseq
        )
    width = int(limits.max()) + 1
    inf = float("-inf")

    # State of the active sentences (b of them); ``ids`` maps them to the input order.
    ids = torch.arange(batch_size, device=dev)
    f32 = torch.float32  # scores are float32 whatever the default dtype
    live_scores = torch.full((batch_size, k), inf, device=dev, dtype=f32)  # (b, K)
    live_scores[:, 0] = 0.0  # all beams start alike: only the first one is live
    history = torch.zeros(batch_size * k, width, dtype=torch.long, device=dev)  # (b*K, L)
    tokens = torch.full((batch_size * k,), bos_id, dtype=torch.long, device=dev)
    n_finished = torch.zeros(batch_size, dtype=torch.long, device=dev)
    # The n-best list of finished hypotheses of each active sentence, and the results.
    pool = NBestLists.empty(batch_size, n_keep, width, dev)

    # The nearest length limit of the active sentences, on the host: until a sentence reaches
    # its limit no step needs the EOS-forcing mask (a (b, K, V) pass saved on most steps).
    nearest_limit = int(limits.min())
    # Loop invariants, cut down with the batch when sentences leave it: the length penalty
    # at each sentence's limit, and the first cache row of each sentence.
    lp_limit = _length_penalties(limits, alpha)
    row_base = torch.arange(batch_size, device=dev)[:, None] * k
    # Where a host sync costs nothing, steps where no candidate finishes skip the merge.
    host = dev.type in SYNC_FREE_DEVICES
    t = 0
    while True:
        b = ids.numel()
        log_probs = step_fn(tokens, cache).float().view(b, k, -1)  # (b, K, V)
        vocab = log_probs.size(-1)
        if vocab < 2:
            raise ValueError("beam search needs a vocabulary of at least two tokens")
        forced = limits <= t  # (b,): max_len output tokens so far, only EOS may follow
        if t >= nearest_limit:
            log_probs = _force_eos(log_probs, forced, eos_id)
        # Candidates: every live hypothesis extended by every token, scored live + log-prob.
        # At most K of them end in EOS, so the best 2K hold at least K that do not.
        top_score, top_index = top_candidates(log_probs, live_scores, 2 * k)  # (b, 2K)
        del log_probs  # not held into the next step, which may then reuse its memory
        top_beam = top_index // vocab
        top_tok = top_index % vocab
        top_eos = top_tok == eos_id

        # Finished: EOS among the best n_fin candidates (2K: paper, K: fairseq).
        finished = top_eos[:, :n_fin] & (top_score[:, :n_fin] > inf)  # (b, n_fin)
        # Next live beam: the best K candidates without EOS (stable sort keeps score order).
        order = torch.sort(top_eos.to(torch.uint8), dim=1, stable=True).indices[:, :k]
        live_scores = top_score.gather(1, order)  # (b, K)
        live_tok = top_tok.gather(1, order)
        parents = row_base + top_beam.gather(1, order)  # (b, K) cache rows they extend

        # Merge the newly finished hypotheses into the n-best lists (scores only, for now).
        merged_score = pool.score
        if host:
            any_finished = bool(finished.any())
        if not host or any_finished:
            fin_logp = top_score[:, :n_fin].masked_fill(~finished, inf)
            fin_score = fin_logp / gnmt_length_penalty(t + 1.0, alpha)
            merged_score, pick = _merge(pool.score, fin_score, n_keep)
        # The best a live hypothesis can still reach: divide by the largest length penalty.
        # A live hypothesis will hold between t + 2 and limit + 1 positions (EOS included).
        lp_best = lp_limit.clamp(min=gnmt_length_penalty(t + 2.0, alpha))
        bound = live_scores[:, 0] / lp_best
        done = forced | (merged_score[:, -1] >= bound)  # (b,)
        if fairseq:
            n_finished += finished.sum(1)
            done |= n_finished >= k
        if host:
            any_done = bool(done.any())
        else:  # one transfer
            any_finished, any_done = torch.stack([finished.any(), done.any()]).tolist()

        if any_finished:
            fin_parents = (row_base + top_beam[:, :n_fin]).view(-1)  # (b * n_fin,)
            fin_tok = history[fin_parents, : t + 1].view(b, n_fin, t + 1)
            fin_tok[:, :, t] = eos_id
            pool.add(merged_score, pick, fin_tok, fin_logp, t)

        if any_done:
            stay = pool.retire(done, ids)
            if stay.numel() == 0:
                break
            rows = parents[stay].view(-1)
            cache.keep(rows)
            ids, limits, n_finished = ids[stay], limits[stay], n_finished[stay]
            lp_limit, row_base = lp_limit[stay], row_base[: stay.numel()]
            nearest_limit = int(limits.min())
            live_scores, live_tok = live_scores[stay], live_tok[stay]
        else:
            rows = parents.view(-1)
            cache.reorder(rows)
        history, tokens = next_histories(history, rows, live_tok, t)
        t += 1

    return pool.hypotheses()


# Beam and greedy search over at most this many sentences on the CPU keep their bookkeeping
# in Python lists (:func:`_host_beam_search`, :func:`_host_greedy_search`): there the tensor
# operations of a step, each on a few elements, cost more than the arithmetic they do
# (docs/performance.md).
HOST_SEARCH_SENTENCES = 1


def next_histories(
    history: Tensor, rows: Tensor, live_tok: Tensor, t: int
) -> tuple[Tensor, Tensor]:
    """The token histories (rows, L) of the next beam, whose hypotheses extend the rows
    ``rows`` of ``history`` by ``live_tok`` (b, K) at position ``t``, and those tokens, the
    next step's input (in place where the rows allow it)."""
    n_rows = rows.numel()
    history[:n_rows, :t] = history[rows, :t]
    history = history[:n_rows]
    tokens = live_tok.reshape(-1)
    history[:, t] = tokens
    return history, tokens


def _length_penalties(lengths: Tensor, alpha: float) -> Tensor:
    """``lp(n + 1)`` in float32 for hypotheses of ``lengths`` output tokens and their EOS: the
    penalty a finished hypothesis is scored with, or the largest a sentence can reach at its
    length limit."""
    return gnmt_length_penalty(lengths.to(torch.float32) + 1.0, alpha)


def _merge(pool_score: Tensor, fin_score: Tensor, n_keep: int) -> tuple[Tensor, Tensor]:
    """The ``n_keep`` best of each row's n-best scores (b, N) and newly finished ones, best
    first, and where they come from (indices into the two side by side). Of equal scores the
    earlier stays ahead (the list's before the new, a better-ranked candidate before a
    worse): a stable sort, where ``topk`` may order ties by what else is in the batch."""
    merged, pick = torch.cat([pool_score, fin_score], 1).sort(dim=1, descending=True, stable=True)
    return merged[:, :n_keep], pick[:, :n_keep]


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as a Python float."""
    value: float = struct.unpack("f", struct.pack("f", x))[0]
    return value


def _host_bound(best_live: float, lp_limit: float, t: int, alpha: float) -> float:
    """One sentence's bound as :func:`beam_search` computes it in float32, ``best_live /
    lp_limit.clamp(min=gnmt_length_penalty(t + 2.0, alpha))``: the clamp's bound is rounded
    to float32, and the quotient of two float32 values divided as doubles and rounded to
    float32 is their float32 quotient (a double carries more than twice float32's precision,
    so the second rounding cannot change the first)."""
    return _f32(best_live / max(lp_limit, _f32(gnmt_length_penalty(t + 2.0, alpha))))


def _take(stay: list[int], *lists: list[Any]) -> list[list[Any]]:
    """Each of ``lists`` cut down to the sentences ``stay``, in that order."""
    return [[values[i] for i in stay] for values in lists]


def _kept_in_place_host(done: list[bool]) -> list[int]:
    """:func:`kept_in_place` of a host list."""
    n = done.count(False)
    beyond = iter([i for i in range(n, len(done)) if not done[i]])
    return [next(beyond) if done[i] else i for i in range(n)]


def _host_beam_search(
    step_fn: Callable[[Tensor, CacheT], Tensor],
    cache: CacheT,
    limits: Tensor,
    k: int,
    alpha: float,
    bos_id: int,
    eos_id: int,
    nbest: int,
    n_fin: int,
    fairseq: bool,
) -> list[list[Hypothesis]]:
    """:func:`beam_search` of a few sentences on the CPU, with the same results.

    ``step_fn``, ``cache``, :func:`top_candidates` and the merge into the n-best lists are
    given the tensors :func:`beam_search` gives them; which candidates finish, the next live
    beams, the bound (:func:`_host_bound`) and the histories are kept in Python lists, whose
    scores are float32 values."""
    inf, f32 = float("-inf"), torch.float32
    ids = list(range(limits.numel()))
    lim: list[int] = limits.tolist()
    lp_limit: list[float] = _length_penalties(limits, alpha).tolist()
    live = [[0.0] + [inf] * (k - 1) for _ in ids]  # all beams start alike: one is live
    history: list[list[list[int]]] = [[[] for _ in range(k)] for _ in ids]
    # Each sentence's n-best list of (score, log-probability, tokens), best first.
    pools: list[list[tuple[float, float, list[int]]]] = [[(inf, inf, [])] * nbest for _ in ids]
    n_finished = [0] * len(ids)
    results: list[list[Hypothesis]] = [[] for _ in ids]
    tokens = torch.full((len(ids) * k,), bos_id, dtype=torch.long)
    nearest_limit = min(lim)
    t = 0
    while True:
        b = len(ids)
        log_probs = step_fn(tokens, cache).float().view(b, k, -1)  # (b, K, V)
        vocab = log_probs.size(-1)
        if vocab < 2:
            raise ValueError("beam search needs a vocabulary of at least two tokens")
        if t >= nearest_limit:
            forced = torch.tensor([limit <= t for limit in lim])
            log_probs = _force_eos(log_probs, forced, eos_id)
        top = top_candidates(log_probs, torch.tensor(live, dtype=f32), 2 * k)
        del log_probs
        top_score: list[list[float]] = top[0].tolist()
        top_index: list[list[int]] = top[1].tolist()

        parents: list[list[int]] = []
        next_tok: list[list[int]] = []
        fin_rows: list[int] = []  # the sentences where candidates finish
        fin_logp: list[list[float]] = []  # theirs, -inf where not finished
        fin_tok: list[list[list[int]]] = []
        for i in range(b):
            scores = top_score[i]
            beam_tok = [divmod(c, vocab) for c in top_index[i]]
            logp = [
                s if tok == eos_id and s > inf else inf
                for s, (_, tok) in zip(scores[:n_fin], beam_tok[:n_fin], strict=True)
            ]
            n_new = sum(s > inf for s in logp)
            if n_new:
                fin_rows.append(i)
                fin_logp.append(logp)
                fin_tok.append([history[i][beam] for beam, _ in beam_tok[:n_fin]])
                n_finished[i] += n_new
            # The next live beams: the best K candidates that do not end in EOS.
            keep = [j for j, (_, tok) in enumerate(beam_tok) if tok != eos_id][:k]
            live[i] = [scores[j] for j in keep]
            parents.append([beam_tok[j][0] for j in keep])
            next_tok.append([beam_tok[j][1] for j in keep])

        if fin_rows:  # beam_search's merge, on the rows of these sentences
            pool_score = torch.tensor([[p[0] for p in pools[i]] for i in fin_rows], dtype=f32)
            fin_score = torch.tensor(fin_logp, dtype=f32) / gnmt_length_penalty(t + 1.0, alpha)
            merged, pick = _merge(pool_score, fin_score, nbest)
            for n, (row_score, row_pick) in enumerate(
                zip(merged.tolist(), pick.tolist(), strict=True)
            ):
                i = fin_rows[n]
                old = pools[i]
                pools[i] = [
                    (s, *old[j][1:])
                    if j < nbest
                    else (s, fin_logp[n][j - nbest], fin_tok[n][j - nbest])
                    for s, j in zip(row_score, row_pick, strict=True)
                ]

        # Done: at the length limit, or no live hypothesis can beat the n-best list's last
        # entry (the bound as beam_search computes it, in float32), or (fairseq) K finished.
        done = [
            lim[i] <= t
            or pools[i][-1][0] >= _host_bound(live[i][0], lp_limit[i], t, alpha)
            or (fairseq and n_finished[i] >= k)
            for i in range(b)
        ]
        if any(done):
            for i in range(b):
                if done[i]:
                    results[ids[i]] = [
                        Hypothesis(tok, score, logp) for score, logp, tok in pools[i] if score > inf
                    ]
            stay = _kept_in_place_host(done)
            if not stay:
                break
            rows = [i * k + beam for i in stay for beam in parents[i]]
            cache.keep(torch.tensor(rows))
            ids, lim, lp_limit, n_finished = _take(stay, ids, lim, lp_limit, n_finished)
            live, pools, history = _take(stay, live, pools, history)
            parents, next_tok = _take(stay, parents, next_tok)
            nearest_limit = min(lim)
        else:
            cache.reorder(torch.tensor([i * k + beam for i in range(b) for beam in parents[i]]))
        history = [
            [history[i][beam] + [tok] for beam, tok in zip(parents[i], next_tok[i], strict=True)]
            for i in range(len(ids))
        ]
        tokens = torch.tensor([tok for row in next_tok for tok in row])
        t += 1
    return results


def _hypotheses(
    out_tok: Tensor, out_len: Tensor, out_score: Tensor, out_logp: Tensor, every: bool = False
) -> list[list[Hypothesis]]:
    """Host-side lists from the result tensors (one transfer): the hypotheses scored above
    -inf (an n-best list's empty places), or ``every`` one."""
    toks = out_tok.cpu().tolist()
    lens = out_len.cpu().tolist()
    scores = out_score.cpu().tolist()
    logps = out_logp.cpu().tolist()
    results: list[list[Hypothesis]] = []
    for i in range(len(toks)):
        hyps = [
            Hypothesis(toks[i][j][: lens[i][j]], scores[i][j], logps[i][j])
            for j in range(len(scores[i]))
            if every or scores[i][j] > -math.inf
        ]
        results.append(hyps)
    return results


def _one_token_search(
    step_fn: Callable[[Tensor, CacheT], Tensor],
    cache: CacheT,
    batch_size: int,
    choose: Callable[[Tensor], Tensor],
    *,
    alpha: float,
    max_len: int | Tensor,
    bos_id: int,
    eos_id: int,
    device: torch.device | str | None,
) -> list[Hypothesis]:
    """One hypothesis per sentence, one token chosen per step by ``choose(log_probs) -> (b,)``."""
    dev = _device(device, max_len)
    limits = _limits(max_len, batch_size, dev)
    if batch_size == 0:
        return []
    width = int(limits.max()) + 1
    ids = torch.arange(batch_size, device=dev)
    history = torch.zeros(batch_size, width, dtype=torch.long, device=dev)  # (b, L)
    log_prob = torch.zeros(batch_size, device=dev, dtype=torch.float32)
    tokens = torch.full((batch_size,), bos_id, dtype=torch.long, device=dev)
    out_tok = torch.zeros(batch_size, 1, width, dtype=torch.long, device=dev)
    out_len = torch.zeros(batch_size, 1, dtype=torch.long, device=dev)
    out_logp = torch.zeros(batch_size, 1, device=dev, dtype=torch.float32)
    nearest_limit = int(limits.min())  # as in beam_search: the mask only when needed
    t = 0
    while True:
        log_probs = step_fn(tokens, cache).float()  # (b, V)
        forced = limits <= t if t >= nearest_limit else None
        if forced is not None:
            log_probs = _force_eos(log_probs, forced, eos_id)
        tokens = choose(log_probs)
        if forced is not None:  # EOS, even where the model gives it no probability
            tokens = tokens.masked_fill(forced, eos_id)
        log_prob += log_probs.gather(1, tokens[:, None]).squeeze(1)
        del log_probs
        history[:, t] = tokens
        done = tokens == eos_id
        if done.any():
            gone = done.nonzero().squeeze(1)
            where = ids[gone]
            out_tok[where, 0] = history[gone]
            out_len[where, 0] = t
            out_logp[where, 0] = log_prob[gone]
            stay = kept_in_place(done)
            if stay.numel() == 0:
                break
            cache.keep(stay)
            ids, limits, history = ids[stay], limits[stay], history[stay]
            nearest_limit = int(limits.min())
            log_prob, tokens = log_prob[stay], tokens[stay]
        t += 1
    out_score = out_logp / _length_penalties(out_len, alpha)
    return [hyps[0] for hyps in _hypotheses(out_tok, out_len, out_score, out_logp, every=True)]


# Greedy's choice over many rows on the CPU: the maximum of each block of ARGMAX_BLOCK tokens
# (a vectorised reduction), then the first maximum of the best block. ``max(dim)`` keeps an
# index with every element and is not vectorised, the slower over many rows; over fewer than
# ARGMAX_ROWS rows it is the faster (docs/performance.md).
ARGMAX_BLOCK = 64
ARGMAX_ROWS = 8


def native_first_argmax() -> Callable[[Tensor], Tensor] | None:
    """The native kernel with :func:`first_argmax`'s result for a float32 CPU matrix that is
    registered with :func:`aiayn.native.register_first_argmax` (aiayn's AVX2 kernel, where
    :mod:`aiayn.accel.panels` loaded it into this process), else None: one pass over each row,
    faster than the blocks and than ``max`` (docs/performance.md). Looked up once a search."""
    return native_kernels.first_argmax()


def first_argmax(scores: Tensor, native: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """The index of the first maximum of each row of ``scores`` (rows, V): what
    ``scores.max(dim=-1).indices`` gives (NaN counting as the maximum), faster on the CPU over
    many rows (:data:`ARGMAX_BLOCK`), or by ``native`` (:func:`native_first_argmax`) for a
    float32 CPU matrix."""
    rows, vocab = scores.shape
    if native is not None and scores.device.type == "cpu" and scores.dtype is torch.float32:
        return native(scores)
    n_blocks = vocab // ARGMAX_BLOCK
    if scores.device.type != "cpu" or rows < ARGMAX_ROWS or n_blocks < 2:
        return scores.max(dim=-1).indices
    whole = n_blocks * ARGMAX_BLOCK
    blocks = scores[:, :whole].reshape(rows, n_blocks, ARGMAX_BLOCK)
    best = blocks.amax(-1).argmax(-1)  # the first block holding the maximum
    row = torch.arange(rows, device=scores.device)
    index = best * ARGMAX_BLOCK + blocks[row, best].argmax(-1)
    if whole < vocab:  # the tokens after the last whole block: taken only where greater
        tail_max, tail_index = scores[:, whole:].max(dim=-1)
        head_max = scores[row, index]
        better = (tail_max > head_max) | (tail_max.isnan() & ~head_max.isnan())
        index = torch.where(better, tail_index + whole, index)
    return index


def greedy_search(
    step_fn: Callable[[Tensor, CacheT], Tensor],
    cache: CacheT,
    batch_size: int,
    *,
    max_len: int | Tensor,
    alpha: float = 0.0,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    device: torch.device | str | None = None,
) -> list[Hypothesis]:
    """The most probable token at each step, until EOS or ``max_len`` output tokens.

    ``cache`` holds ``batch_size`` rows. ``alpha`` only sets how ``Hypothesis.score`` is
    normalised (the choice of tokens ignores it). One hypothesis per sentence, in input order.
    """
    dev = _device(device, max_len)
    native = native_first_argmax() if dev.type == "cpu" else None
    if dev.type == "cpu" and 0 < batch_size <= HOST_SEARCH_SENTENCES:
        limits = _limits(max_len, batch_size, dev)
        return _host_greedy_search(step_fn, cache, limits, alpha, bos_id, eos_id, native)
    return _one_token_search(
        step_fn,
        cache,
        batch_size,
        functools.partial(first_argmax, native=native),
        alpha=alpha,
        max_len=max_len,
        bos_id=bos_id,
        eos_id=eos_id,
        device=device,
    )


def _host_greedy_search(
    step_fn: Callable[[Tensor, CacheT], Tensor],
    cache: CacheT,
    limits: Tensor,
    alpha: float,
    bos_id: int,
    eos_id: int,
    native: Callable[[Tensor], Tensor] | None = None,
) -> list[Hypothesis]:
    """:func:`greedy_search` of a few sentences on the CPU, with the same results: each
    step's maximum (``native``'s where given, else ``max``: both the
    first maximum, as :func:`first_argmax` gives it) and its log-probability come to the
    host, where the sums stay float32 (a float32 sum of float32 values taken as a double and
    rounded to float32 is the same number)."""
    ids = list(range(limits.numel()))
    lim: list[int] = limits.tolist()
    history: list[list[int]] = [[] for _ in ids]
    log_prob = [0.0 for _ in ids]
    out: list[tuple[list[int], float]] = [([], 0.0) for _ in ids]
    tokens = torch.full((len(ids),), bos_id, dtype=torch.long)
    nearest_limit = min(lim)
    t = 0
    while True:
        log_probs = step_fn(tokens, cache).float()  # (b, V)
        forced = [limit <= t for limit in lim]
        if t >= nearest_limit:
            log_probs = _force_eos(log_probs, torch.tensor(forced), eos_id)
        if native is not None and log_probs.dtype is torch.float32:
            indices = native(log_probs)
            best_values = log_probs.gather(1, indices[:, None]).squeeze(1)
        else:
            best_values, indices = log_probs.max(dim=-1)
        del log_probs
        values: list[float] = best_values.tolist()
        chosen: list[int] = indices.tolist()
        done = []
        for i, (value, token) in enumerate(zip(values, chosen, strict=True)):
            if forced[i]:  # EOS, even where the model gives it no probability (value -inf)
                token = chosen[i] = eos_id
            log_prob[i] = _f32(log_prob[i] + value)
            if token == eos_id:
                out[ids[i]] = (history[i], log_prob[i])
            else:
                history[i] = [*history[i], token]
            done.append(token == eos_id)
        if any(done):
            stay = _kept_in_place_host(done)
            if not stay:
                break
            cache.keep(torch.tensor(stay))
            ids, lim, history, log_prob, chosen = _take(stay, ids, lim, history, log_prob, chosen)
            nearest_limit = min(lim)
        tokens = torch.tensor(chosen)
        t += 1
    # The scores as greedy_search takes them: float32 tensors, (sentences, 1).
    out_logp = torch.tensor([[logp] for _, logp in out], dtype=torch.float32)
    out_len = torch.tensor([[len(tokens)] for tokens, _ in out])
    scores = (out_logp / _length_penalties(out_len, alpha)).view(-1)
    scores_list: list[float] = scores.tolist()
    return [
        Hypothesis(tokens, score, logp)
        for (tokens, logp), score in zip(out, scores_list, strict=True)
    ]


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Logits (rows, V) with all but the ``top_k`` best tokens (0: no limit) and all but the
    smallest set whose probability reaches ``top_p`` (nucleus) set to -inf."""
    if top_k > 0 and top_k < logits.size(-1):
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (rows, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p (the best always stays).
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    step_fn: Callable[[Tensor, CacheT], Tensor],
    cache: CacheT,
    batch_size: int,
    *,
    max_len: int | Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    alpha: float = 0.0,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    device: torch.device | str | None = None,
) -> list[Hypothesis]:
    """Ancestral sampling from ``softmax(log_probs / temperature)``, restricted to the
    ``top_k`` best tokens and to the ``top_p`` nucleus; for non-translation uses.

    ``Hypothesis.log_prob`` is the model's log-probability of the sample (temperature 1, no
    filtering). Draws come from ``generator`` (on the search device) when given.
    """
    if temperature <= 0.0:
        raise ValueError(f"temperature must be positive (use greedy_search), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")

    def choose(log_probs: Tensor) -> Tensor:
        logits = filter_logits(log_probs / temperature, top_k, top_p)
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)

    return _one_token_search(
        step_fn,
        cache,
        batch_size,
        choose,
        alpha=alpha,
        max_len=max_len,
        bos_id=bos_id,
        eos_id=eos_id,
        device=device,
    )
