"""Encoder and decoder layers (§3.1): two (encoder) or three (decoder) sub-layers, each wrapped
as ``LayerNorm(x + Dropout(Sublayer(x)))`` (post-norm, the paper's) or, as an option,
``x + Dropout(Sublayer(LayerNorm(x)))`` (pre-norm)."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.model.attention import MultiHeadAttention
from aiayn.model.cache import LayerCache, empty_self_kv
from aiayn.model.feedforward import PositionwiseFeedForward
from aiayn.model.patterns import make_pattern


class Residual(nn.Module):
    """``x + Dropout(y)``: the residual connection around a sub-layer whose output ``y`` is
    dropped out with probability ``p`` before the add (§3.1, §5.4)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return x + F.dropout(y, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def sublayer_connection(
    x: Tensor,
    sublayer: Callable[[Tensor], Tensor],
    norm: nn.LayerNorm,
    residual: Residual,
    pre_norm: bool,
) -> Tensor:
    """``LayerNorm(x + Dropout(Sublayer(x)))``, or ``x + Dropout(Sublayer(LayerNorm(x)))``
    with ``pre_norm``."""
    if pre_norm:
        return residual(x, sublayer(norm(x)))
    return norm(residual(x, sublayer(x)))


def _attention(
    config: ModelConfig, pattern: str, self_attention: bool = True
) -> MultiHeadAttention:
    """Self-attention (or cross-attention) with the attention ``pattern``:
    model.encoder_attention, decoder_attention or cross_attention."""
    return MultiHeadAttention(
        config.d_model,
        config.n_heads,
        config.head_dim_k,
        config.head_dim_v,
        self_attention=self_attention,
        dropout=config.attention_dropout,
        bias=config.attention_bias,
        pattern=make_pattern(
            pattern,
            window=config.attention_window,
            n_global=config.attention_global,
            block=config.attention_block,
            n_random=config.attention_random_blocks,
            max_positions=config.max_positions,
            linformer_k=config.linformer_k,
            lsh_buckets=config.lsh_buckets,
            lsh_rounds=config.lsh_rounds,
            lsh_chunk=config.lsh_chunk,
            lsh_dk_scale=config.lsh_dk_scale,
        ),
    )


class EncoderLayer(nn.Module):
    """Multi-head self-attention, then the position-wise feed-forward network."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = _attention(config, config.encoder_attention)
        self.ffn = feed_forward(config)
        self.self_attn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.residual = Residual(config.dropout)
        self.pre_norm = config.pre_norm

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = self._sublayer(x, lambda h: self.self_attn(h, mask=mask), self.self_attn_norm)
        return self._sublayer(x, self.ffn, self.ffn_norm)

    def _sublayer(
        self, x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: nn.LayerNorm
    ) -> Tensor:
        return sublayer_connection(x, sublayer, norm, self.residual, self.pre_norm)


class DecoderLayer(nn.Module):
    """Masked self-attention, attention over the encoder output, then the feed-forward network.

    With ``cross_attention=False`` the middle sub-layer is absent: the layer of a decoder-only
    language model (masked self-attention, then the feed-forward network)."""

    def __init__(self, config: ModelConfig, cross_attention: bool = True) -> None:
        super().__init__()
        self.self_attn = _attention(config, config.decoder_attention)
        self.cross_attn = (
            _attention(config, config.cross_attention, self_attention=False)
            if cross_attention
            else None
        )
        self.ffn = feed_forward(config)
        self.self_attn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.cross_attn_norm = (
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if cross_attention else None
        )
        self.ffn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.residual = Residual(config.dropout)
        self.pre_norm = config.pre_norm

    def forward(self, x: Tensor, memory: Tensor | None, cross_mask: Tensor | None) -> Tensor:
        """Teacher forcing over all target positions at once (causal self-attention)."""
        x = self._sublayer(x, lambda h: self.self_attn(h, causal=True), self.self_attn_norm)
        if self.cross_attn is not None and self.cross_attn_norm is not None:
            cross = self.cross_attn
            x = self._sublayer(x, lambda h: cross(h, memory, mask=cross_mask), self.cross_attn_norm)
        return self._sublayer(x, self.ffn, self.ffn_norm)

    def step(
        self,
        x: Tensor,
        cache: LayerCache,
        slot: int,
        filled: int,
        self_mask: Tensor | None,
        cross_mask: Tensor | None,
        beam_size: int = 1,
    ) -> Tensor:
        """One new position x (rows, 1, d_model): writes its K/V into the cache at ``slot``
        (its position, or its place in a ring) and attends over the ``filled`` slots
        (:class:`aiayn.model.cache.DecoderCache`). The ``beam_size`` rows of a
        sentence attend together, as ``beam_size`` query positions: to the keys of all of
        the sentence's beam slots (``self_mask`` keeps each row to its own lineage, see
        :class:`aiayn.model.cache.DecoderCache`) and to the sentence's memory."""
        rows, _, d_model = x.shape
        sentences = rows // beam_size

        def self_attention(h: Tensor) -> Tensor:
            q, k, v = self.self_attn.project_qkv(h.view(sentences, beam_size, d_model))
            cache.write(slot, k, v)  # (sentences, H, beam, Dh) each
            keys, values = cache.keys_values(filled)  # (sentences, H, filled * beam, Dh)
            out = self.self_attn.attend(q, keys, values, self_mask)
            return out.view(rows, 1, d_model)

        x = self._sublayer(x, self_attention, self.self_attn_norm)
        cross = self.cross_attn
        if cross is not None and self.cross_attn_norm is not None:
            cross_k, cross_v = cache.cross_k, cache.cross_v
            assert cross_k is not None and cross_v is not None

            def cross_attention(h: Tensor) -> Tensor:
                q = cross.project_q(h.view(sentences, beam_size, d_model))
                out = cross.attend(q, cross_k, cross_v, cross_mask)
                return out.view(rows, 1, d_model)

            x = self._sublayer(x, cross_attention, self.cross_attn_norm)
        return self._sublayer(x, self.ffn, self.ffn_norm)

    def empty_self_kv(
        self, sentences: int, slots: int, beam_size: int, like: Tensor
    ) -> tuple[Tensor, Tensor]:
        """This layer's preallocated self-attention key and value buffers of ``slots``
        positions for an incremental decode (:func:`aiayn.model.cache.empty_self_kv`), in the
        dtype and on the device of ``like``."""
        attn = self.self_attn
        return empty_self_kv(sentences, attn.n_heads, slots, beam_size, attn.d_k, attn.d_v, like)

    def _sublayer(
        self, x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: nn.LayerNorm
    ) -> Tensor:
        return sublayer_connection(x, sublayer, norm, self.residual, self.pre_norm)


def feed_forward(config: ModelConfig) -> PositionwiseFeedForward:
    return PositionwiseFeedForward(
        config.d_model, config.d_ff, config.relu_dropout, config.activation
    )
