"""From a prepared DATA_DIR and a run config to a trained RUN_DIR: what ``aiayn train`` calls.

Resolves the config against the data (the vocabulary size comes from the data unless set
explicitly; a config that cannot fit is refused before any training), writes it to
``RUN_DIR/config.toml``, joins the torchrun process group if there is one, builds the model,
the batches and the validation set, resumes from the newest readable checkpoint when there is
one, and runs the :class:`~aiayn.training.trainer.Trainer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aiayn.accel import accelerate
from aiayn.config import (
    ModelConfig,
    RunConfig,
    config_from_dict,
    load_config,
    parse_overrides,
    read_toml,
    replace,
)
from aiayn.data.batching import TokenBatchSampler
from aiayn.data.corpus import Corpus, data_kind, load_manifest, tokenizer_path
from aiayn.data.sampling import BpeDropoutPairs, check_bpe_dropout
from aiayn.data.tokenizer import Tokenizer
from aiayn.devices import busy_cpu_slowdown
from aiayn.errors import ConfigError, UserError
from aiayn.inference import loading
from aiayn.lock import LOCK_NAME, RunDirectoryBusy, run_lock
from aiayn.model.families import build_model, pretrained_encoder_state
from aiayn.progress import counted
from aiayn.recipes import resolve_recipe
from aiayn.training import checkpoint as ckpt
from aiayn.training.averaging import average_run
from aiayn.training.distributed import (
    DistInfo,
    barrier,
    broadcast_object,
    init_distributed,
    shutdown_distributed,
)
from aiayn.training.tasks import TextValidSet, text_examples
from aiayn.training.trainer import ExampleSource, Trainer, TrainingError, TrainResult
from aiayn.training.validation import ValidSet

CONFIG_NAME = "config.toml"
RUN_INFO_NAME = "run.json"


# -- the config ----------------------------------------------------------------------------


def _explicit_model_keys(config_path: Path | None, overrides: list[str]) -> set[str]:
    """The ``[model]`` keys that the config file or the overrides set themselves."""
    keys = set(parse_overrides(overrides).get("model", {}))
    if config_path is None:
        return keys
    try:
        raw = read_toml(Path(config_path))
    except ConfigError:
        return keys  # load_config reports it
    if isinstance(raw.get("model"), dict):
        keys |= set(raw["model"])
    return keys


def resolve_config(
    config_path: str | Path | None,
    data_dir: str | Path,
    overrides: list[str] | None = None,
    resuming: Path | None = None,
) -> RunConfig:
    """The run config; ``model.vocab_size`` (and a classifier's ``model.n_classes``) from the
    data's manifest unless set explicitly. With ``train.init_from`` naming a model of the
    run's own task, the ``[model]`` section is that model's, but for what the config sets
    itself (the dropout rates, say). ``resuming``: the run directory this config goes on
    training, whose data the refusals then point to."""
    overrides = list(overrides or [])
    manifest = load_manifest(data_dir)
    path = resolve_recipe(config_path) if config_path is not None else None
    explicit = _explicit_model_keys(path, overrides)
    if "vocab_size" not in explicit:
        overrides.append(f"model.vocab_size={int(manifest['vocab_size'])}")
    config = load_config(path, overrides)
    # A classifier's classes are the data's; other tasks (an mlm pre-trained on labelled
    # text, say) have none, and keep the default whatever data they read.
    if config.model.task == "classify" and manifest.get("labels") and "n_classes" not in explicit:
        overrides.append(f"model.n_classes={len(manifest['labels'])}")
        config = load_config(path, overrides)
    if config.train.init_from is not None and config.model.task != "classify":
        config = _model_of_init(config, explicit)
    check_fits_data(config, data_dir, manifest, resuming)
    return config


# What a model that goes on training from train.init_from may change: nothing else.
_FREE_MODEL_KEYS = frozenset(("dropout", "attention_dropout", "relu_dropout"))


def _init_from_checkpoint(path: str) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``train.init_from`` names and its state; a ConfigError naming the
    setting where it cannot be read."""
    try:
        return loading.resolve_and_load(path)
    except loading.CheckpointError as err:
        raise ConfigError(
            f"train.init_from={path}: {err} (train.init_from=none trains from scratch)"
        ) from None


def _model_of_init(config: RunConfig, explicit: set[str]) -> RunConfig:
    """``config`` with the ``[model]`` of ``train.init_from`` under the keys set explicitly."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    if names <= explicit:  # a run's own config.toml: complete already
        return config
    path = config.train.init_from
    assert path is not None
    found, state = _init_from_checkpoint(path)
    stored_config = config_from_dict(state["config"], stored=True)
    stored = stored_config.model
    if stored.task != config.model.task:
        raise ConfigError(
            f"train.init_from={found}: a {stored.task} model; a {config.model.task} run goes on "
            f"from a {config.model.task} model (a classifier: from an mlm one)"
        )
    mine = {name: getattr(config.model, name) for name in explicit & names}
    model = replace(stored, **mine)
    model.validate()
    # The preset names the model (what `aiayn train` and `aiayn params` show).
    return replace(config, model=model, preset=stored_config.preset)


# For a config made in Python: load_config alone keeps the preset's sizes.
_FROM_PYTHON = (
    " (from Python, make the config with aiayn.training.launch.resolve_config, which takes "
    "them from the data)"
)


def check_fits_data(
    config: RunConfig,
    data_dir: str | Path,
    manifest: dict[str, Any],
    resumed: Path | None = None,
) -> None:
    """Refuse, before training, a config that the data cannot feed (ConfigError); ``resumed``:
    the run directory whose own config this is."""
    task = config.model.task
    kind = data_kind(manifest)
    if (task == "translation") != (kind == "parallel"):
        wanted = "parallel text" if task == "translation" else "text (aiayn prepare --task ...)"
        raise ConfigError(
            f"model.task={task} needs {wanted}, but {data_dir} holds {kind} data"
            + (f" for the {manifest.get('task')} task" if kind == "text" else "")
            + (
                f"; resume the run in {resumed} with the data it was trained on (--data)"
                if resumed is not None
                else "; choose the preset or data that go together (docs/families.md)"
            )
        )
    vocab = int(manifest["vocab_size"])
    if resumed is not None and config.model.vocab_size != vocab:
        raise ConfigError(
            f"the run in {resumed} was trained with a vocabulary of "
            f"{config.model.vocab_size} pieces, but {data_dir} has {vocab}: resume it with "
            "the data it was trained on (--data), or train a new run into another directory"
        )
    if task == "classify":
        labels = manifest.get("labels") or []
        if not labels:
            raise ConfigError(
                f"{data_dir} has no class labels; a classifier trains on data prepared with "
                "aiayn prepare --task classify"
            )
        if len(labels) < 2:
            raise ConfigError(
                f"{data_dir} has one class label ({labels[0]!r}); a classifier needs two or "
                "more: prepare training lines of other classes too"
            )
        if config.model.n_classes != len(labels):
            raise ConfigError(
                f"model.n_classes={config.model.n_classes} but {data_dir} has {len(labels)} "
                "classes; drop model.n_classes from the config (it is then taken from the data)"
                + _FROM_PYTHON
            )
    target_vocab = int(manifest.get("tgt_vocab_size", vocab))
    sizes = (config.model.vocab_size, config.model.target_vocab_size)
    going_on = config.train.init_from is not None and task != "classify"
    if going_on and sizes != (vocab, target_vocab):
        raise ConfigError(
            f"train.init_from={config.train.init_from} has a vocabulary of {sizes[0]} pieces "
            + (f"({sizes[1]} on the target side) " if sizes[1] != sizes[0] else "")
            + f"but the tokenizer of {data_dir} has {vocab}"
            + (f" ({target_vocab} on the target side)" if target_vocab != vocab else "")
            + f": prepare the data with --tokenizer {config.train.init_from}"
        )
    if config.model.vocab_size != vocab:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size} but the tokenizer of {data_dir} has "
            f"{vocab} pieces; drop model.vocab_size from the config (it is then taken from the "
            f"data) or prepare the data with --vocab-size {config.model.vocab_size}" + _FROM_PYTHON
        )
    if config.model.target_vocab_size != target_vocab:
        raise ConfigError(
            f"{data_dir} has a target vocabulary of {target_vocab} pieces, the model "
            f"{config.model.target_vocab_size}: set model.tgt_vocab_size = {target_vocab}"
        )
    splits = manifest.get("splits", {})
    if "train" not in splits:
        raise ConfigError(f"{data_dir} has no train split")
    if config.train.valid_interval > 0 and "valid" not in splits:
        raise ConfigError(
            f"{data_dir} has no valid split; prepare it with --valid, or set "
            "train.valid_interval=0 to train without validation"
        )
    for split in ("train", "valid"):
        if split not in splits or (split == "valid" and config.train.valid_interval <= 0):
            continue
        size = splits[split].get("lines" if kind == "text" else "pairs")
        if size == 0:  # prepared before prepare refused an empty split
            raise ConfigError(
                f"the {split} split of {data_dir} is empty: prepare the data again with "
                f"sentences in it{' (or set train.valid_interval=0)' if split == 'valid' else ''}"
            )
        if kind == "text":
            continue  # long lines are cut to model.max_positions (aiayn.data.text)
        longest = max(int(n) for n in splits[split]["longest"].values()) + 1  # + BOS/EOS
        if longest > config.model.max_positions:
            # --max-len filters training pairs only: validation sentences are kept whole.
            remedy = (
                "prepare the data with a smaller --max-len"
                if split == "train"
                else "train without validation (train.valid_interval=0)"
            )
            raise ConfigError(
                f"the {split} split of {data_dir} has a sentence of {longest} positions "
                f"(with BOS/EOS{_where_longest(data_dir, split)}) but model.max_positions="
                f"{config.model.max_positions}; raise model.max_positions or {remedy}"
            )
        if split == "train" and longest > config.data.max_tokens:
            raise ConfigError(
                f"data.max_tokens={config.data.max_tokens} cannot hold the longest training "
                f"sentence ({longest} tokens with BOS/EOS); raise data.max_tokens"
            )
    if config.train.max_steps <= 0 and config.train.max_epochs <= 0:
        if config.train.max_minutes <= 0:
            raise ConfigError(
                "no stopping rule: set train.max_steps, train.max_epochs or train.max_minutes"
            )


def _where_longest(data_dir: str | Path, split: str) -> str:
    """Where a prepared translation split's longest sentence is, as ``", line N of FILE"``
    (its prepared text, one kept pair a line); "" where the split cannot be read."""
    try:
        corpus = Corpus.open(data_dir, split)
    except (UserError, OSError, KeyError, ValueError):
        return ""
    if not len(corpus):
        return ""
    src, tgt = corpus.src_lengths, corpus.tgt_lengths
    i_src, i_tgt = int(np.argmax(src)), int(np.argmax(tgt))
    if src[i_src] >= tgt[i_tgt]:
        return f", line {i_src + 1} of {corpus.src_text_path()}"
    return f", line {i_tgt + 1} of {corpus.tgt_text_path()}"


def config_to_toml(config: RunConfig) -> str:
    """The resolved config as TOML that :func:`aiayn.config.load_config` reads back equal."""
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


# -- the run -------------------------------------------------------------------------------


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _valid_set(data_dir: Path, tokenizer: Any) -> ValidSet:
    corpus = Corpus.open(data_dir, "valid")
    references = corpus.tgt_texts()
    if len(references) != len(corpus):
        raise ConfigError(
            f"{corpus.tgt_text_path()} has {len(references)} lines for {len(corpus)} pairs; "
            "prepare the data again"
        )
    return ValidSet(corpus, corpus.src_lengths, references, tokenizer.decode)


# Threads this many times slower than one thread: another process holds the cores.
BUSY_SLOWDOWN = 1.5


def _warn_if_cpu_busy() -> None:
    """Say so when other work on the machine makes PyTorch's threads slower than one thread
    (on a 2-core Xeon beside one busy process, a product on two threads measured 1.3x to 12x
    slower than on one; 0.5x on the idle machine)."""
    threads = torch.get_num_threads()
    slowdown = busy_cpu_slowdown()
    if slowdown > BUSY_SLOWDOWN:
        print(
            f"warning: the CPU is busy with other work: {threads} threads ran a test product "
            f"{slowdown:.1f}x slower than 1 thread; training will likely be faster with "
            "--threads 1, torch.set_num_threads(1) from Python (or fewer threads than cores "
            "are free)",
            file=sys.stderr,
        )


def _bpe_dropout_pairs(
    manifest: dict[str, Any], pairs: Corpus, tokenizer: Tokenizer, config: RunConfig
) -> BpeDropoutPairs:
    """The training pairs segmented with ``data.bpe_dropout`` (aiayn.data.sampling);
    ``manifest``: their data directory's."""
    check_bpe_dropout(config.data.bpe_dropout, tokenizer)
    # No sample longer than prepare let through, nor than the positions hold (+ BOS/EOS).
    prepared = int(manifest.get("filters", {}).get("max_len", config.data.max_len))
    return BpeDropoutPairs(
        pairs,
        tokenizer,
        config.data.bpe_dropout,
        seed=config.train.seed,
        max_len=min(prepared, config.model.max_positions - 1),
    )


def _differences(stored: ModelConfig, run: ModelConfig, names: Iterable[str]) -> list[str]:
    """``model.NAME is X in it, Y in this run`` for each of ``names`` where the checkpoint's
    model (``stored``) and the run's differ."""
    return [
        f"model.{name} is {getattr(stored, name)!r} in it, {getattr(run, name)!r} in this run"
        for name in names
        if getattr(stored, name) != getattr(run, name)
    ]


def _pretrained_weights(config: RunConfig, tokenizer_bytes: bytes) -> dict[str, torch.Tensor]:
    """The weights of ``train.init_from`` that the run starts from, checked against it: the
    whole model when it is of the run's task, the embedding and encoder of an mlm model for a
    classifier."""
    path = config.train.init_from
    assert path is not None
    found, state = _init_from_checkpoint(path)
    stored = config_from_dict(state["config"], stored=True)
    if config.model.task != "classify":
        _check_tokenizer(found, state, tokenizer_bytes)
        names = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in _FREE_MODEL_KEYS]
        differ = _differences(stored.model, config.model, names)
        if differ:
            raise ConfigError(
                f"train.init_from={found}: a model goes on training in its own shape; "
                + "; ".join(differ)
            )
        return dict(state["model"])
    if stored.model.task not in ("mlm", "classify"):
        raise ConfigError(
            f"train.init_from={path}: a {stored.model.task} model; a classifier starts from "
            "an encoder-only (mlm) checkpoint"
        )
    shape: tuple[str, ...] = (
        *("d_model", "d_ff", "n_heads", "d_k", "d_v", "n_layers", "vocab_size", "positional"),
        *("max_positions", "share_embeddings", "pre_norm", "attention_bias"),
    )
    if "linformer" in (stored.model.encoder_attention, config.model.encoder_attention):
        shape = (*shape, "encoder_attention", "linformer_k")  # its projections are weights
    differ = _differences(stored.model, config.model, shape)
    if differ:
        # Another vocabulary: the data's tokenizer is not the pre-trained model's.
        advice = (
            f"; prepare the data with --tokenizer {found}"
            if stored.model.vocab_size != config.model.vocab_size
            else ""
        )
        raise ConfigError(
            f"train.init_from={found}: its encoder differs from model config: "
            + "; ".join(differ)
            + advice
        )
    _check_tokenizer(found, state, tokenizer_bytes)
    return pretrained_encoder_state(state["model"])


def _check_tokenizer(found: Path, state: dict[str, Any], tokenizer_bytes: bytes) -> None:
    saved = state.get("tokenizer")
    # torch.equal is False for tensors of different lengths too.
    if saved is None or not torch.equal(saved, ckpt.bytes_to_tensor(tokenizer_bytes)):
        raise ConfigError(
            f"train.init_from={found} was trained with another tokenizer than the data's: "
            f"prepare the data with --tokenizer {found}"
        )


def load_pretrained_encoder(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy pre-trained embedding and encoder weights into ``model``; every one of its
    embedding and encoder parameters must be among them."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    left = [k for k in missing if k.startswith(("embed.", "encoder."))]
    if left or unexpected:
        raise ConfigError(
            "the pre-trained checkpoint does not fit the model: "
            f"missing {left[:3]}, unexpected {unexpected[:3]}"
        )


def train_run(
    config: RunConfig,
    data_dir: str | Path,
    run_dir: str | Path,
    *,
    device: str = "auto",
    show_progress: bool = True,
    start_over: bool = False,
    process_settings: bool = False,
) -> TrainResult:
    """Train (or resume) ``run_dir`` on ``data_dir``; the same call on every torchrun rank.
    ``config`` as :func:`resolve_config` makes it from a config file and the data (the
    vocabulary size and a classifier's classes taken from the data); one that does not fit the
    data is refused (:func:`check_fits_data`) before anything is written."""

    data_dir, run_dir = Path(data_dir), Path(run_dir)
    manifest = load_manifest(data_dir)
    check_fits_data(config, data_dir, manifest)
    info: DistInfo = init_distributed(device)
    # A run refused before it wrote anything leaves no directory holding only its lock.
    fresh = info.is_main and not (run_dir.is_dir() and any(run_dir.iterdir()))
    try:
        with contextlib.ExitStack() as held:
            # One process at a time in a run directory (under torchrun: rank 0 holds it).
            refusal = None
            if info.is_main:
                run_dir.mkdir(parents=True, exist_ok=True)
                try:
                    held.enter_context(run_lock(run_dir))
                except RunDirectoryBusy as err:
                    refusal = str(err)
                else:
                    for path in ckpt.remove_stale_temporaries(run_dir):
                        print(f"removed {path.name}, left by an interrupted save", file=sys.stderr)
            refusal = broadcast_object(refusal, info)
            if refusal is not None:
                raise RunDirectoryBusy(refusal)
            if info.world_size == 1 and info.device.type == "cpu":
                _warn_if_cpu_busy()
            barrier(info)
            tok_path = tokenizer_path(data_dir)
            tokenizer = Tokenizer.load(tok_path)  # a missing or broken file: a UserError naming it
            tokenizer_bytes = tok_path.read_bytes()
            validating = config.train.valid_interval > 0
            corpus: ExampleSource
            valid: ValidSet | TextValidSet | None = None
            labels: list[str] | None = None
            if config.model.task == "translation":
                pairs = Corpus.open(data_dir, "train")
                corpus, lengths = pairs, (pairs.src_lengths, pairs.tgt_lengths)
                if config.data.bpe_dropout > 0:
                    corpus = _bpe_dropout_pairs(manifest, pairs, tokenizer, config)
                valid = _valid_set(data_dir, tokenizer) if validating else None
            else:
                if config.data.bpe_dropout > 0:
                    raise ConfigError("data.bpe_dropout is an option of the translation task")
                examples = text_examples(data_dir, "train", config)
                corpus, lengths = examples, (examples.lengths, examples.lengths)
                if validating:
                    n_classes = config.model.n_classes if config.model.task == "classify" else 0
                    valid = TextValidSet(text_examples(data_dir, "valid", config), n_classes)
                if config.model.task == "classify":
                    labels = list(manifest["labels"])
            try:
                sampler = TokenBatchSampler(
                    *lengths,
                    config.data.max_tokens,
                    seed=config.train.seed,
                    shuffle=True,
                    rank=info.rank,
                    world_size=info.world_size,
                )
            except ValueError as err:
                raise ConfigError(str(err)) from None
            _seed_everything(config.train.seed)
            model = build_model(config.model)
            if info.rank > 0:  # different dropout masks on every rank
                torch.manual_seed(config.train.seed + info.rank)
            trainer = Trainer(
                config,
                model,
                corpus,
                sampler,
                run_dir,
                valid=valid,
                tokenizer_bytes=tokenizer_bytes,
                labels=labels,
                dist_info=info,
                show_progress=show_progress,
                process_settings=process_settings,
            )
            # Rank 0 reads the checkpoint and sends it: no shared filesystem needed.
            state, refusal = None, None
            found = None  # rank 0's: the checkpoint resumed from, and its state
            if info.is_main:
                # Checkpoints set aside as unreadable count too: a run that has lost them all
                # stops each time until it is told to start over.
                had = loading.list_step_checkpoints(run_dir) or ckpt.set_aside_checkpoints(run_dir)
                passed_over: list[Path] = []
                found = ckpt.resume_point(run_dir, passed_over=passed_over)
                trainer.passed_over = set(passed_over)
                if found is not None:
                    print(f"resuming from {found[0]}", file=sys.stderr)
                    if config.data.bpe_dropout > 0:
                        print(
                            "note: data.bpe_dropout: sentencepiece samples other segmentations "
                            "in each process, whatever the seed: the resumed run does not "
                            "repeat the uninterrupted one exactly",
                            file=sys.stderr,
                        )
                    state = found[1]
                elif had and not start_over:
                    # Those set aside, now or by an earlier attempt (then `had` lists them),
                    # and those left where they are because they cannot be read right now.
                    aside = [p for p in had if p.suffix == ckpt.BROKEN_SUFFIX or not p.exists()]
                    why = [f"{len(aside)} set aside as *.broken"] if aside else []
                    if passed_over:
                        why.append(f"{len(passed_over)} that cannot be read now left in place")
                    refusal = (
                        f"{run_dir / loading.CHECKPOINT_DIR} holds "
                        f"{counted(len(had), 'checkpoint')} and none can be read "
                        f"({'; '.join(why)}); to start this run over, pass --start-over (or "
                        "train into a new directory)"
                    )
                elif had:
                    print(f"no readable checkpoint in {run_dir}: starting over", file=sys.stderr)
            refusal = broadcast_object(refusal, info)
            if refusal is not None:
                raise TrainingError(refusal)
            state = broadcast_object(state, info)
            if state is not None:
                # Refuses another [model] section or tokenizer.
                trainer.load_state_dict(state, found[0] if found is not None else None)
            elif config.train.init_from:
                # Rank 0 reads and checks the file; every rank raises its error alike.
                found_weights: dict[str, torch.Tensor] | str | None = None
                if info.is_main:
                    try:
                        found_weights = _pretrained_weights(config, tokenizer_bytes)
                    except (ConfigError, loading.CheckpointError) as err:
                        found_weights = str(err)
                found_weights = broadcast_object(found_weights, info)
                if isinstance(found_weights, str) or found_weights is None:
                    raise ConfigError(found_weights or "train.init_from: nothing to load")
                if config.model.task == "classify":
                    load_pretrained_encoder(trainer.model, found_weights)
                else:
                    trainer.model.load_state_dict(found_weights)
                if info.is_main:
                    part = "encoder" if config.model.task == "classify" else "model"
                    print(f"{part} initialised from {config.train.init_from}", file=sys.stderr)
            if info.is_main:  # only once the config is known to fit the data and the checkpoint
                (run_dir / CONFIG_NAME).write_text(config_to_toml(config), encoding="utf-8")
                run_info = {"data": str(data_dir.resolve()), "world_size": info.world_size}
                (run_dir / RUN_INFO_NAME).write_text(json.dumps(run_info, indent=2) + "\n")
            return train_and_average(trainer)
    except BaseException:
        if fresh and run_dir.is_dir() and [p.name for p in run_dir.iterdir()] == [LOCK_NAME]:
            (run_dir / LOCK_NAME).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise
    finally:
        shutdown_distributed()


def train_and_average(trainer: Trainer) -> TrainResult:
    """Train (SIGINT and SIGTERM stop after the current update, with a checkpoint), then, if
    the run was not interrupted, average its last ``train.average_last`` checkpoints into
    ``averaged.pt`` (§6.1) and validate the average; finally :meth:`Trainer.close`. The same
    call on every rank."""
    try:
        with trainer.signals_handled():  # a signal during averaging lets it finish too
            result = trainer.train()
            cfg = trainer.config.train
            if not result.interrupted and cfg.average_last > 0 and result.step > 0:
                result.averaged = _average(trainer, cfg.average_last)
        return result
    finally:
        trainer.close()


def _average(trainer: Trainer, last: int) -> Path:
    info = trainer.info
    averaged = average_run(trainer.run_dir, last, in_run=True) if info.is_main else None
    averaged = broadcast_object(averaged, info)
    if trainer.valid is None:
        return averaged
    # Rank 0 reads the file and sends the weights: no shared filesystem needed.
    weights, count = None, 0
    if info.is_main:
        state = loading.load_checkpoint(averaged)
        weights, count = state["model"], int(state["metrics"]["averaged"])
    model = build_model(trainer.config.model, info.device)
    model.load_state_dict(broadcast_object(weights, info))
    if trainer.acceleration is not None:  # validated as the trained model was
        accelerate(model, "train", precision=trainer.precision)
    metrics = trainer.validate(model)
    # replace: a finished run run again averages again, and keeps one record.
    record = {"kind": "averaged", "step": trainer.step, "minutes": trainer.minutes, **metrics}
    trainer.metrics.write(record, replace=True)
    text = " ".join(f"{k} {v:.3f}" for k, v in metrics.items())
    trainer.log(f"averaged last {count}: {text} -> {averaged}")
    return averaged


def saved_run_info(run_dir: str | Path) -> dict[str, Any]:
    """``RUN_DIR/run.json`` (the data directory of an earlier run), or ``{}``."""
    path = Path(run_dir) / RUN_INFO_NAME
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}
