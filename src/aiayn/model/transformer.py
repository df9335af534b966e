"""The encoder-decoder Transformer (§3) with teacher-forced and incremental decoding."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.model.attention import attention_mask
from aiayn.model.cache import DecoderCache, LayerCache, cache_dtype, empty_self_kv
from aiayn.model.embedding import Embeddings, PositionalEncoding
from aiayn.model.layers import DecoderLayer, EncoderLayer
from aiayn.model.packing import linear, packed_product, refresh


class Encoder(nn.Module):
    """A stack of N encoder layers. Post-norm has no final LayerNorm; pre-norm needs one."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layers))
        self.final_norm = (
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.pre_norm else None
        )

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return self.final_norm(x) if self.final_norm is not None else x


class Decoder(nn.Module):
    """A stack of N decoder layers. Post-norm has no final LayerNorm; pre-norm needs one."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.final_norm = (
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.pre_norm else None
        )

    def forward(self, x: Tensor, memory: Tensor, cross_mask: Tensor | None) -> Tensor:
        for layer in self.layers:
            x = layer(x, memory, cross_mask)
        return self.final_norm(x) if self.final_norm is not None else x

    def step(self, x: Tensor, cache: DecoderCache) -> Tensor:
        self_mask = cache.self_attention_mask()  # the same for every layer
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            x = layer.step(
                x, layer_cache, cache.length, self_mask, cache.cross_mask, cache.beam_size
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
        d = config.d_model
        learned = config.positional == "learned"
        src_token = nn.Embedding(config.vocab_size, d)
        # Deviation: the paper does not state an initialisation; embeddings are normal with
        # standard deviation d_model^-0.5 (tensor2tensor's choice), so that after the √d_model
        # scale of §3.4 the inputs have unit variance.
        nn.init.normal_(src_token.weight, mean=0.0, std=d**-0.5)
        if config.share_embeddings:
            tgt_token = src_token
        else:
            tgt_token = nn.Embedding(config.vocab_size, d)
            nn.init.normal_(tgt_token.weight, mean=0.0, std=d**-0.5)
        self.src_embed = Embeddings(
            src_token, PositionalEncoding(config.max_positions, d, learned), config.dropout
        )
        self.tgt_embed = Embeddings(
            tgt_token, PositionalEncoding(config.max_positions, d, learned), config.dropout
        )
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        # Pre-softmax linear transformation (§3.4): no bias; with shared embeddings its weight
        # is the very same Parameter as both embedding matrices.
        self.out_proj = nn.Linear(d, config.vocab_size, bias=False)
        if config.share_embeddings:
            self.out_proj.weight = tgt_token.weight
        else:
            nn.init.normal_(self.out_proj.weight, mean=0.0, std=d**-0.5)

    # -- teacher forcing -------------------------------------------------------------------

    def encode(self, src_ids: Tensor, src_pad: Tensor | None) -> Tensor:
        """Encoder output ``memory`` (B, S, d_model)."""
        refresh()  # packed weights (aiayn.model.packing) that went stale are dropped
        return self.encoder(self.src_embed(src_ids), attention_mask(src_pad))

    def decode(self, tgt_in: Tensor, memory: Tensor, src_pad: Tensor | None) -> Tensor:
        """Decoder hidden states (B, T, d_model) for all target positions (causal)."""
        refresh()
        return self.decoder(self.tgt_embed(tgt_in), memory, attention_mask(src_pad))

    def project(self, hidden: Tensor) -> Tensor:
        """Pre-softmax projection to vocabulary logits."""
        return linear(self.out_proj, hidden)

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
        decode sentence i. Projects the memory once per layer and sentence (not per beam)."""
        if max_len > self.config.max_positions:
            raise ValueError(
                f"max_len={max_len} exceeds model.max_positions={self.config.max_positions}"
            )
        if beam_size < 1:
            raise ValueError(f"beam_size must be at least 1, got {beam_size}")
        refresh()
        layers = []
        for layer in self.decoder.layers:
            cross_k, cross_v = layer.cross_attn.project_kv(memory)  # (B, H, S, Dh)
            dtype = cache_dtype(cross_k)  # under autocast, the projection's dtype
            cross_k, cross_v = cross_k.to(dtype), cross_v.to(dtype)
            self_k, self_v = empty_self_kv(
                memory.size(0),
                self.config.n_heads,
                max_len,
                beam_size,
                layer.self_attn.d_k,
                layer.self_attn.d_v,
                memory,
            )
            layers.append(LayerCache(self_k, self_v, cross_k, cross_v))
        return DecoderCache(
            layers, attention_mask(src_pad), length=0, max_len=max_len, beam_size=beam_size
        )

    def decode_step(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """Logits (B, V) for the next position, given the tokens (B,) at position
        ``cache.length``; appends their keys and values to the cache."""
        return self.project(self._step_hidden(tokens, cache))

    def log_probs_step(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """``decode_step`` followed by log-softmax in float32: the ``step_fn`` of search.

        Without autograd or autocast, on a float32, bfloat16 or float16 model (not an int8
        one), the result lives in a (rows, V) float32 buffer that the cache keeps and every
        call overwrites: it is valid until the next call on this cache (search uses it within
        the step). On a float32 model a step then allocates no vocabulary-sized matrix: the
        logits are written into the buffer and the log-probabilities over them; a bfloat16 or
        float16 model's logits are computed in its dtype and their log-softmax written there in
        float32. After :func:`aiayn.model.packing.pack_for_inference`, float32 steps over 4 to
        128 rows project with the packed matrix into a new matrix instead."""
        hidden = self._step_hidden(tokens, cache)  # (B, d_model)
        weight = self.out_proj.weight
        logits = packed_product(self.out_proj, hidden)
        if logits is None:
            if (
                torch.is_grad_enabled()
                or torch.is_autocast_enabled(hidden.device.type)  # out= would skip autocast
                or type(self.out_proj) is not nn.Linear  # int8: the quantized module packs it
                or hidden.dtype != weight.dtype
            ):
                return torch.log_softmax(self.project(hidden).float(), dim=-1)
            if weight.dtype == torch.float32:
                scratch = cache.scratch(hidden.size(0), weight.size(0))
                logits = torch.mm(hidden, weight.t(), out=scratch)
            else:
                logits = self.project(hidden)
        if logits.dtype == torch.float32:  # the scratch, or a packed product's new matrix
            return torch.log_softmax(logits, dim=-1, out=logits)
        # a bf16 / fp16 model's logits: their log-softmax in float32, into the scratch
        scratch = cache.scratch(hidden.size(0), logits.size(-1))
        return torch.log_softmax(logits, -1, dtype=torch.float32, out=scratch)

    def _step_hidden(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        if cache.length >= cache.max_len:
            raise ValueError(f"cache is full ({cache.max_len} positions)")
        x = self.tgt_embed(tokens[:, None], offset=cache.length)  # (B, 1, d_model)
        hidden = self.decoder.step(x, cache)
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


def build_model(config: ModelConfig, device: torch.device | str | None = None) -> Transformer:
    """A freshly initialised Transformer on ``device``."""
    return Transformer(config).to(device) if device is not None else Transformer(config)
