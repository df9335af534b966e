"""Export of aiayn translation models to CTranslate2, and the cached export that
``aiayn translate --engine ctranslate2`` decodes with.

The model is written through CTranslate2's own specification API
(``ctranslate2.specs.TransformerSpec``), which saves ``model.bin``, ``config.json`` and the
vocabularies; this module fills the specification so that CTranslate2 computes what the model
computes:

- post-norm layers (the paper's) or pre-norm ones with a final LayerNorm per stack, with the
  model's LayerNorm epsilon (``layer_norm_epsilon`` of CTranslate2's model config);
- embeddings scaled by √d_model, plus the model's own position table written out row by row
  (CTranslate2's built-in sinusoids put all sines before all cosines, the paper interleaves
  them; a learned table is written the same way), positions counted from 0;
- the fused self-attention projection as it is stored (queries, keys, values), the
  cross-attention's query and fused key/value projections, with or without biases, and the
  per-head size when d_k·h differs from d_model;
- the source and target embeddings and the pre-softmax projection, each written; CTranslate2
  stores a matrix that appears twice once (shared embeddings, tied projection); a projection
  bias where the model has one (a final-logits bias);
- for a model that never outputs BOS (``model.bos_output = false``: one imported from
  Marian, whose BOS row holds Marian's decoder-start embedding), a logit bias at BOS of
  :data:`NO_OUTPUT_BIAS`, which takes BOS out of the softmax: the distribution aiayn decodes
  such a model with (renormalised without BOS), in CTranslate2's searches and scores alike;
- the feed-forward activation (ReLU, or GELU / Swish where the model has them);
- the vocabularies of :func:`vocabularies`, and the special tokens at aiayn's fixed ids
  (:mod:`aiayn.data.collate`): decoding starts from BOS, ends at EOS, and the source gets EOS
  appended, as aiayn's collate does.

The directory also holds the tokenizer (``sentencepiece.model``; for an imported Marian model
its ``source.spm`` and ``target.spm``), a README that shows how to translate with it, and
``aiayn.json``: what was exported (the checkpoint's size, modification
time and SHA-256, the run's config, the quantization), which the translate cache checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from aiayn import __version__
from aiayn.config import RunConfig, config_from_dict
from aiayn.data.collate import BOS_ID, EOS_ID, UNK_ID
from aiayn.data.tokenizer import PieceVocabTokenizer, Tokenizer
from aiayn.errors import ConfigError, UserError
from aiayn.inference.loading import LoadedModel, load_model
from aiayn.interop import QUANTIZATIONS
from aiayn.model.embedding import PositionalEncoding
from aiayn.model.transformer import Transformer

EXPORT_FORMAT = "aiayn-ct2-export"
EXPORT_VERSION = 1
METADATA_NAME = "aiayn.json"
SENTENCEPIECE_NAME = "sentencepiece.model"
# A piece-vocabulary tokenizer's two sentencepiece models (an imported Marian model's).
SOURCE_SPM_NAME = "source.spm"
TARGET_SPM_NAME = "target.spm"
# aiayn's own tokenizer where no file above is it (a piece-vocabulary tokenizer's JSON).
TOKENIZER_NAME = "aiayn-tokenizer.bin"
# The logit bias of BOS in the export of a model that never outputs BOS (model.bos_output =
# false): far enough below any logit that exp() of the difference is 0 in float32, so the
# softmax is that of the other tokens, and representable in float16 and bfloat16.
NO_OUTPUT_BIAS = -1e4
# The feed-forward activations of aiayn's models, by CTranslate2's names
# (ctranslate2.specs.common_spec.Activation).
_ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "swish": "SWISH"}
INSTALL_HINT = "pip install 'aiayn[interop]'"


def import_ctranslate2() -> ModuleType:
    """The ``ctranslate2`` module, or a :class:`UserError` that says how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise UserError(f"CTranslate2 is not installed: {INSTALL_HINT}") from None
    return ctranslate2


# -- vocabularies and tokenizer files -------------------------------------------------------


def vocabularies(tokenizer: Tokenizer) -> tuple[list[str], list[str]]:
    """The source and target vocabularies as token lists, the token of id ``i`` at index
    ``i``: for aiayn's sentencepiece tokenizer, its pieces by id, one joint list for both;
    for a piece-vocabulary tokenizer (an imported Marian model's), its source and target
    vocabularies."""
    if isinstance(tokenizer, PieceVocabTokenizer):
        return list(tokenizer.source_vocab), list(tokenizer.target_vocab)
    pieces = [tokenizer.piece(i) for i in range(tokenizer.vocab_size)]
    return pieces, list(pieces)


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """The files that tokenise text for the exported model, by name (the README's example
    reads them): for aiayn's sentencepiece tokenizer, its model; for a piece-vocabulary
    tokenizer, the sentencepiece models that cut source text and join target pieces
    (Marian's ``source.spm`` and ``target.spm``)."""
    if isinstance(tokenizer, PieceVocabTokenizer):
        return {SOURCE_SPM_NAME: tokenizer.source_spm, TARGET_SPM_NAME: tokenizer.target_spm}
    return {SENTENCEPIECE_NAME: tokenizer.to_bytes()}


# -- the specification ----------------------------------------------------------------------


def _array(tensor: Tensor) -> np.ndarray:
    """A float32 copy: the specification quantizes in place, the model must not change."""
    return np.array(tensor.detach().to("cpu", torch.float32).numpy(), copy=True)


def _set_linear(spec: Any, layer: nn.Linear) -> None:
    spec.weight = _array(layer.weight)
    if layer.bias is not None:
        spec.bias = _array(layer.bias)


def _set_norm(spec: Any, norm: nn.LayerNorm | None) -> None:
    if norm is None or norm.weight is None or norm.bias is None:
        raise UserError("CTranslate2 needs every LayerNorm with its gain and bias")
    spec.gamma = _array(norm.weight)
    spec.beta = _array(norm.bias)


def _position_table(positions: PositionalEncoding) -> np.ndarray:
    """The rows the model adds at positions 0..P-1: the learned table or the sinusoids, in
    the layout the model computes them in."""
    if positions.learned is not None:
        return _array(positions.learned)
    return _array(positions.get_buffer("table"))


def _output_bias(model: Transformer) -> np.ndarray | None:
    """The bias added to the logits, if any: the model's own (a final-logits bias), with
    :data:`NO_OUTPUT_BIAS` at BOS for a model that never outputs BOS (``model.bos_output =
    false``: aiayn renormalises its decoding distribution without BOS, which is the softmax
    of the other logits)."""
    bias = model.out_proj.bias
    if model.config.bos_output:
        return None if bias is None else _array(bias)
    values = (
        _array(bias)
        if bias is not None
        else np.zeros(model.config.target_vocab_size, dtype=np.float32)
    )
    values[BOS_ID] = NO_OUTPUT_BIAS
    return values


def _check_exportable(model: Transformer) -> None:
    config = model.config
    if config.head_dim_k != config.head_dim_v:
        raise UserError(
            f"CTranslate2 splits its fused attention projections into equal parts: it cannot "
            f"hold d_k={config.head_dim_k} with d_v={config.head_dim_v}"
        )
    activation = getattr(config, "activation", "relu")
    if activation not in _ACTIVATIONS:
        raise UserError(f"no CTranslate2 activation for model.activation={activation!r}")
    for name in ("encoder_attention", "decoder_attention", "cross_attention"):
        pattern = getattr(config, name, "full")
        if pattern != "full":  # it would translate with full attention, silently another model
            raise UserError(f"CTranslate2 has full attention only, not model.{name}={pattern!r}")


def check_unique_pieces(pieces: Sequence[str], side: str, why: str) -> None:
    """UserError where the ``side`` vocabulary lists a piece twice: a format that looks ids
    up by their piece would lose the other (``why`` says how, for the message)."""
    first: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        if piece in first:
            raise UserError(
                f"the {side} vocabulary lists {piece!r} twice (ids {first[piece]} and {i}): {why}"
            )
        first[piece] = i


# CTranslate2 looks tokens up by their piece, the first of equal ones: a piece listed twice
# would lose the other id (its embedding row, its output).
_CT2_DUPLICATE = "CTranslate2 looks tokens up by their piece and would use only the first"


def transformer_spec(
    model: Transformer, source_vocabulary: list[str], target_vocabulary: list[str]
) -> Any:
    """A validated ``ctranslate2.specs.TransformerSpec`` holding ``model``'s weights (float32
    copies) and the two vocabularies (each piece once)."""
    ct2 = import_ctranslate2()
    specs = ct2.specs
    _check_exportable(model)
    check_unique_pieces(source_vocabulary, "source", _CT2_DUPLICATE)
    check_unique_pieces(target_vocabulary, "target", _CT2_DUPLICATE)
    config = model.config
    activation = specs.common_spec.Activation[_ACTIVATIONS[getattr(config, "activation", "relu")]]
    head_dim = config.head_dim_k if config.head_dim_k * config.n_heads != config.d_model else None
    common = {"pre_norm": config.pre_norm, "activation": activation, "head_dim": head_dim}
    encoder = specs.TransformerEncoderSpec(len(model.encoder.layers), config.n_heads, **common)
    decoder = specs.TransformerDecoderSpec(len(model.decoder.layers), config.n_heads, **common)

    encoder.embeddings[0].weight = _array(model.src_embed.token.weight)
    encoder.position_encodings.encodings = _position_table(model.src_embed.positions)
    for layer_spec, layer in zip(encoder.layer, model.encoder.layers, strict=True):
        attention = layer_spec.self_attention
        _set_linear(attention.linear[0], layer.self_attn.qkv_proj)  # W^Q, W^K, W^V fused
        _set_linear(attention.linear[1], layer.self_attn.out_proj)
        _set_norm(attention.layer_norm, layer.self_attn_norm)
        _set_linear(layer_spec.ffn.linear_0, layer.ffn.w1)
        _set_linear(layer_spec.ffn.linear_1, layer.ffn.w2)
        _set_norm(layer_spec.ffn.layer_norm, layer.ffn_norm)
    if config.pre_norm:
        _set_norm(encoder.layer_norm, model.encoder.final_norm)

    decoder.embeddings.weight = _array(model.tgt_embed.token.weight)
    decoder.position_encodings.encodings = _position_table(model.tgt_embed.positions)
    for dec_spec, dec_layer in zip(decoder.layer, model.decoder.layers, strict=True):
        attention = dec_spec.self_attention
        _set_linear(attention.linear[0], dec_layer.self_attn.qkv_proj)
        _set_linear(attention.linear[1], dec_layer.self_attn.out_proj)
        _set_norm(attention.layer_norm, dec_layer.self_attn_norm)
        cross = dec_layer.cross_attn
        assert cross is not None  # the encoder-decoder's layers all attend to the memory
        _set_linear(dec_spec.attention.linear[0], cross.q_proj)
        _set_linear(dec_spec.attention.linear[1], cross.kv_proj)  # W^K, W^V fused
        _set_linear(dec_spec.attention.linear[2], cross.out_proj)
        _set_norm(dec_spec.attention.layer_norm, dec_layer.cross_attn_norm)
        _set_linear(dec_spec.ffn.linear_0, dec_layer.ffn.w1)
        _set_linear(dec_spec.ffn.linear_1, dec_layer.ffn.w2)
        _set_norm(dec_spec.ffn.layer_norm, dec_layer.ffn_norm)
    if config.pre_norm:
        _set_norm(decoder.layer_norm, model.decoder.final_norm)
    decoder.projection.weight = _array(model.out_proj.weight)
    bias = _output_bias(model)
    if bias is not None:
        decoder.projection.bias = bias

    spec = specs.TransformerSpec(encoder, decoder)
    spec.config.layer_norm_epsilon = float(config.layer_norm_eps)
    spec.config.unk_token = target_vocabulary[UNK_ID]
    spec.config.bos_token = target_vocabulary[BOS_ID]
    spec.config.eos_token = target_vocabulary[EOS_ID]
    spec.config.decoder_start_token = target_vocabulary[BOS_ID]
    spec.config.add_source_bos = False
    spec.config.add_source_eos = True  # aiayn's sources end with EOS (collate_pairs)
    spec.register_source_vocabulary(source_vocabulary)
    spec.register_target_vocabulary(target_vocabulary)
    spec.validate()
    return spec


# -- export ---------------------------------------------------------------------------------


def file_key(path: Path) -> dict[str, Any]:
    """What identifies a checkpoint file's version: size, modification time, SHA-256."""
    stat = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest.hexdigest()}


def _temporary_dir(beside: Path) -> Path:
    """A new empty directory ``.NAME.RANDOM.tmp`` beside ``beside`` (same filesystem, so that
    a rename publishes it)."""
    for _ in range(100):
        tmp = beside.with_name(f".{beside.name}.{secrets.token_hex(4)}.tmp")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temporary directory name beside {beside}")  # pragma: no cover


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move the finished directory ``tmp`` to ``out_dir``, replacing what is there."""
    old = None
    if out_dir.exists() or out_dir.is_symlink():
        old = out_dir.with_name(f".{out_dir.name}.{secrets.token_hex(4)}.old")
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _readme_tokenizer(tokenizer: Tokenizer) -> tuple[str, str, str]:
    """The README's lines on the tokenizer files, its code that reads them and cuts
    ``lines`` into ``sources``, and the name of what joins target pieces into text."""
    if not isinstance(tokenizer, PieceVocabTokenizer):
        files = (
            f"- `{SENTENCEPIECE_NAME}`: the sentencepiece model that cuts text into the "
            "vocabulary's pieces and joins them again;"
        )
        code = f"""sp = spm.SentencePieceProcessor(model_file="{SENTENCEPIECE_NAME}")
sources = [sp.encode(line, out_type=str) for line in lines]"""
        return files, code, "sp"
    files = f"""- `{SOURCE_SPM_NAME}`: the sentencepiece model that cuts source text into pieces, \
`{TARGET_SPM_NAME}` the one
  that joins target pieces into text (a piece missing from a vocabulary is `<unk>`);
- `{TOKENIZER_NAME}`: both, with the vocabularies, as aiayn reads them;"""
    codes = any(p.startswith(">>") and p.endswith("<<") for p in tokenizer.source_vocab)
    cut = (
        """


def pieces(line):  # a leading language code such as >>fra<< is one piece
    code, _, rest = line.partition("<<") if line.startswith(">>") else ("", "", line)
    return ([code + "<<"] if code else []) + source.encode(rest, out_type=str)


sources = [pieces(line) for line in lines]"""
        if codes
        else """
sources = [source.encode(line, out_type=str) for line in lines]"""
    )
    code = f"""source = spm.SentencePieceProcessor(model_file="{SOURCE_SPM_NAME}")
target = spm.SentencePieceProcessor(model_file="{TARGET_SPM_NAME}"){cut}"""
    return files, code, "target"


def _readme(
    model: Transformer, config: RunConfig, tokenizer: Tokenizer, checkpoint: Path | None, quant: str
) -> str:
    m = config.model
    decode = config.decode
    source = f"`{checkpoint.name}`" if checkpoint is not None else "an aiayn model"
    norm = "pre-norm" if m.pre_norm else "post-norm"
    shared = "shared" if m.share_embeddings else "separate"
    origin = (
        "imported from Marian by `aiayn import-marian`"
        if isinstance(tokenizer, PieceVocabTokenizer)
        else "trained with aiayn"
    )
    files, tokenize, detokenizer = _readme_tokenizer(tokenizer)
    limit = f"{decode.max_len_a:g} * max(map(len, sources)) + {decode.max_len_b}"
    bos = (
        ""
        if m.bos_output
        else f"""
`<s>` starts the decoder (it stands for the Marian model's decoder-start token) and is
never an output: its logit bias in `model.bin` is {NO_OUTPUT_BIAS:g}, which takes it out of the
softmax (the other tokens' probabilities are renormalised without it, as aiayn decodes this
model) in `translate_batch` and `score_batch` alike, so nothing has to be passed for it.
"""
    )
    return f"""# CTranslate2 model exported from {source}

A Transformer translation model {origin}, exported by
`aiayn export-ct2`: {len(model.encoder.layers)}+{len(model.decoder.layers)} layers, \
d_model {m.d_model}, d_ff {m.d_ff}, {m.n_heads} heads, {norm},
{shared} source and target embeddings, weights in {quant}. The files:

- `model.bin`, `config.json`, the vocabulary files: the model, read by `ctranslate2.Translator`;
{files}
- `{METADATA_NAME}`: what was exported (the checkpoint's size, time and SHA-256, the run's
  config); `aiayn translate --engine ctranslate2` reads it.

## Translate

```python
import ctranslate2
import sentencepiece as spm

lines = ["A man rides a bicycle down the street."]
{tokenize}
translator = ctranslate2.Translator(".", device="cpu")  # this directory
results = translator.translate_batch(
    sources,
    beam_size={decode.beam_size},
    # aiayn's output limit ({decode.max_len_a:g} x source tokens + {decode.max_len_b}), within \
the model's {m.max_positions} positions
    max_decoding_length=min(int({limit}), {m.max_positions}),
    min_decoding_length=0,  # an empty translation is allowed, as in aiayn
    suppress_sequences=[["<pad>"], ["<s>"]],  # never output, as in aiayn
)
print([{detokenizer}.decode(result.hypotheses[0]) for result in results])
```

`config.json` appends `</s>` to every source (`add_source_eos`), as aiayn does: do not add it.
{bos}
CTranslate2 divides beam scores by `length ** length_penalty` (1 by default), where aiayn
divides by GNMT's `((5 + length) / 6) ** alpha` (α = {decode.alpha:g} for this run):
`aiayn translate CHECKPOINT --engine ctranslate2` decodes this model with aiayn's length
penalty, output limit and batching.
"""


@dataclass(frozen=True)
class _Source:
    model: Transformer
    config: RunConfig
    tokenizer: Tokenizer
    path: Path | None


def _source(
    model_or_checkpoint: str | os.PathLike[str] | LoadedModel | Transformer,
    tokenizer: Tokenizer | None,
) -> _Source:
    if isinstance(model_or_checkpoint, Transformer):
        if tokenizer is None:
            raise ValueError("exporting a Transformer object needs its tokenizer")
        config = RunConfig(model=model_or_checkpoint.config)
        return _Source(model_or_checkpoint, config, tokenizer, None)
    if isinstance(model_or_checkpoint, nn.Module):  # another model object: an RNN, say
        raise UserError(
            f"a {type(model_or_checkpoint).__name__} object does not export to CTranslate2: "
            "only a translation Transformer does"
        )
    loaded = (
        model_or_checkpoint
        if isinstance(model_or_checkpoint, LoadedModel)
        else load_model(Path(model_or_checkpoint))
    )
    task = loaded.config.model.task
    if loaded.config.model.arch != "transformer":
        raise UserError(
            f"{loaded.path} holds an RNN model (model.arch={loaded.config.model.arch}); only "
            "Transformers export to CTranslate2"
        )
    if task != "translation" or not isinstance(loaded.model, Transformer):
        raise UserError(
            f"{loaded.path} holds a model for the {task} task (model.task); only translation "
            "models export to CTranslate2"
        )
    return _Source(loaded.model, loaded.config, tokenizer or loaded.tokenizer, loaded.path)


def _exportable_source(
    model_or_checkpoint: str | os.PathLike[str] | LoadedModel | Transformer,
    tokenizer: Tokenizer | None,
) -> _Source:
    """:func:`_source`, refused (a UserError) where CTranslate2 cannot hold the model."""
    source = _source(model_or_checkpoint, tokenizer)
    _check_exportable(source.model)
    return source


def export_ct2(
    model_or_checkpoint: str | os.PathLike[str] | LoadedModel | Transformer,
    out_dir: str | os.PathLike[str],
    quantization: str | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    force: bool = False,
) -> Path:
    """Write a CTranslate2 model directory ``out_dir`` for a translation model: a checkpoint
    file or run directory (read with :func:`aiayn.inference.loading.load_model`), a
    :class:`LoadedModel`, or a :class:`Transformer` with its ``tokenizer``. ``quantization``
    is a weight type of :data:`QUANTIZATIONS` (None: float32). An existing non-empty
    ``out_dir`` is replaced only with ``force``. The directory is built beside ``out_dir``
    and renamed into place, so a reader never sees half of it. Returns ``out_dir``."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise UserError(
            f"unknown quantization {quantization!r} (one of {', '.join(QUANTIZATIONS)})"
        )
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(
            f"{out} exists and is not empty (--force, or force=True from Python, replaces it)"
        )
    source = _exportable_source(model_or_checkpoint, tokenizer)  # refused before the import
    ct2 = import_ctranslate2()
    key = file_key(source.path) if source.path is not None else None
    source_vocabulary, target_vocabulary = vocabularies(source.tokenizer)
    spec = transformer_spec(source.model, source_vocabulary, target_vocabulary)
    spec.optimize(quantization=quantization)
    weights = quantization or "float32"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temporary_dir(out)
    except OSError as err:
        raise UserError(f"cannot write {out}: {err.strerror or err}") from None
    try:
        spec.save(str(tmp))
        files = tokenizer_files(source.tokenizer)
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        own = source.tokenizer.to_bytes()
        tokenizer_name = next((n for n, d in files.items() if d == own), TOKENIZER_NAME)
        if tokenizer_name not in files:
            (tmp / tokenizer_name).write_bytes(own)
        (tmp / "README.md").write_text(
            _readme(source.model, source.config, source.tokenizer, source.path, weights),
            encoding="utf-8",
        )
        metadata = {
            "format": EXPORT_FORMAT,
            "format_version": EXPORT_VERSION,
            "checkpoint": None if key is None else {"path": str(source.path), **key},
            "quantization": weights,
            "tokenizer": tokenizer_name,
            "config": source.config.to_dict(),
            "aiayn": __version__,
            "ctranslate2": ct2.__version__,
        }
        (tmp / METADATA_NAME).write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
        _publish(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write {out}: {err.strerror or err}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# -- the exported directory, read back --------------------------------------------------------


@dataclass(frozen=True)
class Export:
    """An exported directory as aiayn reads it back: the run's config, its tokenizer and
    what was exported (``metadata``, the contents of ``aiayn.json``)."""

    path: Path
    config: RunConfig
    tokenizer: Tokenizer
    metadata: dict[str, Any]


def read_metadata(path: Path) -> dict[str, Any]:
    """``aiayn.json`` of an export directory; UserError if it is missing or not one."""
    try:
        metadata = json.loads((path / METADATA_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} is no aiayn export (no {METADATA_NAME})") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{path / METADATA_NAME} is unreadable: {err}") from None
    if not isinstance(metadata, dict) or metadata.get("format") != EXPORT_FORMAT:
        raise UserError(f"{path / METADATA_NAME} does not describe an aiayn export")
    if metadata.get("format_version") != EXPORT_VERSION:
        raise UserError(
            f"{path} is an aiayn export of format version {metadata.get('format_version')!r}; "
            f"this aiayn reads version {EXPORT_VERSION}"
        )
    return metadata


def read_export(path: str | os.PathLike[str]) -> Export:
    """The config, tokenizer and metadata of an export directory."""
    path = Path(path)
    metadata = read_metadata(path)
    try:
        config = config_from_dict(metadata["config"], stored=True)
        tokenizer = Tokenizer.from_bytes((path / str(metadata["tokenizer"])).read_bytes())
    except (KeyError, OSError, ValueError, RuntimeError, ConfigError) as err:
        raise UserError(f"{path}: the aiayn export is incomplete or damaged: {err}") from None
    return Export(path, config, tokenizer, metadata)


# -- the cache beside a checkpoint ---------------------------------------------------------------


def cache_dir(checkpoint: Path, quantization: str | None) -> Path:
    """Where the export of ``checkpoint`` with ``quantization`` is cached: beside it,
    ``NAME.ct2-float32`` for ``NAME.pt``."""
    return checkpoint.with_name(f"{checkpoint.stem}.ct2-{quantization or 'float32'}")


def _is_current(export: Path, checkpoint: Path, quantization: str) -> bool:
    """Whether ``export`` holds ``checkpoint`` as it is now (same size and modification time,
    or else the same SHA-256) with ``quantization``."""
    try:
        metadata = read_metadata(export)
    except UserError:
        return False
    key = metadata.get("checkpoint") or {}
    if metadata.get("quantization") != quantization or not (export / "model.bin").is_file():
        return False
    try:
        stat = checkpoint.stat()
    except OSError:
        return False
    if key.get("size") != stat.st_size:
        return False
    if key.get("mtime_ns") == stat.st_mtime_ns:
        return True
    current = file_key(checkpoint)
    if current["sha256"] != key.get("sha256"):
        return False
    # The same bytes, touched or copied: remember the new time (best effort).
    metadata["checkpoint"] = {**key, "mtime_ns": current["mtime_ns"]}
    try:
        tmp = export / f".{METADATA_NAME}.{secrets.token_hex(4)}.tmp"
        tmp.write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, export / METADATA_NAME)
    except OSError:
        pass
    return True


def cached_export(
    checkpoint: str | os.PathLike[str],
    quantization: str | None = None,
    *,
    log: Callable[[str], None] | None = None,
    scratch: Callable[[], Path] | None = None,
) -> Path:
    """The CTranslate2 export of a checkpoint file, made once and kept beside it
    (:func:`cache_dir`): reused while the checkpoint keeps its size and modification time
    (or its SHA-256), rebuilt when it changed. ``log`` hears when an export is made. Where
    nothing can be written beside the checkpoint, the export goes into the directory that
    ``scratch`` returns (and a UserError says so without one)."""
    path = Path(checkpoint)
    weights = quantization or "float32"
    target = cache_dir(path, quantization)
    if _is_current(target, path, weights):
        return target
    # Loaded (mapped) once, and a model that does not export refused before "exporting".
    loaded = load_model(path)
    _exportable_source(loaded, None)
    if log is not None:
        log(f"exporting {path} to CTranslate2 ({weights}) into {target}")
    try:
        return export_ct2(loaded, target, quantization, force=True)
    except UserError as err:
        if not str(err).startswith(f"cannot write {target}") or scratch is None:
            raise
        other = scratch() / target.name
        if log is not None:
            log(f"{err}; exporting into {other} for this run instead")
        return export_ct2(loaded, other, quantization, force=True)
