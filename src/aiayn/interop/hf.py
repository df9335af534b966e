"""Export of aiayn translation models as Hugging Face ``MarianMTModel`` directories.

The directory loads with ``MarianMTModel.from_pretrained`` and ``MarianTokenizer.from_pretrained``
and computes what the aiayn model computes (docs/interop.md, "Export to Hugging Face"). It is
the inverse of :mod:`aiayn.interop.marian`; the differences between the two models are mapped
so that the outputs are equal:

- **Ids.** aiayn numbers its special pieces PAD 0, UNK 1, BOS 2, EOS 3; the export puts
  ``</s>`` at 0, ``<unk>`` at 1, ``<s>`` at 2, the other pieces after them in aiayn's order and
  ``<pad>`` last (:func:`hf_order`), as Marian's vocabularies are laid out, so that
  CTranslate2's converter (which drops a trailing ``<pad>``) reads it too. ``vocab.json`` maps
  the sentencepiece pieces to these ids: ``MarianTokenizer`` cuts text with the same
  sentencepiece model and gives the same tokens, EOS appended, as aiayn's collate does.
- **The first decoder input.** aiayn's decoder starts from BOS; Marian's starts from a token
  whose embedding is zero (CTranslate2 converts Marian models to start from a zero vector).
  The export starts the decoder from ``<s>`` (``decoder_start_token_id``) with a zero input
  row, and adds BOS's scaled embedding to row 0 of the decoder's position table, the one
  position that always holds the start token: the first input is the same vector. BOS's
  output row stays in ``lm_head`` (untied from the input embeddings, which now differ at BOS).
- **Positions.** Both position tables are written out as weights (transformers loads them):
  the model's own, whatever its layout (the paper's interleaved sinusoids, Marian's halves or
  a learned table). ``save_pretrained`` leaves Marian's tables out (its
  ``_keys_to_ignore_on_save``): a re-saved copy would fall back to Marian's sinusoids.
- **LayerNorm ε.** transformers' Marian layers use ε = 1e-5; aiayn's default is 1e-6. With
  every input of every LayerNorm multiplied by c = √(1e-5 / ε), LN(c·z; 1e-5) = LN(z; ε)
  exactly, so the export carries the residual stream scaled by c: embeddings and position
  tables ×c, LayerNorm gains and biases ×c, the attention and feed-forward output
  projections ×c, the matrices that read the stream (queries, keys, values, the first
  feed-forward layer, ``lm_head``) ÷c. For ε = 1e-5 (a model imported from Marian) c = 1
  and every weight is copied as it is.
- **Never output.** PAD and BOS are never output (``bad_words_ids`` of the generation config,
  applied after the log-softmax, as aiayn does); a model with ``model.bos_output = false``
  gets a logit bias of :data:`~aiayn.interop.ct2.NO_OUTPUT_BIAS` at BOS, which takes it out
  of the softmax as aiayn's decoding does.
- **Output limit.** ``forced_eos_token_id`` ends a hypothesis with EOS at ``max_length``, as
  aiayn forces EOS after its output limit.

Refused, in one line each: RNN baselines and the other task families, pre-norm layers (Marian's
are post-norm), attention patterns other than full attention, and d_k · h or d_v · h other than
d_model. Writing is atomic (built beside ``DIR`` and renamed into place) as
:func:`aiayn.interop.ct2.export_ct2`'s is.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor, nn

from aiayn import __version__
from aiayn.config import RunConfig, config_to_toml
from aiayn.data.collate import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from aiayn.data.tokenizer import PieceVocabTokenizer, Tokenizer
from aiayn.errors import UserError
from aiayn.inference.loading import LoadedModel, load_model
from aiayn.interop.ct2 import (
    NO_OUTPUT_BIAS,
    _publish,
    _temporary_dir,
    check_unique_pieces,
    file_key,
    vocabularies,
)
from aiayn.model.transformer import Transformer

# transformers' Marian layers: nn.LayerNorm(d_model), whose ε is PyTorch's default.
MARIAN_LAYER_NORM_EPS = 1e-5
# The ids of the exported vocabularies: EOS, UNK and BOS first, PAD last (hf_order).
HF_EOS, HF_UNK, HF_BOS = 0, 1, 2
METADATA_NAME = "aiayn-export.json"


def hf_order(size: int) -> list[int]:
    """aiayn's ids in the export's order: the export's id ``j`` is aiayn's id
    ``hf_order(size)[j]``: EOS, UNK, BOS, then 4 .. size-1, then PAD."""
    if size < 5:
        raise UserError(f"a vocabulary of {size} pieces: the export needs at least 5")
    return [EOS_ID, UNK_ID, BOS_ID, *range(4, size), PAD_ID]


def hf_ids(size: int) -> list[int]:
    """The inverse of :func:`hf_order`: ``hf_ids(size)[i]`` is the export's id of aiayn's id
    ``i``."""
    ids = [0] * size
    for j, i in enumerate(hf_order(size)):
        ids[i] = j
    return ids


def stream_scale(layer_norm_eps: float) -> float:
    """c = √(1e-5 / ε): the factor of the exported residual stream (module docstring)."""
    return math.sqrt(MARIAN_LAYER_NORM_EPS / layer_norm_eps)


# -- what exports ----------------------------------------------------------------------------


def check_exportable(model: Transformer) -> None:
    """A :class:`UserError` in one line where a Marian model cannot compute what ``model``
    does."""
    config = model.config
    if config.pre_norm:
        raise UserError(
            "model.pre_norm = true: Marian's layers are post-norm (LayerNorm after the residual "
            "add), so a pre-norm model does not export to Hugging Face"
        )
    for name in ("encoder_attention", "decoder_attention", "cross_attention"):
        pattern = getattr(config, name)
        if pattern != "full":
            raise UserError(
                f"model.{name} = {pattern!r}: Marian has full attention only, so the model "
                "does not export to Hugging Face"
            )
    heads = config.n_heads
    if config.head_dim_k * heads != config.d_model or config.head_dim_v * heads != config.d_model:
        raise UserError(
            f"d_k = {config.head_dim_k}, d_v = {config.head_dim_v} with {heads} heads: Marian's "
            f"heads split d_model = {config.d_model} evenly, so the model does not export"
        )


# vocab.json maps each piece to one id: a piece listed twice would lose the other.
_HF_DUPLICATE = "vocab.json maps a piece to one id, so the model does not export"


@dataclass(frozen=True)
class _Source:
    model: Transformer
    config: RunConfig
    tokenizer: Tokenizer
    path: Path | None
    # Whether the run's config is known (a checkpoint's, or given with a model object).
    recorded: bool = True


def _source(
    model_or_checkpoint: str | os.PathLike[str] | LoadedModel | Transformer,
    tokenizer: Tokenizer | None,
    config: RunConfig | None,
) -> _Source:
    if isinstance(model_or_checkpoint, Transformer):
        if tokenizer is None:
            raise ValueError("exporting a Transformer object needs its tokenizer")
        run = config if config is not None else RunConfig(model=model_or_checkpoint.config)
        return _Source(model_or_checkpoint, run, tokenizer, None, recorded=config is not None)
    if isinstance(model_or_checkpoint, nn.Module):
        raise UserError(
            f"a {type(model_or_checkpoint).__name__} object does not export to Hugging Face: "
            "only a translation Transformer does"
        )
    loaded = (
        model_or_checkpoint
        if isinstance(model_or_checkpoint, LoadedModel)
        else load_model(Path(model_or_checkpoint))
    )
    model_config = loaded.config.model
    if model_config.arch != "transformer":
        raise UserError(
            f"{loaded.path} holds an RNN model (model.arch={model_config.arch}); only "
            "Transformers export to Hugging Face"
        )
    if model_config.task != "translation" or not isinstance(loaded.model, Transformer):
        raise UserError(
            f"{loaded.path} holds a model for the {model_config.task} task (model.task); only "
            "translation models export to Hugging Face"
        )
    return _Source(loaded.model, loaded.config, tokenizer or loaded.tokenizer, loaded.path)


# -- the weights -------------------------------------------------------------------------------


def _f64(tensor: Tensor | None, size: int | None = None) -> Tensor:
    if tensor is None:
        assert size is not None
        return torch.zeros(size, dtype=torch.float64)
    return tensor.detach().to("cpu", torch.float64)


def _table(model: Transformer, side: str) -> Tensor:
    """The position table the model adds on ``side`` ("src" or "tgt"), in float32."""
    embed = model.src_embed if side == "src" else model.tgt_embed
    positions = embed.positions
    if positions.learned is not None:
        return positions.learned.detach().to("cpu", torch.float32)
    return positions.get_buffer("table").detach().to("cpu", torch.float32)


def marian_state(model: Transformer) -> dict[str, Tensor]:
    """The weights of the ``MarianMTModel`` that computes what ``model`` does, by
    transformers' names (float32; the module docstring says how they map)."""
    check_exportable(model)
    config = model.config
    c = stream_scale(config.layer_norm_eps)
    d = config.d_model
    src_rows = torch.tensor(hf_order(config.vocab_size))
    tgt_rows = torch.tensor(hf_order(config.target_vocab_size))
    state: dict[str, Tensor] = {}

    def put(name: str, value: Tensor) -> None:
        state[name] = value.to(torch.float32).contiguous()

    def linear_in(name: str, layer: nn.Linear, parts: Sequence[str]) -> None:
        """A projection that reads the stream: its weight ÷c, split into ``parts``."""
        size = layer.weight.size(0) // len(parts)
        weights = _f64(layer.weight).split(size)
        biases = _f64(layer.bias, layer.weight.size(0)).split(size)
        for part, weight, bias in zip(parts, weights, biases, strict=True):
            put(f"{name}.{part}.weight", weight / c)
            put(f"{name}.{part}.bias", bias)

    def linear_out(name: str, layer: nn.Linear) -> None:
        """A projection that writes the stream: weight and bias ×c."""
        put(f"{name}.weight", _f64(layer.weight) * c)
        put(f"{name}.bias", _f64(layer.bias, d) * c)

    def norm(name: str, layer: nn.LayerNorm | None) -> None:
        assert layer is not None and layer.weight is not None and layer.bias is not None
        put(f"{name}.weight", _f64(layer.weight) * c)
        put(f"{name}.bias", _f64(layer.bias) * c)

    # Embeddings ×c; the decoder's start row (BOS) is zero and its embedding goes to row 0 of
    # the decoder's position table, computed as aiayn's Embeddings computes it (float32).
    tgt_token = model.tgt_embed.token.weight.detach().to("cpu", torch.float32)
    tgt_table = _table(model, "tgt")
    first = (tgt_token[BOS_ID] * model.tgt_embed.scale + tgt_table[0]).double()
    decoder_positions = tgt_table.double() * c
    decoder_positions[0] = first * c
    put("model.decoder.embed_positions.weight", decoder_positions)
    put("model.encoder.embed_positions.weight", _table(model, "src").double() * c)
    tgt_embed = _f64(tgt_token)[tgt_rows] * c
    tgt_embed[HF_BOS] = 0.0
    if config.share_embeddings:
        for name in ("model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens"):
            put(f"{name}.weight", tgt_embed)
    else:
        put("model.encoder.embed_tokens.weight", _f64(model.src_embed.token.weight)[src_rows] * c)
        put("model.decoder.embed_tokens.weight", tgt_embed)
    put("lm_head.weight", _f64(model.out_proj.weight)[tgt_rows] / c)
    bias = _f64(model.out_proj.bias, config.target_vocab_size)[tgt_rows]
    if not config.bos_output:  # out of the softmax, as aiayn decodes such a model
        bias[HF_BOS] = NO_OUTPUT_BIAS
    put("final_logits_bias", bias[None, :])

    for i, layer in enumerate(model.encoder.layers):
        name = f"model.encoder.layers.{i}"
        linear_in(f"{name}.self_attn", layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj"))
        linear_out(f"{name}.self_attn.out_proj", layer.self_attn.out_proj)
        norm(f"{name}.self_attn_layer_norm", layer.self_attn_norm)
        linear_in(name, layer.ffn.w1, ("fc1",))
        linear_out(f"{name}.fc2", layer.ffn.w2)
        norm(f"{name}.final_layer_norm", layer.ffn_norm)
    for i, dec in enumerate(model.decoder.layers):
        name = f"model.decoder.layers.{i}"
        linear_in(f"{name}.self_attn", dec.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj"))
        linear_out(f"{name}.self_attn.out_proj", dec.self_attn.out_proj)
        norm(f"{name}.self_attn_layer_norm", dec.self_attn_norm)
        cross = dec.cross_attn
        assert cross is not None  # the encoder-decoder's layers all attend to the memory
        linear_in(f"{name}.encoder_attn", cross.q_proj, ("q_proj",))
        linear_in(f"{name}.encoder_attn", cross.kv_proj, ("k_proj", "v_proj"))
        linear_out(f"{name}.encoder_attn.out_proj", cross.out_proj)
        norm(f"{name}.encoder_attn_layer_norm", dec.cross_attn_norm)
        linear_in(name, dec.ffn.w1, ("fc1",))
        linear_out(f"{name}.fc2", dec.ffn.w2)
        norm(f"{name}.final_layer_norm", dec.ffn_norm)
    return state


# -- the configuration files ------------------------------------------------------------------


def marian_config(config: RunConfig) -> dict[str, Any]:
    """``config.json``: transformers' MarianConfig of the exported model."""
    m = config.model
    pad = m.target_vocab_size - 1
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": m.vocab_size,
        "decoder_vocab_size": m.target_vocab_size,
        "share_encoder_decoder_embeddings": m.share_embeddings,
        "tie_word_embeddings": False,  # lm_head keeps BOS's output row, the input row is zero
        "d_model": m.d_model,
        "encoder_layers": m.n_layers,
        "decoder_layers": m.n_layers,
        "encoder_attention_heads": m.n_heads,
        "decoder_attention_heads": m.n_heads,
        "encoder_ffn_dim": m.d_ff,
        "decoder_ffn_dim": m.d_ff,
        "activation_function": m.activation,
        "dropout": m.dropout,
        "attention_dropout": m.attention_dropout,
        "activation_dropout": m.relu_dropout,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "max_position_embeddings": m.max_positions,
        "scale_embedding": True,
        "init_std": 0.02,
        "is_encoder_decoder": True,
        "use_cache": True,
        "pad_token_id": pad,
        "eos_token_id": HF_EOS,
        "forced_eos_token_id": HF_EOS,
        "decoder_start_token_id": HF_BOS,
        "dtype": "float32",
    }


def generation_config(config: RunConfig) -> dict[str, Any]:
    """``generation_config.json``: the run's beam size; PAD and BOS never output; EOS forced
    at the most positions the model has, as aiayn's output limit is capped there."""
    m = config.model
    pad = m.target_vocab_size - 1
    return {
        "decoder_start_token_id": HF_BOS,
        "eos_token_id": HF_EOS,
        "forced_eos_token_id": HF_EOS,
        "pad_token_id": pad,
        "bad_words_ids": [[pad], [HF_BOS]],
        "num_beams": config.decode.beam_size,
        # transformers divides a finished beam's log-probability by length ** length_penalty,
        # aiayn by GNMT's ((5 + length) / 6) ** alpha: the nearest setting, not the same rule.
        "length_penalty": config.decode.alpha,
        "early_stopping": False,
        # Start token, at most max_positions - 1 output tokens, EOS (aiayn's cap).
        "max_length": m.max_positions + 1,
    }


def _tokenizer_files(
    tokenizer: Tokenizer, config: RunConfig, languages: tuple[str | None, str | None]
) -> dict[str, bytes]:
    """vocab.json (target_vocab.json for a separate target side), source.spm, target.spm and
    tokenizer_config.json."""
    source, target = vocabularies(tokenizer)
    check_unique_pieces(source, "source", _HF_DUPLICATE)
    check_unique_pieces(target, "target", _HF_DUPLICATE)
    separate = not config.model.share_embeddings
    files: dict[str, bytes] = {}

    def vocab(pieces: list[str]) -> bytes:
        ids = {pieces[i]: j for j, i in enumerate(hf_order(len(pieces)))}
        return (json.dumps(ids, ensure_ascii=False, indent=1) + "\n").encode("utf-8")

    files["vocab.json"] = vocab(source)
    if separate:
        files["target_vocab.json"] = vocab(target)
    if isinstance(tokenizer, PieceVocabTokenizer):
        files["source.spm"], files["target.spm"] = tokenizer.source_spm, tokenizer.target_spm
    else:
        files["source.spm"] = files["target.spm"] = tokenizer.to_bytes()
    settings: dict[str, Any] = {
        "tokenizer_class": "MarianTokenizer",
        "source_lang": languages[0],
        "target_lang": languages[1],
        "separate_vocabs": separate,
        # <s> starts the decoder: a special token, so that skip_special_tokens drops it
        # (MarianTokenizer appends only </s> to its inputs).
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": config.model.max_positions,
        "sp_model_kwargs": {},
    }
    files["tokenizer_config.json"] = (json.dumps(settings, indent=2) + "\n").encode("utf-8")
    return files


def languages(facts: RunFacts) -> tuple[str | None, str | None]:
    """The source and target languages of the run's data manifest, where it names them."""
    src, tgt = facts.manifest.get("src"), facts.manifest.get("tgt")
    return (src if isinstance(src, str) else None, tgt if isinstance(tgt, str) else None)


# -- the run, for the model card ---------------------------------------------------------------


def run_directory(checkpoint: Path | None) -> Path | None:
    """The run directory a checkpoint belongs to (where ``metrics.jsonl`` is), if any."""
    if checkpoint is None:
        return None
    for candidate in (checkpoint, checkpoint.parent, checkpoint.parent.parent):
        if candidate.is_dir() and (candidate / "metrics.jsonl").is_file():
            return candidate
    return None


@dataclass(frozen=True)
class RunFacts:
    """What the run directory says of the training: the data manifest, the last records of
    ``metrics.jsonl`` by kind, and ``run.json``."""

    manifest: dict[str, Any]
    last: dict[str, dict[str, Any]]
    info: dict[str, Any]


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_run(run: Path | None) -> RunFacts:
    """:class:`RunFacts` of ``run`` (empty where a file is missing or unreadable)."""
    if run is None:
        return RunFacts({}, {}, {})
    info = _read_json_object(run / "run.json")
    data = info.get("data")
    manifest = _read_json_object(Path(data) / "manifest.json") if isinstance(data, str) else {}
    last: dict[str, dict[str, Any]] = {}
    try:
        lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("kind"), str):
            last[record["kind"]] = record
    return RunFacts(manifest, last, info)


# -- evaluation --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evaluation:
    """sacreBLEU's BLEU and chrF of the model's translations of ``source`` (aiayn's engine,
    the run's decode settings) against ``reference``, each line with its signature."""

    source: str
    reference: str
    lines: int
    bleu: str
    chrf: str
    bleu_score: float
    chrf_score: float


def evaluate(checkpoint: Path, pairs: Sequence[tuple[Path, Path]]) -> list[Evaluation]:
    """Translate each source file with the checkpoint (as ``aiayn translate`` does) and score
    it against its reference."""
    from aiayn.evaluation.bleu import sacrebleu_bleu, sacrebleu_chrf
    from aiayn.inference.textio import read_lines
    from aiayn.inference.translator import Translator

    translator, _ = Translator.from_checkpoint(checkpoint)
    results = []
    for source, reference in pairs:
        sources, references = read_lines(str(source)), read_lines(str(reference))
        if len(sources) != len(references):
            raise UserError(
                f"{source} has {len(sources):,} lines but {reference} has {len(references):,}"
            )
        hypotheses = translator.translate(sources)
        bleu = sacrebleu_bleu(hypotheses, [references])
        chrf = sacrebleu_chrf(hypotheses, [references])
        results.append(
            Evaluation(
                str(source),
                str(reference),
                len(sources),
                bleu.line,
                chrf.line,
                bleu.score,
                chrf.score,
            )
        )
    return results


# -- the model card ----------------------------------------------------------------------------


def _minutes(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "not recorded"
    return f"{value:.1f} minutes" if value < 120 else f"{value / 60:.1f} hours"


def model_card(source: _Source, facts: RunFacts, evaluations: Sequence[Evaluation]) -> str:
    """The model card (``README.md``): the data, the recipe and its configuration, the
    training time and host, the scores, how to use it and its limits."""
    config = source.config
    m, decode = config.model, config.decode
    src, tgt = languages(facts)
    manifest = facts.manifest
    pair = f"{src}→{tgt}" if src and tgt else "translation"
    name = source.path.name if source.path is not None else "an aiayn model"
    run = run_directory(source.path)
    imported = isinstance(source.tokenizer, PieceVocabTokenizer)

    front = ["---", "library_name: transformers", "pipeline_tag: translation"]
    if src and tgt:
        front += ["language:", f"- {src}", f"- {tgt}"]
    front += ["tags:", "- translation", "- marian", "- aiayn", "---", ""]

    parts = [
        "\n".join(front),
        f"# {pair}: a Transformer trained with aiayn\n",
        (
            f"A Transformer translation model ({pair}) "
            + (
                "imported from Marian by `aiayn import-marian`"
                if imported
                else "trained with aiayn"
            )
            + f", exported from `{name}` by `aiayn export-hf` (aiayn {__version__}) as a "
            "Hugging Face `MarianMTModel` with its `MarianTokenizer`: "
            f"{m.n_layers}+{m.n_layers} layers, d_model {m.d_model}, d_ff {m.d_ff}, {m.n_heads} "
            f"heads, {m.activation}, post-norm, "
            + ("shared" if m.share_embeddings else "separate")
            + f" embeddings, {m.vocab_size:,} pieces"
            + (
                f" ({m.target_vocab_size:,} on the target side)"
                if m.target_vocab_size != m.vocab_size
                else ""
            )
            + f", {m.max_positions} positions. It computes what the aiayn model computes: "
            "transformers' greedy search gives the same tokens as `aiayn translate` with "
            "beam size 1.\n"
        ),
    ]

    parts.append("## Data\n")
    splits = manifest.get("splits")
    if isinstance(splits, dict) and splits:
        rows = ["| split | sentence pairs | source file | target file |", "|---|---:|---|---|"]
        for split, record in splits.items():
            if not isinstance(record, dict):
                continue
            inputs = record.get("inputs") or {}
            files = [Path(str(inputs.get(lang, "?"))).name for lang in (src, tgt)]
            pairs = record.get("pairs")
            count = f"{pairs:,}" if isinstance(pairs, int) else "?"
            rows.append(f"| {split} | {count} | {files[0]} | {files[1]} |")
        options = manifest.get("tokenizer_options") or {}
        kind = options.get("model_type", "") if isinstance(options, dict) else ""
        parts.append(
            "\n".join(rows) + f"\n\nThe text was cut into pieces by a joint sentencepiece "
            f"{kind} model of {m.vocab_size:,} pieces (`source.spm` = `target.spm`), trained "
            "on the training text (`aiayn prepare`).\n"
        )
    elif imported:
        parts.append("The model was imported from Marian; its data is that model's.\n")
    else:
        parts.append("The run directory holds no data manifest: the data is not recorded here.\n")

    parts.append("## Training\n")
    train = facts.last.get("train", {})
    averaged = facts.last.get("averaged", {})
    valid = facts.last.get("valid", {})
    host = facts.info.get("host")
    lines = [
        f"- recipe: preset `{config.preset}`, the configuration below"
        if source.recorded
        else "- recipe: not recorded (exported from a model object without its run's config)",
        f"- updates: {train.get('step', 'not recorded')}, epochs: "
        f"{train['epoch'] + 1 if isinstance(train.get('epoch'), int) else 'not recorded'}, "
        f"target tokens seen: "
        + (f"{train['tokens']:,}" if isinstance(train.get("tokens"), int) else "not recorded"),
        f"- training time: {_minutes(train.get('minutes'))}",
        f"- host: {host if isinstance(host, str) else 'not recorded by the run'}"
        + (f", {facts.info['world_size']} process" if facts.info.get("world_size") == 1 else "")
        + (
            f", {facts.info['world_size']} processes"
            if isinstance(facts.info.get("world_size"), int) and facts.info["world_size"] > 1
            else ""
        ),
    ]
    if "ppl" in valid:
        lines.append(f"- last validation perplexity: {valid['ppl']:.2f} (update {valid['step']})")
    if "ppl" in averaged:
        lines.append(f"- validation perplexity of the averaged checkpoint: {averaged['ppl']:.2f}")
    if "bleu" in valid:
        lines.append(f"- last validation BLEU (greedy, during training): {valid['bleu']:.2f}")
    if run is None:
        lines.append("- the checkpoint is not in a run directory: no training record")
    parts.append("\n".join(lines) + "\n")
    summary = (
        "The run's configuration, as the checkpoint stores it"
        if source.recorded
        else "The model's configuration (the other sections: defaults, not the run's)"
    )
    parts.append(
        f"<details><summary>{summary}</summary>"
        "\n\n```toml\n" + config_to_toml(config).rstrip() + "\n```\n\n</details>\n"
    )

    parts.append("## Scores\n")
    if evaluations:
        for ev in evaluations:
            parts.append(
                f"`{Path(ev.source).name}` → `{Path(ev.reference).name}`, {ev.lines:,} lines, "
                f"translated by aiayn with beam size {decode.beam_size}, α = {decode.alpha:g} "
                f"({decode.beam_rule} rule):\n\n```\n{ev.bleu}\n{ev.chrf}\n```\n"
            )
    else:
        parts.append("No test scores were given to the export (`aiayn export-hf --evaluate`).\n")

    pad = m.target_vocab_size - 1
    parts.append(
        f"""## Use

```python
from transformers import MarianMTModel, MarianTokenizer

tokenizer = MarianTokenizer.from_pretrained("DIR")  # this directory, or its hub name
model = MarianMTModel.from_pretrained("DIR").eval()
batch = tokenizer(["A man rides a bicycle down the street."], return_tensors="pt", padding=True)
greedy = model.generate(**batch, num_beams=1)  # the tokens `aiayn translate --beam 1` gives
beam = model.generate(**batch)  # generation_config.json: beam {decode.beam_size}
print(tokenizer.batch_decode(greedy, skip_special_tokens=True))
```

`generation_config.json` never outputs `<pad>` ({pad}) or `<s>` ({HF_BOS}) and forces `</s>` at
`max_length`. aiayn's output limit is `{decode.max_len_a:g} × source tokens + \
{decode.max_len_b}`; give it as `max_new_tokens` (plus one for `</s>`) where it matters.
CTranslate2 converts the directory as any Marian model
(`ct2-transformers-converter --model DIR --output_dir DIR-ct2`; the source tokens end with
`</s>`); its vocabulary then lacks `<pad>`, so its probabilities are renormalised without it.

## How it maps

- Vocabulary: `</s>` 0, `<unk>` 1, `<s>` 2, the other pieces in aiayn's order, `<pad>` last
  ({pad}), as Marian lays its vocabularies out; `vocab.json` maps the sentencepiece pieces to
  these ids.
- The decoder starts from `<s>`, whose input row is zero; row 0 of the decoder's position
  table holds its embedding (CTranslate2's converter starts Marian models from a zero vector,
  and reads this directory alike). `lm_head` keeps `<s>`'s output row: it is untied.
- Both position tables are weights of `model.safetensors`: the model's own
  ({m.positional}{", " + m.positional_layout if m.positional == "sinusoidal" else ""}).
- transformers' Marian LayerNorms use ε = 1e-5, the model {m.layer_norm_eps:g}: the residual
  stream is stored scaled by √(1e-5 / ε) = {stream_scale(m.layer_norm_eps):.6g}, which gives
  the same normalised values.
{"- `<s>` is no output of this model: its logit bias is -10000." if not m.bos_output else ""}
## Limits

- Trained on the data above only: text unlike it (other domains, long sentences, other
  languages) is translated worse; it has {m.max_positions} positions.
- `save_pretrained` leaves Marian's position tables out, so a re-saved copy loses the tables
  this model needs: copy the files, or re-export with aiayn.
- transformers' beam search is not aiayn's: it divides by `length ** length_penalty` (here
  {decode.alpha:g}) where aiayn divides by GNMT's `((5 + length) / 6) ** α`, lets only the
  best `num_beams` candidates finish, and scores a forced `</s>` as free; with α = 0,
  `length_penalty=0, early_stopping=True, forced_eos_token_id=None` it searches as aiayn's
  `fairseq` rule. Greedy search gives the same tokens.
- `<unk>` is skipped by `skip_special_tokens=True`, where aiayn writes sentencepiece's ` ⁇ `.
"""
    )
    return "\n".join(parts)


# -- export ------------------------------------------------------------------------------------


def export_hf(
    model_or_checkpoint: str | os.PathLike[str] | LoadedModel | Transformer,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | None = None,
    config: RunConfig | None = None,
    force: bool = False,
    evaluate_on: Sequence[tuple[str | os.PathLike[str], str | os.PathLike[str]]] = (),
) -> Path:
    """Write a Hugging Face ``MarianMTModel`` directory ``out_dir`` for a translation model:
    a checkpoint file or run directory, a :class:`LoadedModel`, or a :class:`Transformer`
    with its ``tokenizer`` (and run ``config`` for the card). ``evaluate_on``: (source,
    reference) files whose BLEU and chrF go into the model card (a checkpoint only). An
    existing non-empty ``out_dir`` is replaced only with ``force``; the directory is built
    beside it and renamed into place. Returns ``out_dir``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(
            f"{out} exists and is not empty (--force, or force=True from Python, replaces it)"
        )
    source = _source(model_or_checkpoint, tokenizer, config)
    check_exportable(source.model)
    state = marian_state(source.model)
    facts = read_run(run_directory(source.path))
    files = _tokenizer_files(source.tokenizer, source.config, languages(facts))
    pairs = [(Path(s), Path(r)) for s, r in evaluate_on]
    if pairs and source.path is None:
        raise ValueError("evaluate_on needs a checkpoint (a path or a LoadedModel)")
    evaluations = evaluate(source.path, pairs) if pairs and source.path is not None else []
    card = model_card(source, facts, evaluations)
    metadata = {
        "format": "aiayn-hf-export",
        "aiayn": __version__,
        "checkpoint": None
        if source.path is None
        else {"path": str(source.path), **file_key(source.path)},
        "hf_order": "</s> <unk> <s>, aiayn's ids 4.. in order, <pad> last",
        "stream_scale": stream_scale(source.config.model.layer_norm_eps),
        "evaluations": [ev.__dict__ for ev in evaluations],
    }
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temporary_dir(out)
    except OSError as err:
        raise UserError(f"cannot write {out}: {err.strerror or err}") from None
    try:
        safetensors.torch.save_file(
            state, str(tmp / "model.safetensors"), metadata={"format": "pt"}
        )
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        for name, value in (
            ("config.json", marian_config(source.config)),
            ("generation_config.json", generation_config(source.config)),
            (METADATA_NAME, metadata),
        ):
            (tmp / name).write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(card, encoding="utf-8")
        _publish(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write {out}: {err.strerror or err}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
