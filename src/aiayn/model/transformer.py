"""The encoder-decoder Transformer (§3) with teacher-forced and incremental decoding."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from aiayn.config import ModelConfig
from aiayn.errors import ConfigError
from aiayn.model.attention import attention_mask
from aiayn.model.cache import DecoderCache, LayerCache
from aiayn.model.embedding import (
    Embeddings,
    PositionalEncoding,
    output_projection,
    token_embedding,
)
from aiayn.model.layers import DecoderLayer, EncoderLayer
from aiayn.model.patterns import LSH_NO_INCREMENTAL, AttentionPattern


class Encoder(nn.Module):
    """A stack of N encoder layers. Post-norm has no final LayerNorm; pre-norm needs one."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # A ModuleList, typed as the list of layers it holds.
        self.layers: list[EncoderLayer] = nn.ModuleList(  # type: ignore[assignment]
            EncoderLayer(config) for _ in range(config.n_layers)
        )
        self.final_norm = (
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.pre_norm else None
        )

        # Activation checkpointing (train.activation_checkpointing): in training, each layer
        # keeps only its input and recomputes the rest in the backward pass.
        self.checkpointing = False

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        for layer in self.layers:
            x = _run_layer(layer, self.checkpointing and self.training, x, mask)
        return self.final_norm(x) if self.final_norm is not None else x


class Decoder(nn.Module):
    """A stack of N decoder layers. Post-norm has no final LayerNorm; pre-norm needs one.
    With ``cross_attention=False``, the stack of a decoder-only language model."""

    def __init__(self, config: ModelConfig, cross_attention: bool = True) -> None:
        super().__init__()
        self.layers: list[DecoderLayer] = nn.ModuleList(  # type: ignore[assignment]
            DecoderLayer(config, cross_attention) for _ in range(config.n_layers)
        )
        self.final_norm = (
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.pre_norm else None
        )

        self.checkpointing = False  # as the encoder's

    def forward(self, x: Tensor, memory: Tensor | None, cross_mask: Tensor | None) -> Tensor:
        for layer in self.layers:
            x = _run_layer(layer, self.checkpointing and self.training, x, memory, cross_mask)
        return self.final_norm(x) if self.final_norm is not None else x

    def step(self, x: Tensor, cache: DecoderCache) -> Tensor:
        self_mask = cache.self_attention_mask()  # the same for every layer
        pattern = self.layers[0].self_attn.pattern
        if pattern is not None and cache.ring is None:  # the keys the pattern leaves it
            self_mask = pattern_step_mask(pattern, cache, self_mask)
        slot, filled = cache.slot(cache.length), cache.filled(cache.length + 1)
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            x = layer.step(
                x, layer_cache, slot, filled, self_mask, cache.cross_mask, cache.beam_size
            )
        return self.final_norm(x) if self.final_norm is not None else x


class Transformer(nn.Module):
    """The paper's encoder-decoder.

    Tensors by role: ``src_ids`` (B, S) token ids; ``src_pad`` (B, S) bool, True at padding;
    ``tgt_in`` (B, T) = BOS + y; ``memory`` (B, S, d_model) encoder output; ``logits`` (B, T, V).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        src_token = token_embedding(config.vocab_size, config.d_model)
        shared = config.share_embeddings
        tgt_token = (
            src_token if shared else token_embedding(config.target_vocab_size, config.d_model)
        )
        self.src_embed = embeddings(config, src_token)
        self.tgt_embed = embeddings(config, tgt_token)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        # With shared embeddings, one matrix for both embeddings and the projection (§3.4).
        self.out_proj = output_projection(
            tgt_token, tied=config.tied_output, bias=config.final_logits_bias
        )

    # -- teacher forcing -------------------------------------------------------------------

    def encode(self, src_ids: Tensor, src_pad: Tensor | None) -> Tensor:
        """Encoder output ``memory`` (B, S, d_model)."""
        return self.encoder(self.src_embed(src_ids), attention_mask(src_pad))

    def decode(self, tgt_in: Tensor, memory: Tensor, src_pad: Tensor | None) -> Tensor:
        """Decoder hidden states (B, T, d_model) for all target positions (causal)."""
        return self.decoder(self.tgt_embed(tgt_in), memory, attention_mask(src_pad))

    def project(self, hidden: Tensor) -> Tensor:
        """Pre-softmax projection to vocabulary logits."""
        return self.out_proj(hidden)

    def forward(
        self, src_ids: Tensor, src_pad: Tensor | None, tgt_in: Tensor, project: bool = True
    ) -> Tensor:
        """Teacher-forced logits (B, T, V); with ``project=False`` the decoder output
        (B, T, d_model) before the pre-softmax projection (for a loss that fuses it in)."""
        memory = self.encode(src_ids, src_pad)
        hidden = self.decode(tgt_in, memory, src_pad)
        return self.project(hidden) if project else hidden

    # -- incremental decoding --------------------------------------------------------------

    def init_cache(
        self, memory: Tensor, src_pad: Tensor | None, max_len: int, beam_size: int = 1
    ) -> DecoderCache:
        """A cache for up to ``max_len`` decoder positions of ``beam_size`` rows per sentence
        of ``memory`` (B, S, d_model): rows ``i * beam_size .. (i + 1) * beam_size - 1``
        decode sentence i. Projects the memory once per layer and sentence (not per beam);
        with ``model.cross_attention = "linformer"`` also along the sequence, to k rows
        without padding (the cache then has no cross mask)."""
        check_cache_size(self.config, max_len, beam_size)
        ring = window_ring(self.config, max_len)
        slots = max_len if ring is None else sum(ring)
        layers = []
        for layer in self.decoder.layers:
            assert layer.cross_attn is not None
            cross_k, cross_v = layer.cross_attn.memory_kv(memory, src_pad)  # (B, H, S or k, Dh)
            # The step's keys and values are stored as the projected memory's are.
            self_k, self_v = layer.empty_self_kv(memory.size(0), slots, beam_size, cross_k)
            layers.append(LayerCache(self_k, self_v, cross_k, cross_v))
        cross_mask = None if self.config.cross_attention == "linformer" else attention_mask(src_pad)
        return DecoderCache(
            layers,
            cross_mask,
            length=0,
            max_len=max_len,
            beam_size=beam_size,
            ring=ring,
        )

    def decode_step(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """Logits (B, V) for the next position, given the tokens (B,) at position
        ``cache.length``; appends their keys and values to the cache."""
        return self.project(self.step_hidden(tokens, cache))

    def log_probs_step(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """Log-probabilities (B, V) of the next token, in float32: ``decode_step`` followed by
        log-softmax, the ``step_fn`` of :mod:`aiayn.inference.search`."""
        return torch.log_softmax(self.decode_step(tokens, cache), dim=-1, dtype=torch.float32)

    def step_hidden(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """The decoder output (B, d_model) for the next position: ``decode_step`` before the
        pre-softmax projection."""
        return decoder_step(self.tgt_embed, self.decoder, tokens, cache)


def window_ring(config: ModelConfig, max_len: int) -> tuple[int, int] | None:
    """The ring (g, w + 1) of a decoder whose self-attention sees a window of ``w`` previous
    positions and the first ``g`` (:mod:`aiayn.model.cache`), or None when it needs every
    position (full, bigbird) or ``max_len`` positions take no more room."""
    kind = config.decoder_attention
    if kind not in ("local", "longformer"):
        return None
    ring = (config.attention_global if kind == "longformer" else 0, config.attention_window + 1)
    return ring if sum(ring) < max_len else None


def check_cache_size(config: ModelConfig, max_len: int, beam_size: int) -> None:
    """Refuse a decoder cache longer than the model's positions, or without a beam, or for a
    decoder whose attention has no incremental form (lsh)."""
    if config.decoder_attention == "lsh":  # (a ConfigError is a ValueError)
        raise ConfigError(LSH_NO_INCREMENTAL)
    if max_len > config.max_positions:
        raise ValueError(f"max_len={max_len} exceeds model.max_positions={config.max_positions}")
    if beam_size < 1:
        raise ValueError(f"beam_size must be at least 1, got {beam_size}")


def embeddings(config: ModelConfig, token: nn.Embedding) -> Embeddings:
    """``token`` scaled by √d_model plus sinusoidal or learned positions, with dropout."""
    learned = config.positional == "learned"
    positions = PositionalEncoding(
        config.max_positions, config.d_model, learned, config.positional_layout
    )
    return Embeddings(token, positions, config.dropout)


def decoder_step(
    embed: Embeddings, decoder: Decoder, tokens: Tensor, cache: DecoderCache
) -> Tensor:
    """One incremental step of a decoder stack: the output (rows, d_model) at position
    ``cache.length`` for ``tokens`` (rows,) there; appends their keys and values to the cache."""
    if cache.length >= cache.max_len:
        raise ValueError(f"cache is full ({cache.max_len} positions)")
    x = embed(tokens[:, None], offset=cache.length)  # (rows, 1, d_model)
    hidden = decoder.step(x, cache)
    cache.length += 1
    return hidden[:, 0]


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (a shared matrix counts once)."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


def _run_layer(layer: nn.Module, checkpointed: bool, *args: Tensor | None) -> Tensor:
    """``layer(*args)``; ``checkpointed``: through ``torch.utils.checkpoint`` (non-reentrant,
    the RNG state kept, so that the recomputation draws the same dropout masks)."""
    if not checkpointed or not torch.is_grad_enabled():
        return layer(*args)
    return checkpoint(layer, *args, use_reentrant=False)


def set_activation_checkpointing(model: nn.Module, on: bool) -> None:
    """Turn activation checkpointing on or off in every encoder and decoder stack of
    ``model`` (train.activation_checkpointing)."""
    for module in model.modules():
        if isinstance(module, (Encoder, Decoder)):
            module.checkpointing = on


def pattern_step_mask(
    pattern: AttentionPattern, cache: DecoderCache, self_mask: Tensor | None
) -> Tensor:
    """``self_mask`` (additive, or None) restricted to the keys that ``pattern`` lets the
    position ``cache.length`` see; the keys are position-major, ``beam_size`` slots each."""
    like = cache.layers[0].self_k
    allowed = pattern.step_keys(cache.length, like.device)  # (t + 1,)
    extra = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device)
    extra = extra.masked_fill(~allowed, float("-inf")).repeat_interleave(cache.beam_size)
    extra = extra.view(1, 1, 1, -1)
    return extra if self_mask is None else self_mask + extra
