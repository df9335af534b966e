"""Import of Hugging Face ``MarianMTModel`` directories (OPUS-MT and other Marian models).

A Marian model is the paper's post-norm encoder-decoder with a few differences, each an
explicit option of :class:`~aiayn.config.ModelConfig` (docs/interop.md): the sinusoid table in
halves (``positional_layout``), Swish or GELU in the FFN (``activation``), a bias on the output
projection (``final_logits_bias``), LayerNorm ε 1e-5, and separate source and target
vocabularies in some models (``tgt_vocab_size``, ``share_embeddings = false``).

Ids: aiayn's special ids are fixed (PAD 0, UNK 1, BOS 2, EOS 3); Marian's vocabularies hold
``</s>`` at 0, ``<unk>`` at 1 and ``<pad>`` last, and the decoder starts from ``<pad>``. The
import renumbers each vocabulary: the four special ids first, then Marian's other pieces in
their order. aiayn's BOS row is a copy of Marian's decoder-start row (its padding token), and
``bos_output = false`` keeps BOS out of the output distribution when decoding, so that the
imported model computes the same logits and log-probabilities as the original.

A directory written by ``aiayn export-hf`` (:mod:`aiayn.interop.hf`) reads back as well: its
decoder starts from a token of its own, ``<s>``, which becomes BOS (an output like any other
there), and its weights hold position tables that are not Marian's sinusoids, which become
learned tables (transformers computes with them too).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aiayn.config import ModelConfig, RunConfig, config_from_dict
from aiayn.data.collate import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from aiayn.data.tokenizer import SPECIAL_PIECES, PieceVocabTokenizer
from aiayn.errors import UserError
from aiayn.model.embedding import sinusoid_table
from aiayn.model.transformer import Transformer
from aiayn.training.checkpoint import bytes_to_tensor, model_checkpoint, model_state, save_atomic

# Hugging Face's activation names → model.activation.
_ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}


@dataclass
class MarianVocab:
    """One side's vocabulary: ``pieces`` in aiayn's order and ``rows[i]``, the Marian id whose
    embedding row aiayn's id ``i`` takes."""

    pieces: list[str]
    rows: list[int]


def renumber(marian: dict[str, int], pad: int, unk: int, eos: int, start: int) -> MarianVocab:
    """aiayn's order of a Marian vocabulary (piece → Marian id): PAD, UNK, BOS (Marian's
    decoder-start token ``start``), EOS, then every other piece in Marian's order."""
    by_id = sorted(marian.items(), key=lambda item: item[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise UserError("vocabulary ids are not 0 .. N-1 without gaps")
    specials = {PAD_ID: pad, UNK_ID: unk, BOS_ID: start, EOS_ID: eos}
    pieces = [SPECIAL_PIECES[i] for i in sorted(specials)]
    rows = [specials[i] for i in sorted(specials)]
    for piece, i in by_id:
        if i not in (pad, unk, eos, start):  # start: pad, or a token of its own (export-hf's)
            pieces.append(piece)
            rows.append(i)
    return MarianVocab(pieces, rows)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(
            f"{path}: not found; is this a Hugging Face Marian model directory?"
        ) from None
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: not readable JSON ({err})") from None


def _read_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (``config.json``)."""
    data = _read_json(path)
    if not isinstance(data, dict):
        raise UserError(f"{path}: holds a JSON {_json_kind(data)}, not an object")
    return data


def _read_vocab(path: Path) -> dict[str, int]:
    """A Marian ``vocab.json``: an object of piece → integer id."""
    data = _read_object(path)
    for piece, i in data.items():
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise UserError(
                f"{path}: the id of {piece!r} is {i!r}, not an integer of 0 or more; "
                "is the file whole?"
            )
    return data


def _json_kind(data: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number"}.get(
        type(data), "null" if data is None else type(data).__name__
    )


# The config.json keys the import reads without a default: positive integers.
_REQUIRED = (
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
)


def _check_config(hf: dict[str, Any], path: Path) -> None:
    """The keys the import needs are there and hold positive integers (token ids: 0 or
    more), so that a config.json cut short is named, not a KeyError."""
    missing = [key for key in _REQUIRED if key not in hf]
    if missing:
        raise UserError(f"{path}: lacks {', '.join(missing)}; is the file whole?")
    ids = ("pad_token_id", "eos_token_id", "decoder_start_token_id")
    for key in (*_REQUIRED, "max_position_embeddings", *ids):
        value = hf.get(key)
        if value is None and key not in _REQUIRED:
            continue
        least = 0 if key in ids else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            kind = "an integer of 0 or more" if least == 0 else "a positive integer"
            raise UserError(f"{path}: {key} is {value!r}, not {kind}")


def _read_weights(directory: Path) -> dict[str, Tensor]:
    """``model.safetensors`` or ``pytorch_model.bin`` (read without executing code)."""
    safetensors_file = directory / "model.safetensors"
    if safetensors_file.is_file():
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise UserError(
                f"{safetensors_file}: reading it needs safetensors: pip install 'aiayn[interop]'"
            ) from None
        try:
            return dict(load_file(str(safetensors_file)))
        except Exception as err:  # SafetensorError and the like: one line
            raise UserError(
                f"{safetensors_file}: not a readable weights file ({err}); an interrupted "
                "download leaves it cut short: download it again"
            ) from None
    bin_file = directory / "pytorch_model.bin"
    if bin_file.is_file():
        try:
            return dict(torch.load(bin_file, map_location="cpu", weights_only=True))
        except Exception as err:  # any unpickling failure: one line
            raise UserError(f"{bin_file}: not a readable weights file ({err})") from None
    raise UserError(f"{directory}: has neither model.safetensors nor pytorch_model.bin")


class _Weights:
    """The Marian state dict with or without the ``model.`` prefix; names what is missing."""

    def __init__(self, state: dict[str, Tensor], directory: Path) -> None:
        self.state = state
        self.directory = directory

    def has(self, name: str) -> bool:
        return name in self.state or f"model.{name}" in self.state

    def __getitem__(self, name: str) -> Tensor:
        for key in (f"model.{name}", name):
            if key in self.state:
                return self.state[key].float()
        raise UserError(f"{self.directory}: the weights lack {name}")


def _config(
    hf: dict[str, Any],
    src: MarianVocab,
    tgt: MarianVocab,
    shared: bool,
    learned: bool = False,
    bos_output: bool = False,
) -> ModelConfig:
    pairs = [
        ("encoder_layers", "decoder_layers"),
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ]
    for enc, dec in pairs:
        if hf.get(enc) != hf.get(dec):
            raise UserError(f"{enc}={hf.get(enc)} but {dec}={hf.get(dec)}: aiayn's stacks match")
    if not hf.get("scale_embedding", False):
        raise UserError("scale_embedding is false: aiayn scales embeddings by sqrt(d_model)")
    if hf.get("normalize_before", False) or hf.get("normalize_embedding", False):
        raise UserError("normalize_before / normalize_embedding: not a Marian layout aiayn has")
    activation = _ACTIVATIONS.get(str(hf.get("activation_function", "swish")))
    if activation is None:
        raise UserError(f"activation_function {hf.get('activation_function')!r} is not supported")
    tied = bool(hf.get("tie_word_embeddings", True))
    return ModelConfig(
        vocab_size=len(src.pieces),
        tgt_vocab_size=None if shared else len(tgt.pieces),
        d_model=int(hf["d_model"]),
        d_ff=int(hf["encoder_ffn_dim"]),
        n_heads=int(hf["encoder_attention_heads"]),
        n_layers=int(hf["encoder_layers"]),
        dropout=float(hf.get("dropout", 0.1)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        relu_dropout=float(hf.get("activation_dropout", 0.0)),
        attention_bias=True,
        positional="learned" if learned else "sinusoidal",
        positional_layout="halves",
        max_positions=int(hf.get("max_position_embeddings", 512)),
        share_embeddings=shared,
        tie_output=None if shared and tied else tied,
        pre_norm=False,
        layer_norm_eps=1e-5,
        activation=activation,  # type: ignore[arg-type]
        final_logits_bias=True,
        bos_output=bos_output,
    )


def _layer_state(w: _Weights, prefix: str, ours: str, cross: bool) -> dict[str, Tensor]:
    """One layer's weights in aiayn's names (self-attention Q, K, V fused into one matrix)."""
    out: dict[str, Tensor] = {}
    for part in ("weight", "bias"):
        qkv = [w[f"{prefix}.self_attn.{p}_proj.{part}"] for p in ("q", "k", "v")]
        out[f"{ours}.self_attn.qkv_proj.{part}"] = torch.cat(qkv)
        out[f"{ours}.self_attn.out_proj.{part}"] = w[f"{prefix}.self_attn.out_proj.{part}"]
        out[f"{ours}.self_attn_norm.{part}"] = w[f"{prefix}.self_attn_layer_norm.{part}"]
        out[f"{ours}.ffn.w1.{part}"] = w[f"{prefix}.fc1.{part}"]
        out[f"{ours}.ffn.w2.{part}"] = w[f"{prefix}.fc2.{part}"]
        out[f"{ours}.ffn_norm.{part}"] = w[f"{prefix}.final_layer_norm.{part}"]
        if cross:
            out[f"{ours}.cross_attn.q_proj.{part}"] = w[f"{prefix}.encoder_attn.q_proj.{part}"]
            kv = [w[f"{prefix}.encoder_attn.{p}_proj.{part}"] for p in ("k", "v")]
            out[f"{ours}.cross_attn.kv_proj.{part}"] = torch.cat(kv)
            out[f"{ours}.cross_attn.out_proj.{part}"] = w[f"{prefix}.encoder_attn.out_proj.{part}"]
            out[f"{ours}.cross_attn_norm.{part}"] = w[f"{prefix}.encoder_attn_layer_norm.{part}"]
    return out


def import_marian(directory: str | Path) -> tuple[Transformer, RunConfig, PieceVocabTokenizer]:
    """The aiayn model (eval mode), run config and tokenizer of a Marian model directory:
    ``config.json``, ``model.safetensors`` or ``pytorch_model.bin``, ``source.spm``,
    ``target.spm``, ``vocab.json`` (and ``target_vocab.json`` for separate vocabularies)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory}: not a directory (a Hugging Face Marian model directory)")
    hf = _read_object(directory / "config.json")
    if hf.get("model_type") not in (None, "marian"):  # before any other file is looked for
        raise UserError(
            f"{directory / 'config.json'}: model_type is {hf.get('model_type')!r}; only Marian "
            "models are imported"
        )
    _check_config(hf, directory / "config.json")
    shared = bool(hf.get("share_encoder_decoder_embeddings", True))
    src_ids = _read_vocab(directory / "vocab.json")
    tgt_file = directory / ("vocab.json" if shared else "target_vocab.json")
    tgt_ids = src_ids if shared else _read_vocab(tgt_file)
    if "<pad>" not in tgt_ids and "pad_token_id" not in hf:
        raise UserError(f"{tgt_file} has no <pad> and {directory / 'config.json'} no pad_token_id")
    # Each side's special pieces by name (the config's ids are the target side's).
    pad = int(tgt_ids.get("<pad>", hf["pad_token_id"]))
    eos = int(tgt_ids.get("</s>", hf.get("eos_token_id", 0)))
    start = int(hf.get("decoder_start_token_id", pad))
    try:
        tgt = renumber(tgt_ids, pad, int(tgt_ids.get("<unk>", 1)), eos, start)
    except UserError as err:
        raise UserError(f"{tgt_file}: {err}") from None
    src_pad = int(src_ids.get("<pad>", pad))
    # A decoder that starts from a token of its own (an `aiayn export-hf` directory: <s>) has
    # BOS on the source side too; Marian's start from <pad>.
    src_start = int(src_ids.get("<s>", src_pad)) if start != pad else src_pad
    try:
        src = renumber(
            src_ids,
            src_pad,
            int(src_ids.get("<unk>", 1)),
            int(src_ids.get("</s>", eos)),
            src_start,
        )
    except UserError as err:
        raise UserError(f"{directory / 'vocab.json'}: {err}") from None
    w = _Weights(_read_weights(directory), directory)
    tables = _position_tables(w, hf)
    # A decoder that starts from a token of its own outputs it like any other (BOS, which
    # aiayn never outputs but whose probability its softmax includes); Marian's <pad> is none.
    config = _config(hf, src, tgt, shared, learned=tables is not None, bos_output=start != pad)
    try:
        model = _model(w, config, src, tgt, shared, tables)
    except (IndexError, RuntimeError) as err:  # a row past the end, a shape that differs
        first = str(err).strip().splitlines()[0]
        raise UserError(
            f"{directory}: the weights do not fit config.json and the vocabularies ({first})"
        ) from None
    tokenizer = PieceVocabTokenizer(
        _read_spm(directory / "source.spm"),
        _read_spm(directory / "target.spm"),
        src.pieces,
        tgt.pieces,
    )
    run = config_from_dict({"preset": "marian", "decode": {"beam_size": hf.get("num_beams") or 4}})
    return model, dataclasses.replace(run, model=config), tokenizer


def _position_tables(w: _Weights, hf: dict[str, Any]) -> tuple[Tensor, Tensor] | None:
    """The encoder's and decoder's position tables where the weights hold tables that are not
    Marian's sinusoids (transformers loads them: an `aiayn export-hf` directory's), else None
    (the model then computes the sinusoids, as transformers does without them)."""
    names = ("encoder.embed_positions.weight", "decoder.embed_positions.weight")
    if not all(w.has(name) for name in names):
        return None
    tables = (w[names[0]], w[names[1]])
    shape = (int(hf.get("max_position_embeddings", 512)), int(hf["d_model"]))
    if any(tuple(table.shape) != shape for table in tables):
        raise UserError(
            f"{w.directory}: position tables of shape {tuple(tables[0].shape)} and "
            f"{tuple(tables[1].shape)}, not {shape} (max_position_embeddings, d_model)"
        )
    sinusoids = sinusoid_table(shape[0], shape[1], "halves")
    if all(torch.allclose(table, sinusoids, rtol=0, atol=1e-6) for table in tables):
        return None
    return tables


def _model(
    w: _Weights,
    config: ModelConfig,
    src: MarianVocab,
    tgt: MarianVocab,
    shared: bool,
    tables: tuple[Tensor, Tensor] | None = None,
) -> Transformer:
    """The aiayn model (eval mode) of Marian's weights, renamed and renumbered."""
    state: dict[str, Tensor] = {}
    if tables is not None:  # learned positions: the tables as they are
        state["src_embed.positions.learned"], state["tgt_embed.positions.learned"] = tables
    src_rows, tgt_rows = torch.tensor(src.rows), torch.tensor(tgt.rows)
    if shared:
        state["src_embed.token.weight"] = w["shared.weight"][src_rows]
    else:
        state["src_embed.token.weight"] = w["encoder.embed_tokens.weight"][src_rows]
        state["tgt_embed.token.weight"] = w["decoder.embed_tokens.weight"][tgt_rows]
    if not config.tied_output:
        state["out_proj.weight"] = w["lm_head.weight"][tgt_rows]
    bias = w["final_logits_bias"].reshape(-1) if w.has("final_logits_bias") else None
    state["out_proj.bias"] = bias[tgt_rows] if bias is not None else torch.zeros(len(tgt.pieces))
    for i in range(config.n_layers):
        state |= _layer_state(w, f"encoder.layers.{i}", f"encoder.layers.{i}", cross=False)
        state |= _layer_state(w, f"decoder.layers.{i}", f"decoder.layers.{i}", cross=True)

    model = Transformer(config)
    tied = {"tgt_embed.token.weight": "src_embed.token.weight"} if shared else {}
    if config.tied_output:
        tied["out_proj.weight"] = "tgt_embed.token.weight"
    for name, source in tied.items():  # one Parameter under each of its names
        state[name] = state[source]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(
            f"{w.directory}: weights do not fit (missing {missing}, extra {unexpected})"
        )
    return model.eval()


def _read_spm(path: Path) -> bytes:
    """A sentencepiece model's bytes, checked by loading them (a file cut short is named)."""
    import sentencepiece as spm

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: not found (the sentencepiece model of a Marian model)") from None
    try:
        spm.SentencePieceProcessor().LoadFromSerializedProto(data)
    except RuntimeError:
        raise UserError(f"{path}: not a sentencepiece model; is the file whole?") from None
    return data


def write_checkpoint(
    model: Transformer, config: RunConfig, tokenizer: PieceVocabTokenizer, out: str | Path
) -> Path:
    """An aiayn model checkpoint (as ``averaged.pt``) of an imported model."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = model_checkpoint(
        config, model_state(model), bytes_to_tensor(tokenizer.to_bytes()), step=0, epoch=0
    )
    save_atomic(checkpoint, out, in_run=False)
    return out
