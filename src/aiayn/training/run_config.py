"""The config of a training run, resolved against its data: the vocabulary size (and a
classifier's classes) from the data's manifest unless set explicitly, the ``[model]`` of
``train.init_from`` for a run that goes on training, and a config that the data cannot feed
refused before any training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from aiayn.config import RunConfig, load_config, parse_overrides, read_toml
from aiayn.data.corpus import Corpus, data_kind, load_manifest
from aiayn.errors import ConfigError, UserError
from aiayn.recipes import resolve_recipe
from aiayn.training.pretrained import model_of_init


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
        config = model_of_init(config, explicit)
    check_fits_data(config, data_dir, manifest, resuming)
    return config


# For a config made in Python: load_config alone keeps the preset's sizes.
_FROM_PYTHON = (
    " (from Python, make the config with aiayn.training.run_config.resolve_config, which takes "
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
