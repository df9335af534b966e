"""Token-budget batches (§5.1: "sentence pairs were batched together by approximate sequence
length"), deterministic in (seed, epoch), sharded evenly over distributed ranks, resumable.

Each epoch the pairs are sorted by (source length, target length) with ties broken by a
permutation drawn from (seed, epoch), cut greedily into batches whose padded size stays within
``max_tokens`` on both sides (lengths count the EOS on the source and BOS/EOS on the target:
``len + 1`` per side), and the batch order is shuffled with the same generator. Every rank
builds the same list and takes every ``world_size``-th batch; so that the shards are disjoint,
cover every pair exactly once and are equally long, the largest batches are split in two until
the number of batches is a multiple of ``world_size``.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

import numpy as np


class TokenBatchSampler:
    """Batches of pair indices with at most ``max_tokens`` padded tokens per side.

    ``state_dict()`` is ``{"epoch": e, "position": p}``: ``p`` batches of epoch ``e`` have been
    handed out on this rank. Iteration continues from there and, at the end of an epoch, moves
    on to the next one (so a plain ``for batch in sampler`` loop sees a new shuffle each time).
    The position counts batches as they are yielded: use the sampler in the training process
    (not behind prefetching workers) when the saved position must be exact.
    """

    def __init__(
        self,
        src_lengths: np.ndarray,
        tgt_lengths: np.ndarray,
        max_tokens: int,
        *,
        seed: int = 1,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        src = np.asarray(src_lengths, dtype=np.int64)
        tgt = np.asarray(tgt_lengths, dtype=np.int64)
        if src.shape != tgt.shape or src.ndim != 1:
            raise ValueError(f"length arrays must be 1-D and equal: {src.shape} vs {tgt.shape}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        longest = int(max(src.max(initial=0), tgt.max(initial=0))) + 1
        if max_tokens < longest:
            raise ValueError(
                f"max_tokens={max_tokens} cannot hold the longest sentence ({longest} tokens "
                "with BOS/EOS); raise max_tokens or filter with a smaller max_len"
            )
        if len(src) < world_size:
            raise ValueError(f"{len(src)} pairs cannot give each of {world_size} ranks a batch")
        self._src = src + 1
        self._tgt = tgt + 1
        self.max_tokens = int(max_tokens)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.epoch = 0
        self.position = 0
        self._cached: tuple[int, list[np.ndarray]] | None = None

    # -- the batches of one epoch ------------------------------------------------------------

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        """All batches of ``epoch`` in order, before sharding (the same on every rank)."""
        rng = np.random.default_rng([self.seed, epoch])
        n = len(self._src)
        tie_break = rng.permutation(n) if self.shuffle else np.arange(n)
        # lexsort: last key is primary. Source length, then target length, then random order.
        order = np.lexsort((tie_break, self._tgt, self._src))
        batches = _pack(order, self._src[order], self._tgt[order], self.max_tokens)
        batches = _split_to_multiple(batches, self.world_size)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def _rank_batches(self) -> list[np.ndarray]:
        if self._cached is None or self._cached[0] != self.epoch:
            self._cached = (
                self.epoch,
                self.global_batches(self.epoch)[self.rank :: self.world_size],
            )
        return self._cached[1]

    # -- the sampler protocol ----------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``; its position restarts at 0 unless it already is the current epoch."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.position = 0

    def __len__(self) -> int:
        return len(self._rank_batches())

    def __iter__(self) -> Iterator[np.ndarray]:
        batches = self._rank_batches()
        while self.position < len(batches):
            batch = batches[self.position]
            self.position += 1
            yield batch
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(self.epoch), "position": int(self.position)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        if not 0 <= self.position <= len(self):
            raise ValueError(
                f"saved position {self.position} is outside epoch {self.epoch}'s "
                f"{len(self)} batches: the lengths or batching options changed since it was saved"
            )


def _pack(order: np.ndarray, src: np.ndarray, tgt: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Greedy cut of the sorted pairs: a batch closes when one more pair would overflow a side.

    The padded size of a side is (pairs in the batch) x (longest sentence of that side).
    """
    cuts = [0]
    start = 0
    longest_src = longest_tgt = 0
    # Plain Python ints: a tight loop over lists is several times faster than over numpy scalars.
    for i, (s, t) in enumerate(zip(src.tolist(), tgt.tolist(), strict=True)):
        longest_src = max(longest_src, s)
        longest_tgt = max(longest_tgt, t)
        if (i + 1 - start) * max(longest_src, longest_tgt) > max_tokens:
            cuts.append(i)
            start = i
            longest_src, longest_tgt = s, t
    cuts.append(len(order))
    return [order[a:b] for a, b in pairwise(cuts) if b > a]


def _split_to_multiple(batches: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    """Halve the largest batches until ``len(batches)`` is a multiple of ``world_size``.

    Halves of a batch never exceed its padded size, so the token budget still holds.
    """
    missing = -len(batches) % world_size
    while missing:
        sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
        largest = int(sizes.argmax())
        if sizes[largest] < 2:  # pragma: no cover - guarded by len(pairs) >= world_size
            raise ValueError("not enough pairs to give every rank a batch")
        batch = batches[largest]
        half = len(batch) // 2
        batches[largest : largest + 1] = [batch[:half], batch[half:]]
        missing -= 1
    return batches
