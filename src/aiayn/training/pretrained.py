"""What a run takes from ``train.init_from``: the ``[model]`` of the model it goes on training,
and the weights it starts from (the whole model of the run's own task, or an mlm model's
embedding and encoder for a classifier), each checked against the run and its data's tokenizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from aiayn.config import ModelConfig, RunConfig, config_from_dict, replace
from aiayn.errors import ConfigError
from aiayn.inference import loading
from aiayn.model.families import pretrained_encoder_state
from aiayn.training import checkpoint as ckpt

# What a model that goes on training from train.init_from may change: nothing else.
_FREE_MODEL_KEYS = frozenset(("dropout", "attention_dropout", "relu_dropout"))


def _init_checkpoint(path: str) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``train.init_from`` names and its state; a ConfigError naming the
    setting where it cannot be read."""
    try:
        return loading.resolve_and_load(path)
    except loading.CheckpointError as err:
        raise ConfigError(
            f"train.init_from={path}: {err} (train.init_from=none trains from scratch)"
        ) from None


def model_of_init(config: RunConfig, explicit: set[str]) -> RunConfig:
    """``config`` with the ``[model]`` of ``train.init_from`` under the keys set explicitly."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    if names <= explicit:  # a run's own config.toml: complete already
        return config
    path = config.train.init_from
    assert path is not None
    found, state = _init_checkpoint(path)
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


def _differences(stored: ModelConfig, run: ModelConfig, names: Iterable[str]) -> list[str]:
    """``model.NAME is X in it, Y in this run`` for each of ``names`` where the checkpoint's
    model (``stored``) and the run's differ."""
    return [
        f"model.{name} is {getattr(stored, name)!r} in it, {getattr(run, name)!r} in this run"
        for name in names
        if getattr(stored, name) != getattr(run, name)
    ]


def pretrained_weights(config: RunConfig, tokenizer_bytes: bytes) -> dict[str, torch.Tensor]:
    """The weights of ``train.init_from`` that the run starts from, checked against it: the
    whole model when it is of the run's task, the embedding and encoder of an mlm model for a
    classifier."""
    path = config.train.init_from
    assert path is not None
    found, state = _init_checkpoint(path)
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
