"""Steered beam search: terminology constraints met by dynamic beam allocation, and a forced
prefix (docs/translation.md, "Terminology constraints and a forced prefix").

:func:`steered_search` drives the same ``step_fn`` and cache as
:func:`aiayn.inference.search.beam_search`, batched over sentences: each sentence has K cache
rows, reorders stay within them and finished sentences leave the batch. What changes is how
the next beam is chosen (Post & Vilar 2018, "Fast lexically constrained decoding with dynamic
beam allocation", vectorised over sentences as Hu et al. 2019 do):

- Each sentence's constraints are phrases of token ids; every one must appear in the output,
  whole and in the order of its tokens (any order between phrases). Each hypothesis tracks,
  per phrase, how many of its tokens end the output so far (its *progress*): the next token of
  the phrase advances it, another token breaks it (progress back to 1 if that token starts
  the phrase, else 0); a phrase once whole stays met. Two phrases that share a first token
  progress side by side.
- *Met tokens*: a hypothesis still needs at most ``r`` tokens to meet every phrase: the whole
  length of each unmet phrase, less the progress of the furthest advanced (:func:`remaining`).
  Its *bank* is the sentence's constraint tokens less ``r``.
- Candidates of each step: the best 2K extensions of the live hypotheses (as beam search
  takes them), the best token of each hypothesis, and the next token of each unmet phrase of
  each hypothesis; a candidate that repeats another (same hypothesis, same token) is dropped.
  A candidate that could no longer meet its phrases within the sentence's length limit (its
  ``r`` above the tokens left) is dropped, so one hypothesis can always meet them; EOS
  extends only a hypothesis whose phrases are all met.
- The candidates are put in *bank order*: bank by bank, round robin from the bank with most
  met tokens down: the best of each bank, then the second best of each, and so on (a bank
  without candidates leaves its share to the others). EOS candidates count in the bank of
  their hypothesis, which has met everything.
- The paper's stop rule as beam search applies it, on the bank order: the EOS candidates
  among its first 2K (fairseq's rule: its first K) finish, into the n-best list, and its first
  K candidates that do not end in EOS are the next beam. The sentence is done when no live
  hypothesis can beat the list's last entry (its log-probability only falls, whatever it
  still has to meet), or at the length limit. Only hypotheses with every phrase met can
  finish, so every hypothesis returned meets them. With one bank (nothing to meet) the bank
  order is the score order, and this is beam search's rule exactly. A hypothesis that has
  met everything finishes when its EOS comes early in the bank order, though its score is
  below the best 2K of the unconstrained ones: with one slot per bank and round, the top bank
  is never crowded out.
- A prefix: for its first steps a sentence's one live hypothesis is extended by the prefix's
  next token only, scored as any other token; the search continues from there.

A sentence with neither constraints nor a prefix comes out as beam search gives it (its banks
are one, its extra candidates rank below the best 2K), but :class:`aiayn.inference.translator.
Translator` searches such sentences with :func:`~aiayn.inference.search.beam_search` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from aiayn.data.collate import BOS_ID, EOS_ID
from aiayn.inference.search import (
    BeamRule,
    CacheT,
    Hypothesis,
    NBestLists,
    _device,
    _force_eos,
    _length_penalties,
    _limits,
    _merge,
    check_beam_arguments,
    first_argmax,
    gnmt_length_penalty,
    native_first_argmax,
    next_histories,
    top_candidates,
)
from aiayn.inference.steering import Steering


def progress_after(phrases: Sequence[Sequence[int]], tokens: Sequence[int]) -> list[int]:
    """Each phrase's progress after ``tokens`` (as the search tracks it, on the host)."""
    progress = [0] * len(phrases)
    for token in tokens:
        for j, phrase in enumerate(phrases):
            done = progress[j]
            if done == len(phrase):
                continue
            if token == phrase[done]:
                progress[j] = done + 1
            else:
                progress[j] = 1 if token == phrase[0] else 0
    return progress


def remaining_host(phrases: Sequence[Sequence[int]], progress: Sequence[int]) -> int:
    """:func:`remaining` of one hypothesis on the host."""
    unmet = [(len(p), done) for p, done in zip(phrases, progress, strict=True) if done < len(p)]
    return sum(n for n, _ in unmet) - max((done for _, done in unmet), default=0)


def tokens_needed(steering: Steering) -> int:
    """The output tokens ``steering`` needs at most: its prefix, then the tokens its phrases
    still need after it (:func:`remaining`). A sentence whose limit is below this cannot be
    searched with its constraints."""
    progress = progress_after(steering.constraints, steering.prefix)
    return len(steering.prefix) + remaining_host(steering.constraints, progress)


def remaining(progress: Tensor, lengths: Tensor) -> Tensor:
    """The tokens a hypothesis still needs to meet all its phrases, at most: ``progress``
    (..., P) of phrases of ``lengths`` (broadcast to it; 0 for no phrase) gives the sum of the
    unmet phrases' lengths less the progress of the furthest advanced one. Writing that
    phrase's rest and then every other unmet phrase whole meets them all (a met phrase stays
    met), so the bound is reached."""
    unmet = progress < lengths
    return (lengths * unmet).sum(-1) - (progress * unmet).amax(-1)


def _padded(rows: Sequence[Sequence[Sequence[int]]], device: torch.device) -> Tensor:
    """(b, P, L) token ids, -1 where a sentence has fewer phrases or a phrase fewer tokens."""
    phrases = max(1, max(len(r) for r in rows))
    width = max(1, max((len(p) for r in rows for p in r), default=1))
    out = torch.full((len(rows), phrases, width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        for j, p in enumerate(r):
            out[i, j, : len(p)] = torch.tensor(p, dtype=torch.long)
    return out.to(device)


def _ban_eos(log_probs: Tensor, rows: Tensor, eos_id: int) -> Tensor:
    """``log_probs`` (b, K, V) with EOS at -inf for ``rows`` (b, K): its column written in
    place where PyTorch allows it (as :func:`~aiayn.inference.search._force_eos`)."""
    if log_probs.is_inference() and not torch.is_inference_mode_enabled():
        log_probs = log_probs.clone()
    log_probs[:, :, eos_id].masked_fill_(rows, float("-inf"))
    return log_probs


def _bank_order(score: Tensor, bank: Tensor, top_bank: int) -> Tensor:
    """The candidates (b, M) in the order the next beam takes them: bank by bank, round robin
    from the highest bank, each bank's best first; those scored -inf last."""
    m = score.size(1)
    by_score = score.argsort(dim=1, descending=True, stable=True)
    ranked_bank = torch.where(score > float("-inf"), bank, -1).gather(1, by_score)
    by_bank = ranked_bank.argsort(dim=1, descending=True, stable=True)
    order = by_score.gather(1, by_bank)  # by bank (highest first), then score
    sorted_bank = ranked_bank.gather(1, by_bank)
    position = torch.arange(m, device=score.device).expand_as(sorted_bank)
    starts = torch.ones_like(sorted_bank, dtype=torch.bool)
    starts[:, 1:] = sorted_bank[:, 1:] != sorted_bank[:, :-1]
    rank = position - (position * starts).cummax(dim=1).values  # rank within its bank
    key = rank * (top_bank + 2) + (top_bank - sorted_bank)
    key = key.masked_fill(sorted_bank < 0, (m + 1) * (top_bank + 2))  # the -inf last
    return order.gather(1, key.argsort(dim=1, stable=True))


def steered_search(
    step_fn: Callable[[Tensor, CacheT], Tensor],
    cache: CacheT,
    steering: Sequence[Steering],
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
    """Beam search over ``len(steering)`` sentences, sentence i meeting ``steering[i]``'s
    constraints and starting with its prefix (the module docstring); ``cache``, ``max_len``,
    ``rule`` and the result as :func:`~aiayn.inference.search.beam_search`'s, K =
    ``beam_size`` (1 too). Hypotheses' tokens begin with the prefix, whose log-probabilities
    their scores include. ValueError where a sentence's steering needs more tokens than its
    limit (:func:`tokens_needed`)."""
    batch_size = len(steering)
    check_beam_arguments(beam_size, nbest, rule)
    dev = _device(device, max_len)
    limits = _limits(max_len, batch_size, dev)
    if batch_size == 0:
        return []
    for i, (steer, limit) in enumerate(zip(steering, limits.tolist(), strict=True)):
        if (needed := tokens_needed(steer)) > limit:
            raise ValueError(
                f"sentence {i}: its prefix and constraints need {needed} output tokens, "
                f"more than its limit of {limit}"
            )
    k, n_keep = beam_size, nbest
    fairseq = rule == "fairseq"
    n_fin = k if fairseq else 2 * k
    width = int(limits.max()) + 1
    inf = float("-inf")
    f32 = torch.float32

    phrases = _padded([s.constraints for s in steering], dev)  # (b, P, L)
    lengths = (phrases >= 0).sum(-1)  # (b, P)
    n_phrases = phrases.size(1)
    first = phrases[:, :, 0]  # (b, P)
    total = lengths.sum(-1)  # (b,) constraint tokens per sentence
    top_bank = int(total.max())
    prefix = _padded([[s.prefix] for s in steering], dev)[:, 0]  # (b, Lp)
    prefix_len = (prefix >= 0).sum(-1)  # (b,)
    longest_prefix = int(prefix_len.max())

    ids = torch.arange(batch_size, device=dev)
    live_scores = torch.full((batch_size, k), inf, device=dev, dtype=f32)
    live_scores[:, 0] = 0.0
    progress = torch.zeros(batch_size, k, n_phrases, dtype=torch.long, device=dev)
    history = torch.zeros(batch_size * k, width, dtype=torch.long, device=dev)
    tokens = torch.full((batch_size * k,), bos_id, dtype=torch.long, device=dev)
    n_finished = torch.zeros(batch_size, dtype=torch.long, device=dev)
    pool = NBestLists.empty(batch_size, n_keep, width, dev)

    nearest_limit = int(limits.min())
    lp_limit = _length_penalties(limits, alpha)
    beams = torch.arange(k, device=dev)
    native = native_first_argmax() if dev.type == "cpu" else None
    row_base = torch.arange(batch_size, device=dev)[:, None] * k
    t = 0
    while True:
        b = ids.numel()
        log_probs = step_fn(tokens, cache).float().view(b, k, -1)  # (b, K, V)
        vocab = log_probs.size(-1)
        if vocab < 2:
            raise ValueError("beam search needs a vocabulary of at least two tokens")
        forced = limits <= t
        if t >= nearest_limit:
            log_probs = _force_eos(log_probs, forced, eos_id)
        plen = lengths[:, None, :]  # (b, 1, P)
        unmet = progress < plen  # (b, K, P)
        if top_bank:
            log_probs = _ban_eos(log_probs, unmet.any(-1), eos_id)

        # Candidates: the best 2K; each hypothesis's best token; each unmet phrase's next
        # token of each hypothesis; the prefix's next token (of the one live hypothesis).
        top_score, top_index = top_candidates(log_probs, live_scores, 2 * k)  # (b, 2K)
        best_tok = first_argmax(log_probs.reshape(b * k, vocab), native).view(b, k)
        best_logp = log_probs.gather(2, best_tok[:, :, None]).squeeze(2)  # (b, K)
        next_of = phrases[:, None].expand(b, k, -1, -1)
        at = progress.clamp(max=phrases.size(2) - 1)[..., None]
        wanted = next_of.gather(3, at).squeeze(3)  # (b, K, P): each phrase's next token
        want_tok = wanted.clamp(min=0)
        want_score = (live_scores[:, :, None] + log_probs.gather(2, want_tok)).masked_fill(
            ~unmet, inf
        )
        in_prefix = t < prefix_len  # (b,)
        if t < longest_prefix:
            pre_tok = prefix[:, t].clamp(min=0)
            pre_score = live_scores[:, 0] + log_probs[:, 0].gather(1, pre_tok[:, None])[:, 0]
            pre_score = pre_score.masked_fill(~in_prefix, inf)
        else:
            pre_tok = torch.zeros(b, dtype=torch.long, device=dev)
            pre_score = torch.full((b,), inf, device=dev, dtype=f32)
        del log_probs
        score = torch.cat(
            [top_score, live_scores + best_logp, want_score.view(b, -1), pre_score[:, None]], 1
        )
        parent = torch.cat(
            [
                top_index // vocab,
                beams.expand(b, k),
                beams[:, None].expand(k, n_phrases).reshape(1, -1).expand(b, -1),
                torch.zeros(b, 1, dtype=torch.long, device=dev),
            ],
            1,
        )
        token = torch.cat(
            [top_index % vocab, best_tok, want_tok.view(b, -1), pre_tok[:, None]], 1
        )  # (b, M)
        m = score.size(1)
        if t < longest_prefix:  # a sentence in its prefix: the prefix's token only
            score[:, : m - 1].masked_fill_(in_prefix[:, None], inf)
        # The same extension twice: the first one stays (the best 2K's, whose EOS may finish);
        # one dropped already repeats none.
        key = torch.where(score > inf, parent * vocab + token, -1 - torch.arange(m, device=dev))
        key, by_key = key.sort(dim=1, stable=True)
        repeat = torch.zeros_like(key, dtype=torch.bool)
        repeat.scatter_(1, by_key[:, 1:], key[:, 1:] == key[:, :-1])
        score.masked_fill_(repeat, inf)

        # Each candidate's progress, and what it still needs: within the tokens left.
        index = parent[:, :, None].expand(b, m, n_phrases)
        was = progress.gather(1, index)  # (b, M, P)
        was_wanted = wanted.gather(1, index)
        now = torch.where(
            token[:, :, None] == was_wanted, was + 1, (token[:, :, None] == first[:, None]).long()
        )
        now = torch.where(was < plen, now, was)
        need = remaining(now, plen)  # (b, M)
        eos = token == eos_id
        room = torch.where(eos, 0, (limits - t - 1)[:, None])
        score.masked_fill_(need > room, inf)

        # The candidates in bank order: EOS among the first n_fin finish (2K: paper, K:
        # fairseq), the first K others are the next beam.
        order = _bank_order(score, total[:, None] - need, top_bank)  # (b, M)
        score, token, parent = (
            score.gather(1, order),
            token.gather(1, order),
            parent.gather(1, order),
        )
        now = now.gather(1, order[:, :, None].expand(b, m, n_phrases))
        eos = token == eos_id
        finished = eos[:, :n_fin] & (score[:, :n_fin] > inf)  # (b, n_fin)
        chosen = torch.sort(eos.to(torch.uint8), dim=1, stable=True).indices[:, :k]  # (b, K)
        live_scores = score.gather(1, chosen)
        live_tok = token.gather(1, chosen)
        parents = row_base + parent.gather(1, chosen)
        progress = now.gather(1, chosen[:, :, None].expand(b, k, n_phrases))

        any_finished = bool(finished.any())
        merged_score = pool.score
        if any_finished:
            fin_logp = score[:, :n_fin].masked_fill(~finished, inf)
            fin_score = fin_logp / gnmt_length_penalty(t + 1.0, alpha)
            merged_score, pick = _merge(pool.score, fin_score, n_keep)
        lp_best = lp_limit.clamp(min=gnmt_length_penalty(t + 2.0, alpha))
        bound = live_scores.max(dim=1).values / lp_best
        done = forced | (merged_score[:, -1] >= bound)
        if fairseq:
            n_finished += finished.sum(1)
            done |= n_finished >= k

        if any_finished:
            fin_parents = (row_base + parent[:, :n_fin]).view(-1)
            fin_tok = history[fin_parents, : t + 1].view(b, n_fin, t + 1)
            fin_tok[:, :, t] = eos_id
            pool.add(merged_score, pick, fin_tok, fin_logp, t)

        if bool(done.any()):
            stay = pool.retire(done, ids)
            if stay.numel() == 0:
                break
            rows = parents[stay].view(-1)
            cache.keep(rows)
            ids, limits, n_finished = ids[stay], limits[stay], n_finished[stay]
            lp_limit, row_base = lp_limit[stay], row_base[: stay.numel()]
            nearest_limit = int(limits.min())
            live_scores, live_tok = live_scores[stay], live_tok[stay]
            progress, phrases, lengths = progress[stay], phrases[stay], lengths[stay]
            first, total = first[stay], total[stay]
            prefix, prefix_len = prefix[stay], prefix_len[stay]
        else:
            rows = parents.view(-1)
            cache.reorder(rows)
        history, tokens = next_histories(history, rows, live_tok, t)
        t += 1

    return pool.hypotheses()
