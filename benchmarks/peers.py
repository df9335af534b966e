"""The peers, built with the workload's sizes and random weights (nothing is downloaded).

- ``TorchTransformer``: ``torch.nn.Transformer`` with a shared embedding, sinusoids and a tied
  output layer. It has no KV cache: every decoding step re-runs the decoder over the prefix
  (``PrefixCache``), as ``nn.Transformer`` offers no incremental decoding.
- ``marian_model``: Hugging Face ``MarianMTModel`` from a ``MarianConfig`` (ReLU, scaled and
  shared embeddings, sinusoidal positions).
- ``convert_to_ctranslate2``: that Marian model saved locally and converted with
  CTranslate2's own Transformers converter (float32 or int8).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common import EOS_ID, Workload


def available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# -- torch.nn.Transformer -----------------------------------------------------------------


def sinusoids(n_positions: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)."""
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]
    angle = position / torch.pow(
        10000.0, torch.arange(0, d_model, 2, dtype=torch.float64) / d_model
    )
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


class TorchTransformer(nn.Module):
    """``nn.Transformer`` (post-norm, ReLU, batch first) between a shared, √d-scaled embedding
    with sinusoids and a tied pre-softmax projection."""

    def __init__(self, w: Workload, max_positions: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(w.vocab_size, w.d_model)
        nn.init.normal_(self.embed.weight, std=w.d_model**-0.5)
        self.register_buffer("pe", sinusoids(max_positions, w.d_model), persistent=False)
        self.scale = math.sqrt(w.d_model)
        self.dropout = nn.Dropout(w.dropout)
        self.transformer = nn.Transformer(
            d_model=w.d_model,
            nhead=w.n_heads,
            num_encoder_layers=w.n_layers,
            num_decoder_layers=w.n_layers,
            dim_feedforward=w.d_ff,
            dropout=w.dropout,
            batch_first=True,
        )

    def embed_tokens(self, ids: Tensor) -> Tensor:
        return self.dropout(self.embed(ids) * self.scale + self.pe[: ids.size(1)])

    def encode(self, src_ids: Tensor, src_pad: Tensor) -> Tensor:
        return self.transformer.encoder(self.embed_tokens(src_ids), src_key_padding_mask=src_pad)

    def decode(self, tgt_in: Tensor, memory: Tensor, src_pad: Tensor) -> Tensor:
        t = tgt_in.size(1)
        causal = nn.Transformer.generate_square_subsequent_mask(t, dtype=memory.dtype)
        hidden = self.transformer.decoder(
            self.embed_tokens(tgt_in),
            memory,
            tgt_mask=causal,
            tgt_is_causal=True,
            memory_key_padding_mask=src_pad,
        )
        return F.linear(hidden, self.embed.weight)  # (B, T, V), tied

    def forward(self, src_ids: Tensor, src_pad: Tensor, tgt_in: Tensor) -> Tensor:
        return self.decode(tgt_in, self.encode(src_ids, src_pad), src_pad)


class PrefixCache:
    """Decoder state of ``TorchTransformer``: the memory and the prefix decoded so far.

    Satisfies the ``reorder``/``keep`` protocol of ``aiayn.inference.search``.
    """

    def __init__(self, memory: Tensor, src_pad: Tensor) -> None:
        self.memory = memory
        self.src_pad = src_pad
        self.prefix = torch.empty(memory.size(0), 0, dtype=torch.long)

    def reorder(self, rows: Tensor) -> None:
        self.keep(rows)

    def keep(self, rows: Tensor) -> None:
        self.memory = self.memory.index_select(0, rows)
        self.src_pad = self.src_pad.index_select(0, rows)
        self.prefix = self.prefix.index_select(0, rows)


def torch_log_probs_step(model: TorchTransformer, tokens: Tensor, cache: PrefixCache) -> Tensor:
    """Append ``tokens`` to the prefix and re-run the decoder over all of it."""
    cache.prefix = torch.cat([cache.prefix, tokens[:, None]], dim=1)
    logits = model.decode(cache.prefix, cache.memory, cache.src_pad)[:, -1]
    return F.log_softmax(logits.float(), dim=-1)


# -- Hugging Face Marian --------------------------------------------------------------------


def marian_config(w: Workload) -> Any:
    from transformers import MarianConfig

    pad = w.vocab_size - 1  # Marian's convention: padding (and decoder start) is the last id
    return MarianConfig(
        vocab_size=w.vocab_size,
        d_model=w.d_model,
        encoder_layers=w.n_layers,
        decoder_layers=w.n_layers,
        encoder_attention_heads=w.n_heads,
        decoder_attention_heads=w.n_heads,
        encoder_ffn_dim=w.d_ff,
        decoder_ffn_dim=w.d_ff,
        activation_function="relu",
        dropout=w.dropout,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_position_embeddings=256,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=EOS_ID,
        forced_eos_token_id=None,
        bos_token_id=None,
    )


def marian_model(w: Workload, seed: int = 0) -> Any:
    from transformers import MarianMTModel

    torch.manual_seed(seed)
    return MarianMTModel(marian_config(w))


# -- CTranslate2 ----------------------------------------------------------------------------


def vocabulary(w: Workload) -> list[str]:
    """Token strings for the converter: id i is ``t{i}``, with Marian's special tokens."""
    tokens = [f"t{i}" for i in range(w.vocab_size)]
    tokens[1], tokens[EOS_ID], tokens[w.vocab_size - 1] = "<unk>", "</s>", "<pad>"
    return tokens


class _VocabularyOnly:
    """The little of a tokenizer CTranslate2's Marian loader reads (the model has no
    tokenizer: its inputs are random ids)."""

    def __init__(self, tokens: list[str]) -> None:
        self._vocab = {token: i for i, token in enumerate(tokens)}
        self.eos_token, self.unk_token, self.bos_token, self.pad_token = (
            "</s>",
            "<unk>",
            None,
            "<pad>",
        )

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def convert_ids_to_tokens(self, index: int) -> str:
        return next(token for token, i in self._vocab.items() if i == index)


def convert_to_ctranslate2(w: Workload, out_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Save the random Marian model and convert it to CTranslate2 float32 and int8."""
    import ctranslate2.converters as converters

    hf_dir = out_dir / "marian"
    marian_model(w, seed).save_pretrained(hf_dir)
    tokens = vocabulary(w)

    class Converter(converters.TransformersConverter):
        def load_tokenizer(self, tokenizer_class: Any, path: str, **kwargs: Any) -> Any:
            return _VocabularyOnly(tokens)

    paths = {}
    for quantization in ("float32", "int8"):
        target = out_dir / f"ct2-{quantization}"
        Converter(str(hf_dir)).convert(str(target), quantization=quantization, force=True)
        paths[quantization] = target
    return paths
