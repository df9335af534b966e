"""Typed, frozen configuration: one TOML file plus dotted ``key=value`` overrides.

A run is described by a :class:`RunConfig` made of four sections (``model``, ``data``,
``train``, ``decode``). Defaults are the paper's (Vaswani et al., 2017); presets in
:mod:`aiayn.presets` are plain dictionaries of overrides on top of them.

Unknown keys are an error that lists the valid ones. No registries, no strings that resolve
to code: every field is plain data, so a config round-trips through a dict (and through a
checkpoint) without pickling; :func:`config_to_toml` writes it back as TOML.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from aiayn.errors import ConfigError
from aiayn.presets import preset_overrides
from aiayn.recipes import recipe_names, resolve_recipe

CONFIG_FORMAT_VERSION = 1


def _require(section: object, prefix: str, rules: Mapping[str, tuple[Any, str]]) -> None:
    """Raise ConfigError for the first field whose rule fails: ``rules`` maps a field name to
    (predicate, what it must be)."""
    for name, (ok, requirement) in rules.items():
        value = getattr(section, name)
        if value is not None and not ok(value):
            raise ConfigError(f"{prefix}.{name} must be {requirement}, got {value!r}")


def _positive(value: float) -> bool:
    return value > 0


def _non_negative(value: float) -> bool:
    return value >= 0


def _finite_non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def _probability(value: float) -> bool:  # [0, 1)
    return 0.0 <= value < 1.0


_POSITIVE = (_positive, "positive")
_NON_NEGATIVE = (_non_negative, "0 or more")
_PROBABILITY = (_probability, "in [0, 1)")
_FINITE_NON_NEGATIVE = (_finite_non_negative, "a number of 0 or more")
# The largest length penalty alpha: ((5 + |Y|) / 6) ** alpha stays within float32's range for
# every output length a model has positions for, so that scores stay apart (beyond about 40,
# scores of long outputs round to 0 and tie; far beyond, the penalty overflows).
MAX_ALPHA = 10.0


def alpha_in_range(alpha: float) -> bool:
    """Whether ``alpha`` is a length penalty decoding takes: a number from 0 to MAX_ALPHA."""
    return math.isfinite(alpha) and 0 <= alpha <= MAX_ALPHA


_ALPHA = (alpha_in_range, f"a number from 0 to {MAX_ALPHA:g}")


# The attention of a stack's self-attention: aiayn.model.patterns.PATTERNS.
AttentionName = Literal["full", "local", "longformer", "bigbird", "linformer", "lsh"]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, named with the paper's symbols."""

    vocab_size: int = 37000
    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8
    # d_k (queries/keys) and d_v (values) per head; None means d_model / n_heads (§3.2.2).
    d_k: int | None = None
    d_v: int | None = None
    n_layers: int = 6
    # Residual dropout P_drop: each sub-layer output before the residual add, and the
    # embedding + positional-encoding sums (§5.4).
    dropout: float = 0.1
    # Not in the paper; options, off by default.
    attention_dropout: float = 0.0
    relu_dropout: float = 0.0
    # Biases on the attention projections W^Q, W^K, W^V, W^O (see MultiHeadAttention).
    attention_bias: bool = True
    # "sinusoidal" (§3.5) or "learned" (Table 3 row E).
    positional: Literal["sinusoidal", "learned"] = "sinusoidal"
    max_positions: int = 1024
    # One matrix for source embedding, target embedding and pre-softmax projection (§3.4).
    share_embeddings: bool = True
    # Post-norm LayerNorm(x + Dropout(Sublayer(x))) is the paper's (§3.1); pre-norm is an option.
    pre_norm: bool = False
    layer_norm_eps: float = 1e-6
    # Options that express models trained elsewhere (docs/interop.md), each with the paper's
    # behaviour as default: the FFN's activation; the sinusoid table's layout (the paper's
    # interleaved sin/cos, or Marian's and tensor2tensor's sin half then cos half); a bias on the
    # pre-softmax projection; a target vocabulary of its own size (separate embeddings); the
    # projection tied to the target embedding (None: when share_embeddings); and whether BOS
    # takes part in the output distribution when decoding (Marian has no BOS: its decoder
    # starts from its padding token, whose embedding an imported model's BOS row holds).
    activation: Literal["relu", "gelu", "swish"] = "relu"
    positional_layout: Literal["interleaved", "halves"] = "interleaved"
    final_logits_bias: bool = False
    tgt_vocab_size: int | None = None
    tie_output: bool | None = None
    bos_output: bool = True
    # The attention pattern of the encoder's and the decoder's self-attention (docs/
    # long-sequences.md): the paper's "full", or a pattern for long sequences: "local" (a
    # window of attention_window positions on each side; causal: before), "longformer" (the
    # window and the first attention_global positions as global tokens), "bigbird" (blocks of
    # attention_block positions: neighbour, global and attention_random_blocks random blocks),
    # "linformer" (keys and values projected along the sequence to linformer_k learned rows;
    # not causal, so not for the decoder), "lsh" (Reformer's shared-QK attention within hash
    # buckets: lsh_buckets buckets, lsh_rounds hash rounds, chunks of lsh_chunk positions; no
    # incremental decoding). cross_attention: the decoder's attention over the encoder output,
    # "full" or "linformer" (the memory projected to linformer_k rows).
    encoder_attention: AttentionName = "full"
    decoder_attention: AttentionName = "full"
    cross_attention: Literal["full", "linformer"] = "full"
    attention_window: int = 128
    attention_global: int = 1
    attention_block: int = 64
    attention_random_blocks: int = 3
    linformer_k: int = 256
    # About the sequence length / lsh_chunk, so that a bucket fills a chunk or two.
    lsh_buckets: int = 32
    lsh_rounds: int = 2
    lsh_chunk: int = 64
    # lsh scores are q·k with unit-length keys, Reformer's (trax's, Hugging Face's); true also
    # divides them by √d_k, as aiayn did before it followed the reference. A checkpoint saved
    # before this key existed reads it as true: its scores are scaled as in its training.
    lsh_dk_scale: bool = False
    # What the model is for (docs/families.md): the paper's encoder-decoder ("translation"), a
    # decoder-only language model ("lm"), or the encoder alone with a masked-language-model
    # head ("mlm") or a classification head ("classify").
    task: Literal["translation", "lm", "mlm", "classify"] = "translation"
    # classify: the number of classes (from the data unless set) and how the encoder output is
    # pooled: the first position's (BOS, BERT's [CLS]) or the mean over the text.
    n_classes: int = 2
    pooling: Literal["first", "mean"] = "first"
    # The network of the translation task (docs/rnn.md): the paper's "transformer", or one
    # of the attention-RNN baselines it replaced: "bahdanau" (RNNsearch, Bahdanau et al.,
    # 2015) or "luong" (global attention, Luong et al., 2015). They read d_model (embedding
    # size), n_layers, dropout, the vocabulary, sharing and tying options, and these: the
    # recurrent state size (None: d_model), the Luong score, and Luong's input feeding.
    arch: Literal["transformer", "bahdanau", "luong"] = "transformer"
    rnn_hidden: int | None = None
    luong_score: Literal["dot", "general", "concat"] = "general"
    input_feeding: bool = True

    @property
    def target_vocab_size(self) -> int:
        return self.tgt_vocab_size if self.tgt_vocab_size is not None else self.vocab_size

    @property
    def tied_output(self) -> bool:
        return self.tie_output if self.tie_output is not None else self.share_embeddings

    @property
    def head_dim_k(self) -> int:
        return self.d_k if self.d_k is not None else self.d_model // self.n_heads

    @property
    def head_dim_v(self) -> int:
        return self.d_v if self.d_v is not None else self.d_model // self.n_heads

    def validate(self) -> None:
        positive = (
            *("vocab_size", "d_model", "d_ff", "n_heads", "d_k", "d_v", "n_layers", "n_classes"),
            *("tgt_vocab_size", "attention_window", "attention_block"),
            *("linformer_k", "lsh_buckets", "lsh_rounds", "lsh_chunk"),
        )
        probabilities = ("dropout", "attention_dropout", "relu_dropout")
        rules = {name: _POSITIVE for name in (*positive, "max_positions", "layer_norm_eps")}
        rules |= {name: _NON_NEGATIVE for name in ("attention_global", "attention_random_blocks")}
        _require(self, "model", rules | {name: _PROBABILITY for name in probabilities})
        if self.share_embeddings and self.target_vocab_size != self.vocab_size:
            raise ConfigError(
                f"model.tgt_vocab_size={self.tgt_vocab_size} differs from model.vocab_size="
                f"{self.vocab_size}: set model.share_embeddings = false (separate embeddings)"
            )
        if self.lsh_buckets % 2:
            raise ConfigError(f"model.lsh_buckets must be even, got {self.lsh_buckets}")
        if self.decoder_attention == "linformer":
            raise ConfigError(
                'model.decoder_attention = "linformer" is refused: Linformer\'s projection mixes '
                "future positions into every key, so it cannot run causally"
            )
        if self.task != "translation":
            extra = (("final_logits_bias", False), ("cross_attention", "full"))
            for name, default in (("tgt_vocab_size", None), *extra):
                if getattr(self, name) != default:
                    raise ConfigError(f"model.{name} is an option of the translation task")
        if self.arch != "transformer":
            _require(self, "model", {"rnn_hidden": _POSITIVE})
            if self.task != "translation":
                raise ConfigError(f"model.arch={self.arch} is a model of the translation task")
            patterns = ("encoder_attention", "decoder_attention", "cross_attention")
            if set_ := [f"model.{name}" for name in patterns if getattr(self, name) != "full"]:
                raise ConfigError(
                    f"{', '.join(set_)}: attention patterns are options of the Transformer, "
                    f"not of model.arch={self.arch}"
                )
        elif self.d_k is None or self.d_v is None:
            if self.d_model % self.n_heads != 0:
                raise ConfigError(
                    f"model.d_model={self.d_model} is not divisible by model.n_heads="
                    f"{self.n_heads}; set model.d_k and model.d_v explicitly"
                )


@dataclass(frozen=True)
class DataConfig:
    """How training pairs are read and batched."""

    # Padded tokens per side of one batch (per device).
    max_tokens: int = 4096
    # Pairs with more tokens than this on either side are dropped (and counted).
    max_len: int = 256
    # Pairs whose length ratio (longer / shorter) exceeds this are dropped (and counted).
    max_len_ratio: float = 3.0
    # lm and mlm: 0 = one example per line (document or sentence); N > 0 = examples of N tokens,
    # contiguous windows over the text ("blocks") or whole lines packed up to N ("documents").
    block_size: int = 0
    pack: Literal["blocks", "documents"] = "blocks"
    # mlm: the share of tokens chosen for prediction (of which 80% become <mask>, 10% a random
    # token, 10% stay), as BERT.
    mask_prob: float = 0.15
    # translation: BPE-dropout (Provilkov et al., 2020) on the training pairs, each merge skipped
    # with this probability, drawn anew for every batch; 0 = off (the paper's one segmentation).
    bpe_dropout: float = 0.0

    def validate(self) -> None:
        _require(
            self,
            "data",
            {
                "max_tokens": _POSITIVE,
                "bpe_dropout": _PROBABILITY,
                "max_len": _POSITIVE,
                "block_size": _NON_NEGATIVE,
                "mask_prob": (lambda p: 0.0 < p < 1.0, "in (0, 1)"),
            },
        )


@dataclass(frozen=True)
class TrainConfig:
    """The paper's training recipe (§5) and the run's bookkeeping."""

    seed: int = 1
    # Adam (§5.3).
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    # Eq. 3: lr = lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5).
    warmup_steps: int = 4000
    lr_scale: float = 1.0
    # "inverse_sqrt": Eq. 3 throughout. "linear": Eq. 3's warmup and peak, then a straight
    # line to zero at max_steps (which must then be set, above warmup_steps). "linear_time":
    # Eq. 3's warmup and peak, then a straight line to zero as the training clock reaches
    # max_minutes (which must then be set), however many updates the host makes by then
    # (docs/training.md, "Learning-rate schedule").
    lr_schedule: Literal["inverse_sqrt", "linear", "linear_time"] = "inverse_sqrt"
    weight_decay: float = 0.0
    # Label smoothing epsilon_ls (§5.4).
    label_smoothing: float = 0.1
    # Target tokens one optimizer update should see, summed over devices and accumulation
    # steps (§5.1: about 25,000 source and 25,000 target tokens).
    update_tokens: int = 25000
    clip_norm: float = 0.0
    max_steps: int = 100000
    max_epochs: int = 0
    max_minutes: float = 0.0
    # "auto": bf16 where the device multiplies bfloat16 natively (a CPU with AVX512-BF16 or AMX,
    # a GPU with bf16), else fp32; the run says which it took.
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    compile: bool = False
    # At the end of `aiayn train` on the CPU: compile the run's decoder step for `translate`
    # and `serve` on this machine (aiayn.accel.compiled; a Transformer with full attention, a
    # C++ compiler; three libraries, built once: docs/translation.md). They use it from then
    # on.
    compile_step: bool = True
    # Keep only each layer's input in the forward pass and recompute the layer in the
    # backward pass: less memory for long sequences and big models, more time
    # (docs/long-sequences.md measures both).
    activation_checkpointing: bool = False
    log_interval: int = 100
    valid_interval: int = 1000
    valid_bleu: bool = True
    save_interval_steps: int = 1000
    # §6.1: checkpoints written at 10-minute intervals.
    save_interval_minutes: float = 10.0
    keep_last: int = 5
    # Checkpoints averaged at the end of training (§6.1: 5 for base, 20 for big); 0 = none.
    average_last: int = 5
    # Instead of average_last: average every checkpoint saved at or after this fraction of
    # the schedule's progress (of max_minutes for "linear_time", of max_steps for "linear");
    # those checkpoints are kept whatever keep_last. 0 = off (docs/training.md, "Checkpoint
    # averaging").
    average_from: float = 0.0
    patience: int = 0
    max_bad_steps: int = 10
    # A checkpoint the run starts from, or none: a model of the run's task goes on training
    # (fine-tuning; the [model] section is then the checkpoint's, docs/interop.md), a classifier
    # takes the embedding and encoder of an mlm model (docs/families.md). The run's data must
    # use that checkpoint's tokenizer (aiayn prepare --tokenizer).
    init_from: str | None = None

    def validate(self) -> None:
        _require(
            self,
            "train",
            {
                "adam_beta1": _PROBABILITY,
                "adam_beta2": _PROBABILITY,
                "adam_eps": _POSITIVE,
                "warmup_steps": _POSITIVE,
                "lr_scale": _NON_NEGATIVE,
                "weight_decay": _NON_NEGATIVE,
                "label_smoothing": _PROBABILITY,
                "average_from": _PROBABILITY,
                "update_tokens": _POSITIVE,
                **{
                    name: _NON_NEGATIVE
                    for name in (
                        "clip_norm",
                        "max_steps",
                        "max_epochs",
                        "max_minutes",
                        "valid_interval",
                        "save_interval_steps",
                        "save_interval_minutes",
                        "keep_last",
                        "average_last",
                        "patience",
                        "log_interval",
                        "max_bad_steps",
                    )
                },
            },
        )
        if self.lr_schedule == "linear" and self.max_steps <= self.warmup_steps:
            raise ConfigError(
                'train.lr_schedule = "linear" decays to zero at train.max_steps: set '
                f"train.max_steps above train.warmup_steps={self.warmup_steps}, got "
                f"{self.max_steps}"
            )
        if self.lr_schedule == "linear_time" and not 0 < self.max_minutes < math.inf:
            raise ConfigError(
                'train.lr_schedule = "linear_time" decays to zero at train.max_minutes: set '
                f"train.max_minutes to a number of minutes above 0, got {self.max_minutes:g}"
            )
        if self.average_from > 0 and self.lr_schedule == "inverse_sqrt":
            raise ConfigError(
                f"train.average_from={self.average_from:g} counts the progress of a schedule "
                'that ends: set train.lr_schedule = "linear_time" or "linear", or '
                "train.average_from = 0 (train.average_last then chooses)"
            )
        if self.patience > 0 and self.valid_interval == 0:
            raise ConfigError(
                f"train.patience={self.patience} counts validations, and train.valid_interval=0 "
                "runs none: set train.valid_interval, or train.patience=0"
            )


@dataclass(frozen=True)
class DecodeConfig:
    """Inference settings (§6.1)."""

    beam_size: int = 4
    alpha: float = 0.6
    # When a sentence's beam search stops (aiayn.inference.search): "paper" (tensor2tensor's
    # rule, the paper's code) or "fairseq" (stop once beam_size hypotheses have finished).
    beam_rule: Literal["paper", "fairseq"] = "paper"
    # Maximum output length = max_len_a * source_length + max_len_b (paper: input + 50).
    max_len_a: float = 1.0
    max_len_b: int = 50
    batch_tokens: int = 4096

    def validate(self) -> None:
        rules = {
            "beam_size": _POSITIVE,
            "alpha": _ALPHA,
            "max_len_a": _NON_NEGATIVE,
            "max_len_b": _NON_NEGATIVE,
            "batch_tokens": _POSITIVE,
        }
        _require(self, "decode", rules)
        if self.max_len_a == 0 and self.max_len_b == 0:
            raise ConfigError(
                "decode.max_len_a and decode.max_len_b are both 0: every output would be empty"
            )


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, in four sections."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    preset: str = "base"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self)
        out["format_version"] = CONFIG_FORMAT_VERSION
        return out


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "decode": DecodeConfig,
}

T = TypeVar("T")


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check (and, for strings from the command line, convert) ``value`` against a type hint."""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key} must be one of {list(args)}, got {value!r}")
        return value
    if args and type(None) in args:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if annotation is bool:
        if isinstance(value, bool) or (  # numpy's too
            type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
        ):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        if isinstance(value, numbers.Integral):  # numpy's integers too
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        if isinstance(value, numbers.Real):  # a whole number of another type (5.0)
            try:
                whole = int(value)  # type: ignore[call-overload]
            except (OverflowError, ValueError):  # inf, NaN
                whole = None
            if whole is not None and whole == value:
                return whole
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if isinstance(value, numbers.Real):  # numpy's numbers too
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {annotation!r}")  # pragma: no cover


def build_section(cls: type[T], values: Mapping[str, Any], prefix: str) -> T:
    """Build one frozen dataclass from a mapping, rejecting unknown keys."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{prefix} must be a table ([{prefix}]), got {values!r}")
    hints = get_type_hints(cls)
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(f'{prefix}.{k}' for k in unknown)}; "
            f"valid keys in [{prefix}]: {', '.join(names)}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}") for k, v in values.items()}
    return cls(**kwargs)


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = dict(value) if isinstance(value, Mapping) else value
    return out


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["model.dropout=0.3", "train.max_steps=10"]`` into a nested dict of strings."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        dotted, value = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) == 1 and parts[0] == "preset":
            nested["preset"] = value.strip()
            continue
        if len(parts) != 2 or parts[0] not in _SECTIONS:
            raise ConfigError(
                f"override {item!r}: key must be section.key with section one of "
                f"{', '.join(_SECTIONS)} (or 'preset')"
            )
        nested.setdefault(parts[0], {})[parts[1]] = value.strip()
    return nested


def config_from_dict(raw: Mapping[str, Any], *, stored: bool = False) -> RunConfig:
    """Build a :class:`RunConfig` from a nested dict: ``preset`` first, then the sections.

    Every section's values are range-checked, except for a ``stored`` config (read back from a
    checkpoint): only its ``[model]`` then, which must build; the rest is what that run used,
    and an older aiayn may have accepted values that this one refuses."""
    raw = dict(raw)
    raw.pop("format_version", None)
    if stored:
        raw = as_saved(raw)
    preset = raw.pop("preset", "base")
    if not isinstance(preset, str):
        raise ConfigError(f"preset must be a string, got {preset!r}")
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ConfigError(
            f"unknown section(s) {', '.join(unknown)}; valid: preset, {', '.join(_SECTIONS)}"
        )
    merged = _merge(preset_overrides(preset), raw)
    sections: dict[str, Any] = {
        name: build_section(cls, merged.get(name, {}), name) for name, cls in _SECTIONS.items()
    }
    config = RunConfig(preset=preset, **sections)
    every = (config.model, config.data, config.train, config.decode)
    for section in every[:1] if stored else every:
        section.validate()
    model = config.model
    if not stored and model.task != "translation":
        # A stack the model does not have: its attention pattern would be ignored. (A stored
        # config is what its run used: it built, and the pattern was ignored there too.)
        absent = "encoder" if model.task == "lm" else "decoder"
        if getattr(model, f"{absent}_attention") != "full":
            kind = "decoder-only" if model.task == "lm" else "encoder-only"
            present = "decoder" if model.task == "lm" else "encoder"
            raise ConfigError(
                f"model.{absent}_attention: model.task={model.task} is {kind}, with no "
                f"{absent}; set model.{present}_attention instead"
            )
    if not stored:
        _refuse_unread_baseline_keys(model, raw.get("model", {}), preset)
    if not stored and config.train.activation_checkpointing and model.arch != "transformer":
        raise ConfigError(
            "train.activation_checkpointing recomputes Transformer layers; "
            f"model.arch={model.arch} has none: set it to false"
        )
    if not stored and model.task == "translation" and model.decoder_attention == "lsh":
        if config.train.valid_bleu:
            raise ConfigError(
                'model.decoder_attention = "lsh" has no incremental decoding, which validation '
                "BLEU needs: set train.valid_bleu = false"
            )
    return config


def as_saved(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A stored config with the model keys it was saved without set to what its model
    computed then (not to today's defaults): ``lsh_dk_scale`` (true) for an lsh model."""
    raw = dict(raw)
    model = raw.get("model")
    if not isinstance(model, Mapping) or "lsh_dk_scale" in model:
        return raw
    patterns = (model.get("encoder_attention"), model.get("decoder_attention"))
    if "lsh" not in patterns:
        return raw
    return {**raw, "model": {**model, "lsh_dk_scale": True}}


def _refuse_unread_baseline_keys(model: ModelConfig, given: Mapping[str, Any], preset: str) -> None:
    """A baseline's own setting on a model that does not read it: refused, not ignored. (Not
    for a stored config: what its run used, and a run of an older aiayn ignored them.)"""
    baselines = (
        ("rnn_hidden", None, ("bahdanau", "luong")),
        ("luong_score", "general", ("luong",)),
        ("input_feeding", True, ("luong",)),
    )
    for name, default, archs in baselines:
        if model.arch not in archs and getattr(model, name) != default:
            origin = "" if name in given else f" (preset {preset} sets it)"
            raise ConfigError(
                f"model.{name}{origin} is an option of model.arch={' and '.join(archs)}, not of "
                f"model.arch={model.arch}"
            )


# What a run's data sets whatever its preset, and the dropout rates: not a change of the
# preset's model.
_DATA_MODEL_KEYS = frozenset(
    ("vocab_size", "tgt_vocab_size", "n_classes", "dropout", "attention_dropout", "relu_dropout")
)


def model_changes(config: RunConfig) -> list[str]:
    """``model.KEY=VALUE`` for each architecture setting of ``config`` that is not its
    preset's (the data's vocabulary and classes, and the dropout rates, aside)."""
    preset = build_section(ModelConfig, preset_overrides(config.preset).get("model", {}), "model")
    return [
        f"model.{f.name}={getattr(config.model, f.name)}"
        for f in fields(ModelConfig)
        if f.name not in _DATA_MODEL_KEYS
        and getattr(config.model, f.name) != getattr(preset, f.name)
    ]


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML run file's tables (a UTF-8 byte order mark at its start is skipped); a
    ConfigError naming the file where it cannot be read or parsed."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except OSError as err:
        raise ConfigError(f"config file {path}: {err.strerror or err}") from None
    try:
        return tomllib.loads(data.decode("utf-8").removeprefix("\ufeff"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 (byte {err.start}): {err.reason}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML run file (optional: a path, or the name of a recipe that ships with aiayn,
    as ``aiayn train --config`` takes it) and apply dotted overrides on top of it."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = resolve_recipe(path)
        if not path.exists() and len(path.parts) == 1:
            raise ConfigError(
                f"config file {path} does not exist, nor is there a recipe of that name "
                f"({', '.join(recipe_names())})"
            )
        name = path.name.removesuffix(".toml")
        if not path.exists() and name in recipe_names():
            # configs/NAME.toml of the repository, given outside it: the recipe ships too.
            raise ConfigError(
                f"config file {path} does not exist; the recipe {name} ships with aiayn, "
                f"from any directory: --config {name}"
            )
        raw = read_toml(path)
    try:
        return config_from_dict(_merge(raw, parse_overrides(overrides or [])))
    except ConfigError as err:
        if path is not None and (not overrides or _fails_alike(raw, err)):
            raise type(err)(f"{path}: {err}") from None  # the file's own fault: named
        raise


def _fails_alike(raw: Mapping[str, Any], err: ConfigError) -> bool:
    """Whether the run file's ``raw`` config, without the overrides, fails with ``err``'s
    message (else the overrides are at fault, or the file alone fails otherwise)."""
    try:
        config_from_dict(raw)
    except ConfigError as alone:
        return str(alone) == str(err)
    except Exception:
        return False
    return False


def replace(config: T, **changes: Any) -> T:
    """``dataclasses.replace`` re-exported for frozen configs."""
    return dataclasses.replace(config, **changes)  # type: ignore[type-var]


def config_to_toml(config: RunConfig) -> str:
    """The resolved config as TOML that :func:`load_config` reads back equal (a run's
    ``config.toml``)."""
    data = config.to_dict()
    data.pop("format_version", None)
    lines = [
        "# The resolved config of this run (written by aiayn train).",
        f"preset = {_toml_value(data.pop('preset'))}",
    ]
    for section, values in data.items():
        lines.append(f"\n[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))
