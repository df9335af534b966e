"""Scaled dot-product and multi-head attention (§3.2).

``Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V`` is one ``F.scaled_dot_product_attention`` call.
Self-attention projects queries, keys and values with one fused matrix; cross-attention projects
the queries from the decoder and the keys/values (fused) from the encoder output, so that an
incremental decoder projects the memory once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.model.patterns import AttentionPattern, LinformerPattern


def attention_mask(src_pad: Tensor | None) -> Tensor | None:
    """The one place where padding becomes an SDPA mask.

    ``src_pad`` is (B, S) bool, True at padding. SDPA's boolean ``attn_mask`` is True where
    attention is *allowed*, broadcast over heads and queries: (B, 1, 1, S). A batch without
    padding gets no mask at all, which spares SDPA a mask in every layer; the check costs a
    host sync, so it is made once per forward pass or cache, and not while compiling.
    """
    if src_pad is None:
        return None
    if not torch.compiler.is_compiling() and not bool(src_pad.any()):
        return None
    return ~src_pad[:, None, None, :]  # (B, 1, 1, S)


def naive_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False
) -> tuple[Tensor, Tensor]:
    """softmax(QKᵀ/√d_k)V written out, returning (output, weights); for tests and pictures.

    Shapes: q (B, H, T, Dk), k (B, H, S, Dk), v (B, H, S, Dv); ``mask`` as from
    :func:`attention_mask` (True = attend).
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if causal:
        t, s = scores.shape[-2:]
        future = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(1 + s - t)
        scores = scores.masked_fill(future, float("-inf"))
    weights = scores.softmax(dim=-1)
    return weights @ v, weights


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) Wᴼ with head_i = Attention(QWᵢQ, KWᵢK, VWᵢV).

    ``d_k`` and ``d_v`` are per head and independent of ``d_model / n_heads`` (Table 3 rows
    A and B).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_k: int,
        d_v: int,
        *,
        self_attention: bool,
        dropout: float = 0.0,
        bias: bool = True,
        pattern: AttentionPattern | None = None,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.d_k = d_k
        self.d_v = d_v
        self.dropout = dropout
        self.self_attention = self_attention
        # Deviation: §3.2.2 writes the projections as plain matrices; by default they carry
        # biases too (as in fairseq, OpenNMT and torch.nn.MultiheadAttention), 36,864
        # parameters in the base model. model.attention_bias=false gives the equations exactly.
        if self_attention:
            self.qkv_proj = nn.Linear(d_model, n_heads * (2 * d_k + d_v), bias=bias)
        else:
            self.q_proj = nn.Linear(d_model, n_heads * d_k, bias=bias)
            self.kv_proj = nn.Linear(d_model, n_heads * (d_k + d_v), bias=bias)
        self.out_proj = nn.Linear(n_heads * d_v, d_model, bias=bias)
        # An efficient pattern for long sequences instead of full attention (None: full).
        self.pattern = pattern
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Deviation: the paper does not state an initialisation. Each of W^Q, W^K, W^V, W^O is
        # Xavier-uniform on its own (d_model x d_k*h) shape, as in tensor2tensor, even where
        # two or three of them are stored fused in one matrix.
        chunks: list[Tensor]
        if self.self_attention:
            hk, hv = self.n_heads * self.d_k, self.n_heads * self.d_v
            chunks = list(self.qkv_proj.weight.data.split([hk, hk, hv], dim=0))
        else:
            hk, hv = self.n_heads * self.d_k, self.n_heads * self.d_v
            chunks = [self.q_proj.weight.data, *self.kv_proj.weight.data.split([hk, hv], dim=0)]
        for chunk in chunks:
            nn.init.xavier_uniform_(chunk)
        nn.init.xavier_uniform_(self.out_proj.weight)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def _heads(self, x: Tensor, d_head: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, d_head).transpose(1, 2)  # (B, H, T, Dh)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention projections of x (B, T, d_model), each (B, H, T, Dh)."""
        hk, hv = self.n_heads * self.d_k, self.n_heads * self.d_v
        q, k, v = self.qkv_proj(x).split([hk, hk, hv], dim=-1)
        return self._heads(q, self.d_k), self._heads(k, self.d_k), self._heads(v, self.d_v)

    def project_q(self, x: Tensor) -> Tensor:
        """Cross-attention query projection of x (B, T, d_model): (B, H, T, Dk)."""
        return self._heads(self.q_proj(x), self.d_k)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention key/value projections of the encoder output (B, S, d_model), each
        (B, H, S, Dh); the incremental decoder keeps its keys and values in their dtype."""
        hk, hv = self.n_heads * self.d_k, self.n_heads * self.d_v
        k, v = self.kv_proj(memory).split([hk, hv], dim=-1)
        return self._heads(k, self.d_k), self._heads(v, self.d_v)

    def memory_kv(self, memory: Tensor, memory_pad: Tensor | None) -> tuple[Tensor, Tensor]:
        """The cross-attention keys and values an incremental decoder keeps for the encoder
        output (B, S, d_model): :meth:`project_kv`'s, or with a Linformer pattern their
        projection along the sequence to k rows (B, H, k, Dh), which leaves no padding: the
        decoder then attends to them without a mask."""
        k, v = self.project_kv(memory)
        if isinstance(self.pattern, LinformerPattern):
            k, v = self.pattern.project(k, v, memory_pad)
        return k, v

    def scaled_dot_product(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool
    ) -> Tensor:
        """softmax(QKᵀ/√d_k)V for every head: (B, H, T, Dv). ``mask`` is boolean (True =
        attend, from :func:`attention_mask`) or additive (the beam cache's)."""
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
        )

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False
    ) -> Tensor:
        """Scaled dot-product attention over heads, then Wᴼ: returns (B, T, d_model)."""
        return self.merge_heads(self.scaled_dot_product(q, k, v, mask, causal))

    def merge_heads(self, out: Tensor) -> Tensor:
        """Concat(head_1..head_h) Wᴼ of the heads (B, H, T, Dv): (B, T, d_model)."""
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.d_v)  # (B, T, H*Dv)
        return self.out_proj(out)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        causal: bool = False,
    ) -> Tensor:
        """Self-attention over x, or cross-attention from x to ``memory`` when given; through
        the layer's pattern when it has one (``mask`` then must come from
        :func:`attention_mask`)."""
        if self.self_attention:
            q, k, v = self.project_qkv(x)
        else:
            if memory is None:
                raise ValueError("cross-attention needs the encoder memory")
            q = self.project_q(x)
            k, v = self.project_kv(memory)
        if self.pattern is not None:
            key_pad = None if mask is None else ~mask[:, 0, 0, :]
            dropout = self.dropout if self.training else 0.0
            return self.merge_heads(self.pattern(q, k, v, key_pad, causal, dropout))
        return self.attend(q, k, v, mask, causal)
