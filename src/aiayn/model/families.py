"""The two families that grew from the paper's two stacks, built from the same layers.

- :class:`DecoderOnlyLM` (task ``lm``, GPT's shape): the decoder stack without its
  cross-attention sub-layer — masked self-attention and the feed-forward network per layer,
  post-norm by default (pre-norm with ``model.pre_norm``), the embedding scaled by √d_model plus
  sinusoidal or learned positions (§3.4, §3.5), and the pre-softmax projection tied to the
  embedding (``model.share_embeddings``). Incremental decoding uses the translation model's
  :class:`~aiayn.model.cache.DecoderCache`, so every search of :mod:`aiayn.inference.search`
  drives it unchanged.
- :class:`EncoderOnly` (tasks ``mlm`` and ``classify``, BERT's shape): the encoder stack over
  ``BOS + text + EOS``; a masked-language-model head (the tied pre-softmax projection over
  every position) for pre-training, or a sequence-classification head (the first position's
  output, or the mean over the text, through a tanh layer, dropout and a linear layer to the
  classes) for fine-tuning. The classification model keeps the MLM model's parameter names
  for the embedding and the encoder, so that a pre-trained checkpoint loads into it.

Neither has a copy of attention, feed-forward or normalisation code: the layers are
:class:`~aiayn.model.layers.EncoderLayer` and :class:`~aiayn.model.layers.DecoderLayer`.

Deviation: these are the paper's layers in GPT's and BERT's shapes, not GPT's and BERT's
layers: the FFN's ReLU (GPT and BERT use GELU, ``model.activation = "gelu"``), the embedding
scaled by √d_model with no LayerNorm after it (BERT normalises its embeddings; neither scales
them), no segment embeddings, and the MLM head is the tied projection alone (BERT's first
applies a dense layer, GELU and LayerNorm, and adds an output bias). docs/families.md lists
them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.model.attention import attention_mask
from aiayn.model.cache import DecoderCache, LayerCache
from aiayn.model.embedding import output_projection, token_embedding
from aiayn.model.rnn import LuongNMT, RNNSearch
from aiayn.model.transformer import (
    Decoder,
    Encoder,
    Transformer,
    check_cache_size,
    decoder_step,
    embeddings,
    window_ring,
)


class DecoderOnlyLM(nn.Module):
    """A causal language model: ``inputs`` (B, T) token ids → next-token logits (B, T, V).

    Position t sees positions 0..t only, so its output does not depend on later tokens
    (padding at the end of a row changes nothing before it)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        token = token_embedding(config.vocab_size, config.d_model)
        self.embed = embeddings(config, token)
        self.decoder = Decoder(config, cross_attention=False)
        self.out_proj = output_projection(token, tied=config.tied_output)

    def forward(self, inputs: Tensor, pad: Tensor | None = None, project: bool = True) -> Tensor:
        """Logits (B, T, V); with ``project=False`` the hidden states (B, T, d_model) before
        the pre-softmax projection. ``pad`` is accepted for a common signature: causal
        attention never looks right, where padding is."""
        hidden = self.decoder(self.embed(inputs), None, None)
        return self.out_proj(hidden) if project else hidden

    def project(self, hidden: Tensor) -> Tensor:
        return self.out_proj(hidden)

    # -- incremental decoding --------------------------------------------------------------

    def init_cache(self, rows: int, max_len: int, beam_size: int = 1) -> DecoderCache:
        """A cache for ``max_len`` positions of ``rows // beam_size`` sequences with
        ``beam_size`` rows each (the layout of :meth:`Transformer.init_cache`)."""
        check_cache_size(self.config, max_len, beam_size)
        if rows % beam_size:
            raise ValueError(f"{rows} rows do not split into beams of {beam_size}")
        ring = window_ring(self.config, max_len)
        slots = max_len if ring is None else sum(ring)
        layers = []
        for layer in self.decoder.layers:
            kv = layer.empty_self_kv(rows // beam_size, slots, beam_size, self.out_proj.weight)
            layers.append(LayerCache(*kv, None, None))
        return DecoderCache(layers, None, length=0, max_len=max_len, beam_size=beam_size, ring=ring)

    def step_hidden(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """The output (rows, d_model) at position ``cache.length`` for ``tokens`` (rows,)
        there; appends their keys and values to the cache."""
        return decoder_step(self.embed, self.decoder, tokens, cache)

    def decode_step(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """Next-token logits (rows, V)."""
        return self.out_proj(self.step_hidden(tokens, cache))

    def log_probs_step(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """Next-token log-probabilities (rows, V) in float32: the ``step_fn`` of search."""
        return torch.log_softmax(self.decode_step(tokens, cache), dim=-1, dtype=torch.float32)

    def prefill(self, prefix: Tensor, cache: DecoderCache) -> None:
        """Feed ``prefix`` (rows, P) through the cache one position at a time (a prompt
        before generation); the cache then holds P positions."""
        for position in range(prefix.size(1)):
            self.step_hidden(prefix[:, position], cache)


class EncoderOnly(nn.Module):
    """The encoder stack with a head: ``model.task = "mlm"`` → logits (B, T, V) over the
    vocabulary at every position; ``"classify"`` → logits (B, n_classes) per text.

    ``inputs`` (B, T) are ``BOS + text + EOS``; ``pad`` (B, T) is True at padding."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        if config.task not in ("mlm", "classify"):
            raise ValueError(f"EncoderOnly serves the mlm and classify tasks, not {config.task}")
        self.config = config
        token = token_embedding(config.vocab_size, config.d_model)
        self.embed = embeddings(config, token)
        self.encoder = Encoder(config)
        # The head: the MLM projection (tied: no parameters of its own), or the classifier.
        self.out_proj: nn.Linear | None = None
        self.classifier: ClassificationHead | None = None
        if config.task == "mlm":
            self.out_proj = output_projection(token, tied=config.tied_output)
        else:
            self.classifier = ClassificationHead(config)

    def encode(self, inputs: Tensor, pad: Tensor | None) -> Tensor:
        """The encoder output (B, T, d_model)."""
        return self.encoder(self.embed(inputs), attention_mask(pad))

    def forward(self, inputs: Tensor, pad: Tensor, project: bool = True) -> Tensor:
        """MLM: logits (B, T, V), or with ``project=False`` the encoder output (B, T,
        d_model). Classification: class logits (B, n_classes)."""
        hidden = self.encode(inputs, pad)
        if self.classifier is not None:
            return self.classifier(hidden, pad)
        assert self.out_proj is not None
        return self.out_proj(hidden) if project else hidden


class ClassificationHead(nn.Module):
    """Pooled encoder output → tanh(W_p · pooled + b_p) → dropout → class logits.

    ``pooling = "first"`` reads the BOS position (BERT's [CLS]); ``"mean"`` averages the
    non-padding positions (BOS and EOS included)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.pooling = config.pooling
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.out = nn.Linear(config.d_model, config.n_classes)

    def forward(self, hidden: Tensor, pad: Tensor) -> Tensor:
        if self.pooling == "first":
            pooled = hidden[:, 0]
        else:
            keep = (~pad).unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.out(self.dropout(torch.tanh(self.dense(pooled))))


# The models of the translation task (model.arch): one API for search and the translator.
TranslationModel = Transformer | RNNSearch | LuongNMT
AnyModel = TranslationModel | DecoderOnlyLM | EncoderOnly


def build_model(config: ModelConfig, device: torch.device | str | None = None) -> AnyModel:
    """A freshly initialised model of ``config.task``: the encoder-decoder for translation
    (the Transformer, or the RNN baseline of ``model.arch``), :class:`DecoderOnlyLM` for
    ``lm``, :class:`EncoderOnly` for ``mlm`` and ``classify``."""
    model: AnyModel
    if config.arch == "bahdanau":
        model = RNNSearch(config)
    elif config.arch == "luong":
        model = LuongNMT(config)
    elif config.task == "translation":
        model = Transformer(config)
    elif config.task == "lm":
        model = DecoderOnlyLM(config)
    else:
        model = EncoderOnly(config)
    return model.to(device) if device is not None else model


def pretrained_encoder_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The entries of an encoder-only model's state dict that a classifier takes over from
    pre-training: the embedding and the encoder (not the heads)."""
    return {k: v for k, v in state.items() if k.startswith(("embed.", "encoder."))}
