"""Attention restricted to a pattern, for long sequences (docs/long-sequences.md).

Full attention (§3.2) scores every query against every key: O(n²) time and memory. The
patterns here let each query see a subset of the keys, chosen by position, and compute only
those scores, in blocks of a fixed size so that the work is a few dense batched products:

- ``local``: restricted self-attention (the paper's Table 1 row, §7): query ``i`` sees keys
  ``i - r .. i + r`` (causal: ``i - r .. i``), ``r = model.attention_window``;
- ``longformer`` (Beltagy et al., 2020): the window plus global tokens, the first
  ``model.attention_global`` positions, which attend to every position and are attended by
  every position;
- ``bigbird`` (Zaheer et al., 2020): blocks of ``model.attention_block`` positions; a query
  block sees its neighbour blocks, the global blocks (the first
  ``ceil(attention_global / attention_block)``) and ``model.attention_random_blocks`` other
  blocks drawn at random once per query block (from a generator seeded with the block's
  index, so the pattern is the same at every call and in incremental decoding).

Each takes ``q, k, v`` of shape (B, H, T, D), the keys' padding (B, T) and ``causal``, and
returns (B, H, T, Dv) like ``F.scaled_dot_product_attention``. The blocked computation:
the sequence is cut into ``nb`` blocks of ``bs`` positions (padded at the end); query block
``i`` is scored against a fixed number of key blocks gathered for it (its neighbours, its
random blocks) and against the global keys, the scores are masked at the token level
(window, causality, padding, keys counted twice), and one softmax runs over them together.
The score tensor is (B, H, nb, bs, m) with ``m`` the keys a block sees, instead of (B, H, T,
T). Global queries are computed as full attention rows.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PatternName = Literal["full", "local", "longformer", "bigbird"]
PATTERNS: tuple[str, ...] = ("full", "local", "longformer", "bigbird")


class AttentionPattern(nn.Module):
    """softmax(QKᵀ/√d_k)V over the keys a pattern lets each query see."""

    name = "full"

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, key_pad: Tensor | None, causal: bool, dropout: float
    ) -> Tensor:
        raise NotImplementedError

    def allowed(self, t: int, causal: bool, device: torch.device) -> Tensor:
        """(T, T) bool: which keys each query of a sequence of ``t`` positions sees (for
        attention pictures and tests)."""
        raise NotImplementedError

    def step_keys(self, position: int, device: torch.device) -> Tensor:
        """For incremental decoding: which of the keys ``0 .. position`` the query at
        ``position`` sees (bool, (position + 1,)), as :meth:`forward` with ``causal``."""
        raise NotImplementedError


class BlockPattern(AttentionPattern):
    """A pattern computed in blocks (the module docstring): ``local`` (``window`` > 0,
    ``n_global`` = 0), ``longformer`` (both) or ``bigbird`` (``n_random`` blocks)."""

    def __init__(
        self,
        name: str,
        *,
        window: int = 0,
        n_global: int = 0,
        block: int = 0,
        n_random: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.name = name
        self.window = window
        self.block = block if block > 0 else max(window, 1)
        # bigbird's global tokens are whole blocks
        self.n_global = (
            math.ceil(n_global / self.block) * self.block if name == "bigbird" else n_global
        )
        self.n_random = n_random
        self.seed = seed
        self._random: dict[tuple[int, bool], Tensor] = {}

    def extra_repr(self) -> str:
        return (
            f"{self.name}, window={self.window}, block={self.block}, global={self.n_global}, "
            f"random={self.n_random}"
        )

    # -- which keys ------------------------------------------------------------------------

    def _token_allowed(self, query: Tensor, key: Tensor, causal: bool) -> Tensor:
        """Whether query position ``query`` may see key position ``key`` (broadcast), for
        the keys of the window and random part (the global keys are apart)."""
        allowed = key >= self.n_global  # global keys are scored on their own
        if causal:
            allowed = allowed & (key <= query)
        if self.name != "bigbird":  # a window of tokens; bigbird's is of whole blocks
            allowed = allowed & ((query - key).abs() <= self.window)
        return allowed

    def _random_blocks(self, nb: int, causal: bool, device: torch.device) -> Tensor:
        """(nb, n_random) key block indices (-1: none) of each query block: blocks outside
        its neighbours and the global blocks (causal: before them), drawn once per query
        block from a generator seeded with ``seed`` and the block's index."""
        cached = self._random.get((nb, causal))
        if cached is None:
            first = self.n_global // self.block
            rows = []
            for i in range(nb):
                last = i - 2 if causal else nb - 1
                pool = [j for j in range(first, last + 1) if abs(j - i) > 1]
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
                order = torch.randperm(len(pool), generator=generator).tolist()
                picked = sorted(pool[j] for j in order[: self.n_random])
                rows.append(picked + [-1] * (self.n_random - len(picked)))
            cached = torch.tensor(rows, dtype=torch.long).view(nb, self.n_random)
            self._random[(nb, causal)] = cached
        return cached.to(device)

    def allowed(self, t: int, causal: bool, device: torch.device) -> Tensor:
        """(T, T) bool: which keys each query of a sequence of ``t`` positions sees."""
        return self._allowed_rows(torch.arange(t, device=device), t, causal)

    def step_keys(self, position: int, device: torch.device) -> Tensor:
        query = torch.tensor([position], device=device)
        return self._allowed_rows(query, position + 1, True)[0]

    def _allowed_rows(self, queries: Tensor, t: int, causal: bool) -> Tensor:
        """(len(queries), t) bool: the keys of a sequence of ``t`` positions that each query
        position sees; what :meth:`forward` computes, written out."""
        query, key = queries[:, None], torch.arange(t, device=queries.device)[None, :]
        allowed = self._token_allowed(query, key, causal)
        if self.name == "bigbird":
            bs = self.block
            q_block, k_block = query // bs, key // bs
            before = k_block >= q_block - 1
            neighbours = (
                before & (k_block <= q_block) if causal else before & (k_block <= q_block + 1)
            )
            if self.n_random:
                picked = self._random_blocks(math.ceil(t / bs), causal, queries.device)[
                    q_block[:, 0]
                ]
                neighbours = neighbours | (k_block[..., None] == picked[:, None, :]).any(-1)
            allowed = allowed & neighbours
        visible = key <= query if causal else torch.ones_like(allowed)
        glob = key < self.n_global
        # global keys for every query; every key (causal: before) for the global queries
        return (allowed | glob & visible) | ((query < self.n_global) & visible)

    # -- the computation -------------------------------------------------------------------

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, key_pad: Tensor | None, causal: bool, dropout: float
    ) -> Tensor:
        b, h, t, _ = q.shape
        bs = self.block
        nb = math.ceil(t / bs)
        tp = nb * bs
        device = q.device
        pos = torch.arange(tp, device=device)

        def blocked(x: Tensor) -> Tensor:
            return F.pad(x, (0, 0, 0, tp - t)).view(b, h, nb, bs, x.size(-1))

        qb, kb, vb = blocked(q), blocked(k), blocked(v)
        # Key blocks of each query block: the neighbours (shifts), then the random ones.
        shifts = [-1, 0] if causal else [-1, 0, 1]
        index = torch.arange(nb, device=device)[:, None] + torch.tensor(shifts, device=device)
        if self.n_random:
            index = torch.cat([index, self._random_blocks(nb, causal, device)], dim=1)
        valid = (index >= 0) & (index < nb)  # (nb, w)
        safe = index.clamp(0, nb - 1)
        keys = kb[:, :, safe].flatten(3, 4)  # (B, H, nb, w·bs, D)
        values = vb[:, :, safe].flatten(3, 4)
        key_pos = (safe[..., None] * bs + torch.arange(bs, device=device)).flatten(1)  # (nb, m)
        key_ok = valid.repeat_interleave(bs, dim=1) & (key_pos < t)
        query_pos = pos.view(nb, bs, 1)
        allowed = key_ok[:, None, :] & self._token_allowed(query_pos, key_pos[:, None, :], causal)
        mask = allowed.expand(nb, bs, -1)[None, None]  # (1, 1, nb, bs, m)
        if key_pad is not None:
            pad = F.pad(key_pad, (0, tp - t), value=True)  # (B, tp)
            mask = mask & ~pad[:, key_pos][:, None, :, None, :]
        scale = 1.0 / math.sqrt(q.size(-1))
        scores = torch.matmul(qb, keys.transpose(-2, -1)) * scale  # (B, H, nb, bs, m)
        g = min(self.n_global, t)
        if g:
            global_scores = torch.matmul(qb, k[:, :, None, :g].transpose(-2, -1)) * scale
            global_ok = torch.ones(nb, bs, g, dtype=torch.bool, device=device)
            if causal:
                global_ok = torch.arange(g, device=device) <= query_pos
            global_mask = global_ok[None, None]
            if key_pad is not None:
                global_mask = global_mask & ~key_pad[:, None, None, None, :g]
            scores = torch.cat([scores, global_scores], dim=-1)
            lead = torch.broadcast_shapes(mask.shape[:2], global_mask.shape[:2])
            mask = torch.cat(
                [mask.expand(*lead, -1, -1, -1), global_mask.expand(*lead, -1, -1, -1)], dim=-1
            )
        lowest = torch.finfo(torch.float32).min
        weights = scores.float().masked_fill(~mask, lowest).softmax(dim=-1).to(v.dtype)
        if dropout > 0.0:
            weights = F.dropout(weights, dropout)
        out = torch.matmul(weights[..., : values.size(-2)], values)
        if g:
            out = out + torch.matmul(weights[..., values.size(-2) :], v[:, :, None, :g])
        out = out.flatten(2, 3)[:, :, :t]
        if g:  # the global queries see every key
            rows = self._global_rows(q, k, v, key_pad, causal, dropout, g)
            out = torch.cat([rows, out[:, :, g:]], dim=2)
        return out

    @staticmethod
    def _global_rows(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_pad: Tensor | None,
        causal: bool,
        dropout: float,
        g: int,
    ) -> Tensor:
        t = k.size(2)
        mask = torch.ones(g, t, dtype=torch.bool, device=q.device)
        if causal:
            mask = mask.tril()
        full = mask[None, None]
        if key_pad is not None:
            full = full & ~key_pad[:, None, None, :]
        return F.scaled_dot_product_attention(q[:, :, :g], k, v, attn_mask=full, dropout_p=dropout)


def make_pattern(
    name: str, *, window: int, n_global: int, block: int, n_random: int, seed: int = 0
) -> AttentionPattern | None:
    """The pattern module of ``name`` (None for ``full``: plain scaled dot-product)."""
    if name == "full":
        return None
    if name == "local":
        return BlockPattern("local", window=window)
    if name == "longformer":
        return BlockPattern("longformer", window=window, n_global=n_global)
    if name == "bigbird":
        return BlockPattern(
            "bigbird", n_global=max(n_global, 1), block=block, n_random=n_random, seed=seed
        )
    raise ValueError(f"unknown attention pattern {name!r}; choose one of {', '.join(PATTERNS)}")
