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
T). Global queries are computed as full attention rows: O(n·m) scores instead of O(n²), which
saves time at long lengths. Not memory, against this PyTorch: its fused CPU attention kernel
never stores the n × n weights, and the patterns keep their gathered key and value blocks
for the backward pass, so they use more memory than full attention at every length measured
(docs/long-sequences.md, "Measured").

Two more take another road than a positional pattern:

- ``linformer`` (Wang et al., 2020; :class:`LinformerPattern`): the keys and values are
  projected along the sequence to ``model.linformer_k`` rows by learned matrices, and every
  query attends to those rows: O(n·k) time and memory. Every row mixes every position, so it
  cannot run causally (encoder self-attention and cross-attention only).
- ``lsh`` (Reformer, Kitaev et al., 2020; :class:`LSHPattern`): shared-QK attention in which
  each query sees the keys that hash to its bucket, found by sorting and chunking: O(n·c)
  scores per hash round (c = ``model.lsh_chunk``) plus a sort. Its hashing, sort, gathers
  and rounds are many passes over the chunk scores, which cost more time than full
  attention's one fused product below a few thousand positions, and its sorted copies per
  round more memory than the fused kernel at every length measured (docs/long-sequences.md).
  Which keys a query sees
  depends on the data, so it has no fixed :meth:`AttentionPattern.allowed` and no
  incremental decoding.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.errors import ConfigError

PatternName = Literal["full", "local", "longformer", "bigbird", "linformer", "lsh"]
PATTERNS: tuple[str, ...] = ("full", "local", "longformer", "bigbird", "linformer", "lsh")

LINFORMER_CAUSAL = (
    "linformer attention cannot run causally: its projection mixes every position, future "
    "ones included, into each projected key and value"
)
LSH_NO_INCREMENTAL = (
    "lsh attention has no incremental decoding (the decoder cache keeps keys by position, not "
    "by hash bucket); train and score with it, decode with another model.decoder_attention"
)


def check_decodable(decoder_attention: str, source: str | Path) -> None:
    """Refuse (ConfigError naming ``source``) a model whose decoder attention cannot decode a
    step at a time: before a translator or a server starts, not at its first sentence."""
    if decoder_attention == "lsh":
        raise ConfigError(f"{source}: {LSH_NO_INCREMENTAL}")


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

    # Whether the weights fall on the keys' positions (Linformer's fall on projected rows), so
    # that :meth:`weights` can picture them per token.
    weighs_positions = True

    def weights(self, q: Tensor, k: Tensor, key_pad: Tensor | None, causal: bool) -> Tensor:
        """(B, H, T, S) float32: the attention weights each query gives the keys' positions,
        written out from :meth:`allowed` (attention pictures, tests)."""
        seen = self.allowed(q.size(2), causal, q.device)[None, None]
        if key_pad is not None:
            seen = seen & ~key_pad[:, None, None, :]
        q, k = q.float(), k.float()
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        return scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)


class BlockPattern(AttentionPattern):
    """A pattern computed in blocks (the module docstring): ``local`` (``window`` > 0,
    ``n_global`` = 0), ``longformer`` (both) or ``bigbird`` (``n_random`` blocks).

    Deviation: Longformer (Beltagy et al., 2020, §3.1) scores its global attention with a
    second set of projections, Q_g, K_g, V_g (initialised as copies of the window's); here the
    global tokens' rows and columns use the layer's one set, W^Q, W^K, W^V: a pattern replaces
    the scaled dot-product of already projected queries, keys and values, and owns no
    projection of its own (docs/long-sequences.md).

    Deviation: BigBird's reference code (``bigbird_block_sparse_attention``, as in Hugging
    Face's ``BigBirdBlockSparseAttention``) makes the first and the last blocks global; here
    the global blocks are the first ``ceil(attention_global / attention_block)``: a last
    block that every query saw would be the future of every causal query, and its position
    moves with the length, so that a sentence padded into a longer batch would see other
    global keys than alone (docs/long-sequences.md).
    """

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
        g = min(self.n_global, t)
        if g:  # the global keys, after each block's own
            global_ok = torch.ones(nb, bs, g, dtype=torch.bool, device=device)
            if causal:
                global_ok = torch.arange(g, device=device) <= query_pos
            global_mask = global_ok[None, None]
            if key_pad is not None:
                global_mask = global_mask & ~key_pad[:, None, None, None, :g]
            lead = torch.broadcast_shapes(mask.shape[:2], global_mask.shape[:2])
            mask = torch.cat(
                [mask.expand(*lead, -1, -1, -1), global_mask.expand(*lead, -1, -1, -1)], dim=-1
            )
            keys = torch.cat([keys, k[:, :, None, :g].expand(-1, -1, nb, -1, -1)], dim=3)
            values = torch.cat([values, v[:, :, None, :g].expand(-1, -1, nb, -1, -1)], dim=3)
        # A query that sees no key (a padding position) attends to all of its block's keys:
        # finite, and never used.
        mask = mask | ~mask.any(-1, keepdim=True)
        # One fused attention call over the blocks, the blocks in the place of SDPA's heads
        # and (B·H) as its batch, all views of the gathered blocks: the kernel does not keep
        # the (bs × m) weights for the backward pass.
        m = keys.size(3)
        if mask.size(0) > 1:
            block_mask = mask.expand(b, h, nb, bs, m).reshape(b * h, nb, bs, m)
        else:
            block_mask = mask[0]  # (1, nb, bs, m): the same for every sequence and head
        out = F.scaled_dot_product_attention(
            qb.reshape(b * h, nb, bs, -1),
            keys.reshape(b * h, nb, m, -1),
            values.reshape(b * h, nb, m, -1),
            attn_mask=block_mask,
            dropout_p=dropout,
        ).view(b, h, nb, bs, -1)
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


class LinformerPattern(AttentionPattern):
    """Linformer attention (Wang et al., 2020): softmax(Q (E·K)ᵀ / √d_k) (F·V).

    ``E`` and ``F`` (``rows`` × ``max_positions``, learned) project the n keys and values along
    the sequence to ``rows`` = ``model.linformer_k`` rows, sliced to their first n columns for
    a sequence of n positions; one pair per layer, shared by its heads (the paper's headwise
    sharing). Scores are (B, H, T, k) instead of (B, H, T, n): O(n·k) time and memory, a
    saving of both once n exceeds k. Padded keys and values are zeroed before the projection,
    so that padding adds nothing: a padded sequence gets what it gets alone, as the
    projection of its real positions uses the same columns of ``E`` and ``F`` either way.

    Every projected row mixes every position, so the pattern cannot be causal (a causal call
    raises ValueError); it serves the encoder's self-attention and the decoder's
    cross-attention (``model.cross_attention``), where an incremental decoder caches the
    projected memory (:meth:`project`)."""

    name = "linformer"
    weighs_positions = False

    def __init__(self, rows: int, max_positions: int) -> None:
        super().__init__()
        self.rows = rows
        self.max_positions = max_positions
        self.key_proj = nn.Parameter(torch.empty(rows, max_positions))  # E
        self.value_proj = nn.Parameter(torch.empty(rows, max_positions))  # F
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Entries i.i.d. N(0, 1/k): the random projection of the paper's analysis (its
        # Theorem 1, after Johnson-Lindenstrauss), which keeps inner products of the sequence's
        # columns in expectation (E[EᵀE] = I); the paper does not state its trained
        # initialisation.
        std = 1.0 / math.sqrt(self.rows)
        nn.init.normal_(self.key_proj, std=std)
        nn.init.normal_(self.value_proj, std=std)

    def extra_repr(self) -> str:
        return f"k={self.rows}, max_positions={self.max_positions}"

    def project(self, k: Tensor, v: Tensor, key_pad: Tensor | None) -> tuple[Tensor, Tensor]:
        """E·K and F·V: keys (B, H, n, Dk) and values (B, H, n, Dv) projected along the
        sequence to (B, H, k, D·), padded positions (``key_pad`` (B, n), True at padding)
        zeroed first. The result has no padding left."""
        n = k.size(-2)
        if n > self.max_positions:
            raise ValueError(
                f"linformer attention projects at most model.max_positions="
                f"{self.max_positions} positions, got {n}"
            )
        if key_pad is not None:
            pad = key_pad[:, None, :, None]
            k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
        e = self.key_proj[:, :n].to(k.dtype)
        f = self.value_proj[:, :n].to(v.dtype)
        return torch.matmul(e, k), torch.matmul(f, v)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, key_pad: Tensor | None, causal: bool, dropout: float
    ) -> Tensor:
        if causal:
            raise ValueError(LINFORMER_CAUSAL)
        keys, values = self.project(k, v, key_pad)
        # (The cross-attention of a bfloat16 model on the CPU keeps its memory in float32.)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        return F.scaled_dot_product_attention(q, keys, values, dropout_p=dropout)

    def allowed(self, t: int, causal: bool, device: torch.device) -> Tensor:
        raise ValueError("linformer attention weighs projected rows, not positions")

    def step_keys(self, position: int, device: torch.device) -> Tensor:
        raise ValueError(LINFORMER_CAUSAL)

    def weights(self, q: Tensor, k: Tensor, key_pad: Tensor | None, causal: bool) -> Tensor:
        raise ValueError(
            f"linformer attention weighs {self.rows} projected rows, not the keys' positions: "
            "it has no per-token picture"
        )


# Reformer's fills for shared-QK scores: a query's own key (seen only when nothing else is)
# and a key it does not see (finite, so that a row of padding stays a number).
_SELF_SCORE = -1e5
_UNSEEN_SCORE = -1e9


class LSHPattern(AttentionPattern):
    """Reformer's LSH attention (Kitaev et al., 2020), with shared queries and keys.

    - *Shared QK*: the keys are the queries normalised to unit length, k_j = q_j / ‖q_j‖;
      the layer's key projection (W^K) is unused (it stays in the fused projection and gets
      zero gradients). Scores are q_i·k_j, with no 1/√d_k: the keys' unit length takes its
      place, as in trax's and Hugging Face's LSH attention (which normalise k to
      x / rms(x) / √d_k, of length 1). ``dk_scale`` (``model.lsh_dk_scale``) divides them by
      √d_k as well: what aiayn computed before it followed the reference, kept for the
      checkpoints trained so (docs/long-sequences.md).
    - *Hashing*: h(x) = argmax([xR; −xR]) with R a random (d_k, buckets / 2) matrix per round
      and per head, ``rounds`` = ``model.lsh_rounds`` rounds, ``buckets`` =
      ``model.lsh_buckets`` (even; 1, for tests, puts every position in one bucket). One R per
      head and round, the same for every sequence of the batch, as Hugging Face's
      ``LSHSelfAttention`` draws them: a sequence's buckets do not depend on the others in its
      batch. In training R is drawn afresh at every call from torch's global generator (the
      run's seed makes it reproducible); in eval it is fixed, drawn once per head count and
      head size from a generator seeded with ``seed``, so that evaluation and pictures are
      deterministic. (Every layer's eval rotations are the same.)
    - *Sort and chunk*: per round, positions are sorted by (bucket, position) and cut into
      chunks of ``chunk`` = ``model.lsh_chunk``. A query sees the keys *of its own bucket*
      within reach: its chunk and the previous one (non-causal), or the ``chunk`` keys before it
      in the sorted order and itself (causal). The causal reach counts only earlier positions
      of the bucket, which do not depend on later tokens, so no query's keys change with the
      future; padding is sorted behind every real position, so a padded sequence sees what it
      sees alone.
    - *Self*: a query's own key scores −1e5, so that it is attended only when the query sees
      no other key (Reformer's rule for shared QK); padding (and, causally, later positions)
      is never seen.
    - *Rounds*: each round is normalised on its own and the rounds are combined with weights
      softmax over their log-normalisers (logsumexp); a key seen in N_ij rounds has log N_ij
      taken off its score in each (the paper's correction), so that the result is attention
      over the union of the keys the rounds saw, each once (:meth:`seen`).

    Scores take (B, H, T, 2·chunk) per round, and counting the rounds that see each pair
    takes rounds² comparisons over them. The computation is in float32 (outside autocast).
    The eval rotations are not in the state dict: they follow from ``seed``.
    """

    name = "lsh"

    def __init__(
        self, buckets: int, rounds: int, chunk: int, seed: int = 0, dk_scale: bool = False
    ) -> None:
        super().__init__()
        if buckets < 1 or (buckets > 1 and buckets % 2):
            raise ValueError(f"lsh attention needs an even number of buckets (or 1), got {buckets}")
        if rounds < 1 or chunk < 1:
            raise ValueError(f"lsh attention needs rounds and chunk >= 1, got {rounds}, {chunk}")
        self.buckets = buckets
        self.rounds = rounds
        self.chunk = chunk
        self.seed = seed
        self.dk_scale = dk_scale
        self._fixed: dict[tuple[int, int, str], Tensor] = {}

    def extra_repr(self) -> str:
        scale = ", dk_scale=True" if self.dk_scale else ""
        return f"buckets={self.buckets}, rounds={self.rounds}, chunk={self.chunk}{scale}"

    def _scale(self, d: int) -> float:
        """The factor of the scores q_i·k_j: 1 (Reformer's), or 1/√d_k with ``dk_scale``."""
        return 1.0 / math.sqrt(d) if self.dk_scale else 1.0

    # -- hashing ---------------------------------------------------------------------------

    def _rotations(self, h: int, d: int, device: torch.device) -> Tensor:
        """R of every round and head: (rounds, h, d, buckets / 2), float32."""
        shape = (self.rounds, h, d, self.buckets // 2)
        if self.training:
            return torch.randn(shape, device=device)
        key = (h, d, str(device))
        fixed = self._fixed.get(key)
        if fixed is None:
            generator = torch.Generator().manual_seed(self.seed)
            fixed = torch.randn(shape, generator=generator).to(device)
            self._fixed[key] = fixed
        return fixed

    def _sort(self, x: Tensor, key_pad: Tensor | None, tp: int) -> tuple[Tensor, Tensor, Tensor]:
        """Buckets, sorted index (rank) and sorting permutation, each (rounds, B, H, tp), of
        the positions of ``x`` (B, H, T, D) float32, extended to ``tp`` positions: padding and
        the extension get bucket ``buckets``, behind every real position."""
        b, h, t, d = x.shape
        if self.buckets == 1:
            bucket = torch.zeros(self.rounds, b, h, t, dtype=torch.long, device=x.device)
        else:
            rotated = torch.einsum("bhtd,rhdk->rbhtk", x, self._rotations(h, d, x.device))
            bucket = torch.cat([rotated, -rotated], dim=-1).argmax(dim=-1)
        if key_pad is not None:
            bucket = bucket.masked_fill(key_pad[None, :, None, :], self.buckets)
        bucket = F.pad(bucket, (0, tp - t), value=self.buckets)
        positions = torch.arange(tp, device=x.device)
        perm = (bucket * tp + positions).argsort(dim=-1)
        rank = torch.empty_like(perm).scatter_(-1, perm, positions.expand_as(perm).contiguous())
        return bucket, rank, perm

    def _sees(
        self, q_bucket: Tensor, q_rank: Tensor, k_bucket: Tensor, k_rank: Tensor, causal: bool
    ) -> Tensor:
        """Whether a query sees a key in one round (broadcast): the same bucket, and within
        reach in the sorted order."""
        if causal:
            behind = q_rank - k_rank
            near = (behind >= 0) & (behind <= self.chunk)
        else:
            chunks_behind = q_rank // self.chunk - k_rank // self.chunk
            near = (chunks_behind == 0) | (chunks_behind == 1)
        return (q_bucket == k_bucket) & near

    # -- what each query sees, written out -------------------------------------------------

    def seen(self, q: Tensor, key_pad: Tensor | None, causal: bool) -> Tensor:
        """(B, H, T, T) bool: the keys each query sees in any round (its own key included),
        for the queries ``q`` (B, H, T, D); in eval mode what :meth:`forward` sees."""
        t = q.size(2)
        tp = math.ceil(t / self.chunk) * self.chunk
        with torch.autocast(q.device.type, enabled=False):
            bucket, rank, _ = self._sort(q.float(), key_pad, tp)
        bucket, rank = bucket[..., :t], rank[..., :t]
        union = torch.zeros(*q.shape[:3], t, dtype=torch.bool, device=q.device)
        for r in range(self.rounds):
            union |= self._sees(
                bucket[r, ..., :, None], rank[r, ..., :, None], bucket[r, ..., None, :],
                rank[r, ..., None, :], causal,
            )  # fmt: skip
        if key_pad is not None:
            union &= ~key_pad[:, None, None, :]
        if causal:
            union &= torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        return union

    def weights(self, q: Tensor, k: Tensor, key_pad: Tensor | None, causal: bool) -> Tensor:
        """(B, H, T, T) float32: shared-QK attention over :meth:`seen`, its own key scoring
        −1e5, written out (``k`` is unused)."""
        x = q.float()
        scores = torch.matmul(x, F.normalize(x, dim=-1).transpose(-2, -1)) * self._scale(x.size(-1))
        eye = torch.eye(x.size(2), dtype=torch.bool, device=x.device)
        scores = scores.masked_fill(eye, _SELF_SCORE)
        lowest = torch.finfo(torch.float32).min
        return scores.masked_fill(~self.seen(q, key_pad, causal), lowest).softmax(dim=-1)

    def allowed(self, t: int, causal: bool, device: torch.device) -> Tensor:
        raise ValueError("lsh attention's keys depend on the data: see LSHPattern.seen")

    def step_keys(self, position: int, device: torch.device) -> Tensor:
        raise ValueError(LSH_NO_INCREMENTAL)

    # -- the computation -------------------------------------------------------------------

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, key_pad: Tensor | None, causal: bool, dropout: float
    ) -> Tensor:
        with torch.autocast(q.device.type, enabled=False):
            return self._attend(q.float(), v.float(), key_pad, causal, dropout).to(v.dtype)

    def _attend(
        self, x: Tensor, v: Tensor, key_pad: Tensor | None, causal: bool, dropout: float
    ) -> Tensor:
        b, h, t, d = x.shape
        dv = v.size(-1)
        c = self.chunk
        nc = math.ceil(t / c)
        tp = nc * c
        device = x.device
        bucket, rank, perm = self._sort(x, key_pad, tp)
        signature = self._signature(bucket, rank, causal)
        queries = F.pad(x, (0, 0, 0, tp - t))
        keys = F.pad(F.normalize(x, dim=-1), (0, 0, 0, tp - t))
        values = F.pad(v, (0, 0, 0, tp - t))
        key_real = (torch.arange(tp, device=device) < t).expand(b, tp)
        if key_pad is not None:
            key_real = key_real & ~F.pad(key_pad, (0, tp - t), value=True)
        key_real = key_real[:, None].expand(b, h, tp)
        # A chunk's queries are scored against the previous chunk's positions, then their own
        # (2c key slots; query slot o's own key is slot c + o). Causally, query slot o keeps
        # the c + 1 slots o .. o + c (its reach, its own key last), so that every query
        # reduces its scores in the same layout wherever the chunk boundaries fall.
        window = torch.arange(c, device=device)[:, None] + torch.arange(c + 1, device=device)
        scale = self._scale(d)
        outs, lses = [], []
        for r in range(self.rounds):
            order = perm[r]  # (B, H, tp): the position at each sorted index
            q_pos = order.view(b, h, nc, c)
            k_pos = _with_previous(q_pos, -1)  # (B, H, nc, 2c)
            # (a missing previous chunk reads position 0, never seen)
            key_slots = k_pos.clamp(min=0)
            scores = torch.matmul(
                _rows(queries, q_pos), _rows(keys, key_slots).transpose(-2, -1)
            )  # (B, H, nc, c, 2c)
            scores = self._masked(scores * scale, q_pos, k_pos, signature, key_real, r, causal)
            if causal:
                slots = window.expand(b, h, nc, c, c + 1)
                scores = scores.gather(-1, slots)
            lse = scores.logsumexp(dim=-1)  # (B, H, nc, c)
            weights = (scores - lse[..., None]).exp()
            if dropout > 0.0:
                weights = F.dropout(weights, dropout)
            if causal:
                weights = torch.zeros(b, h, nc, c, 2 * c, device=device).scatter(-1, slots, weights)
            out = torch.matmul(weights, _rows(values, key_slots))
            # back to position order
            back = rank[r]
            outs.append(out.view(b, h, tp, dv).gather(2, back[..., None].expand(-1, -1, -1, dv)))
            lses.append(lse.view(b, h, tp).gather(2, back))
        share = torch.stack(lses).softmax(dim=0)  # (rounds, B, H, tp)
        out = (share[..., None] * torch.stack(outs)).sum(dim=0)
        return out[:, :, :t]

    def _signature(self, bucket: Tensor, rank: Tensor, causal: bool) -> Tensor:
        """One integer per round and position, such that a query sees a key in that round
        (:meth:`_sees`) exactly when its integer minus the key's is in [0, reach], with reach
        ``chunk`` (causal) or 1: bucket · width + rank (causal) or + chunk index, the width
        wide enough that keys of another bucket are never within reach."""
        tp = rank.size(-1)
        if causal:
            width, within = tp + self.chunk + 1, rank
        else:
            width, within = tp // self.chunk + 1, rank // self.chunk
        # (doubled by _masked)
        dtype = torch.int32 if 2 * (self.buckets + 1) * width + self.chunk < 2**31 else torch.long
        return (bucket * width + within).to(dtype)

    def _masked(
        self,
        scores: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        signature: Tensor,
        key_real: Tensor,
        r: int,
        causal: bool,
    ) -> Tensor:
        """Round ``r``'s scores (B, H, nc, c, 2c) with the keys it does not see filled, the
        query's own key's score replaced, and log N_ij (the rounds that see the pair) taken
        off. ``q_pos`` (B, H, nc, c) and ``k_pos`` (B, H, nc, 2c) are positions (-1: no key);
        ``signature`` is :meth:`_signature`'s. (Causally, a key within reach is never later
        than the query: the bucket is sorted by position.)"""

        def at(z: Tensor, pos: Tensor) -> Tensor:  # z (B, H, tp) at positions pos (B, H, ...)
            return z.gather(2, pos.flatten(2)).view(pos.shape)

        c = q_pos.size(-1)
        present = k_pos >= 0
        k_pos = k_pos.clamp(min=0)
        key_ok = (present & at(key_real, k_pos))[..., None, :]  # (B, H, nc, 1, 2c)
        # 0 <= q - k <= reach  <=>  |2q - (2k + reach)| <= reach
        reach = c if causal else 1
        here = key_ok
        count: Tensor | None = None
        for other in range(self.rounds):
            twice = signature[other] * 2
            apart = at(twice, q_pos)[..., :, None] - at(twice + reach, k_pos)[..., None, :]
            sees = apart.abs_() <= reach
            if other == r:
                here = here & sees
            if self.rounds > 1:
                count = sees.float() if count is None else count + sees
        own = torch.arange(c, device=scores.device)[:, None] + c == torch.arange(
            2 * c, device=scores.device
        )
        scores = scores.masked_fill(own, _SELF_SCORE)
        if count is not None:
            scores = scores - count.clamp(min=1.0).log()
        return torch.where(here, scores, _UNSEEN_SCORE)


def _rows(z: Tensor, positions: Tensor) -> Tensor:
    """The rows of ``z`` (B, H, tp, D) at ``positions`` (B, H, ...): (B, H, ..., D)."""
    index = positions.flatten(2)[..., None].expand(-1, -1, -1, z.size(-1))
    return z.gather(2, index).view(*positions.shape, z.size(-1))


def _with_previous(z: Tensor, fill: float) -> Tensor:
    """(B, H, nc, c, ...) chunks → (B, H, nc, 2c, ...): each chunk after the one before it
    (``fill`` before the first)."""
    before = torch.cat([torch.full_like(z[:, :, :1], fill), z[:, :, :-1]], dim=2)
    return torch.cat([before, z], dim=3)


def make_pattern(
    name: str,
    *,
    window: int,
    n_global: int,
    block: int,
    n_random: int,
    seed: int = 0,
    max_positions: int = 1024,
    linformer_k: int = 256,
    lsh_buckets: int = 32,
    lsh_rounds: int = 2,
    lsh_chunk: int = 64,
    lsh_dk_scale: bool = False,
) -> AttentionPattern | None:
    """The pattern module of ``name`` (None for ``full``: plain scaled dot-product). The
    keyword arguments are the model.* options of the same names (model.attention_window,
    attention_global, attention_block, attention_random_blocks, max_positions, ...); the
    defaults of the later ones are ModelConfig's."""
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
    if name == "linformer":
        return LinformerPattern(linformer_k, max_positions)
    if name == "lsh":
        return LSHPattern(lsh_buckets, lsh_rounds, lsh_chunk, seed=seed, dk_scale=lsh_dk_scale)
    raise ValueError(f"unknown attention pattern {name!r}; choose one of {', '.join(PATTERNS)}")
