"""Checkpoint averaging (§6.1: the last 5 checkpoints of the base model, 20 of the big one)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aiayn.config import as_saved, config_from_dict
from aiayn.inference.loading import (
    AVERAGED_NAME,
    CHECKPOINT_DIR,
    STEP_FILE,
    CheckpointError,
    list_step_checkpoints,
    load_checkpoint,
    step_of,
)
from aiayn.training.checkpoint import model_checkpoint, save_atomic, storage_key


class _ModelSum:
    """A running float64 sum of model state dicts, checked for equal names and shapes.

    Tensors shared within the first state (the tied embedding) are summed once and stay
    shared in the mean. Integer buffers are taken from the last state added.
    """

    def __init__(self) -> None:
        self.total: dict[str, Tensor] = {}
        self.model_config: dict[str, Any] | None = None
        self.tokenizer: Tensor | None = None
        self.alias: dict[str, str] = {}  # key -> first key with the same storage
        self.reference: Path | None = None
        self.count = 0

    def add_checkpoint(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Add a checkpoint's model, after checking that it was trained with the same model
        config and tokenizer as the first: models of other vocabularies or shapes may have
        tensors of equal shapes, and their mean translates nothing."""
        # (read as saved: a key added since reads as what the older checkpoint computed)
        config = dict(as_saved(checkpoint.get("config", {})).get("model", {}))
        tokenizer = checkpoint.get("tokenizer")
        if self.reference is not None:
            if self.model_config is not None and config != self.model_config:
                differ = sorted(
                    k
                    for k in set(config) | set(self.model_config)
                    if config.get(k) != self.model_config.get(k)
                )
                raise CheckpointError(
                    f"cannot average {path} with {self.reference}: their model configs differ "
                    f"({', '.join(differ[:5])})"
                )
            if not _same_tensor(tokenizer, self.tokenizer):
                raise CheckpointError(
                    f"cannot average {path} with {self.reference}: they were trained with "
                    "different tokenizers (vocabularies), so their weights mean different words"
                )
        else:
            self.model_config, self.tokenizer = config, tokenizer
        self.add(checkpoint["model"], path)

    def add(self, state: dict[str, Tensor], path: Path) -> None:
        if self.reference is None:
            self.reference = path
            first_by_storage: dict[Any, str] = {}
            for key, tensor in state.items():
                self.alias[key] = first_by_storage.setdefault(storage_key(tensor), key)
        else:
            missing = sorted(set(self.alias) - set(state))
            extra = sorted(set(state) - set(self.alias))
            if missing or extra:
                raise CheckpointError(
                    f"cannot average {path} with {self.reference}: "
                    + (f"missing {missing[:5]} " if missing else "")
                    + (f"unexpected {extra[:5]}" if extra else "")
                )
        for key, tensor in state.items():
            if self.alias[key] != key:
                continue  # a tied alias: summed once under its first name
            if key not in self.total:
                self.total[key] = tensor.double() if tensor.is_floating_point() else tensor.clone()
                continue
            if tensor.shape != self.total[key].shape:
                raise CheckpointError(
                    f"cannot average {path} with {self.reference}: {key} has shape "
                    f"{tuple(tensor.shape)} vs {tuple(self.total[key].shape)}"
                )
            if tensor.is_floating_point():
                self.total[key] += tensor.double()
            else:
                self.total[key] = tensor.clone()
        self.count += 1

    def mean(self) -> dict[str, Tensor]:
        if self.count == 0:
            raise CheckpointError("no checkpoints to average")
        averaged = {
            key: (tensor / self.count).float() if tensor.is_floating_point() else tensor
            for key, tensor in self.total.items()
        }
        return {key: averaged[source] for key, source in self.alias.items()}


def _same_tensor(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


def average_checkpoints(paths: Sequence[str | Path]) -> dict[str, Tensor]:
    """Element-wise mean of the models of ``paths`` in fp32 (§6.1 averages the last 5 or 20),
    accumulated in float64, one file in memory at a time.

    All checkpoints must have the same parameter names and shapes (CheckpointError naming the
    first difference otherwise). Tensors shared within a checkpoint (the tied embedding) stay
    shared in the result. Integer buffers are taken from the last checkpoint.
    """
    total = _ModelSum()
    for path in paths:
        total.add_checkpoint(load_checkpoint(path), Path(path))
    return total.mean()


def average_run(
    run_dir: str | Path, last: int, out: str | Path | None = None, *, in_run: bool = False
) -> Path:
    """Average the newest ``last`` readable step checkpoints of ``run_dir`` (a run directory,
    or its ``checkpoints/`` folder) into ``out`` (default ``RUN_DIR/averaged.pt``);
    unreadable ones are reported and passed over. ``in_run``: the run itself averages (a
    full disk's message then says how the run goes on)."""
    run_dir = Path(run_dir)
    if last <= 0:
        raise CheckpointError(
            f"the number of checkpoints to average (--last) must be positive, got {last}"
        )
    run_dir = _run_directory(run_dir, out)
    target = Path(out) if out is not None else run_dir / AVERAGED_NAME
    chosen = _average_into(target, reversed(list_step_checkpoints(run_dir)), last, in_run)
    if not chosen:
        raise CheckpointError(f"{run_dir} has no readable checkpoints in {CHECKPOINT_DIR}/")
    if len(chosen) < last:
        print(
            f"warning: only {len(chosen)} checkpoint(s) available, averaging those",
            file=sys.stderr,
        )
    return target


def average_files(
    run_dir: str | Path, paths: Sequence[Path], out: str | Path | None = None, *, in_run: bool
) -> list[Path]:
    """Average the step checkpoints ``paths`` of ``run_dir`` into ``out`` (default
    ``RUN_DIR/averaged.pt``), as :func:`average_run` does its newest ones (``train.average_from``
    chooses them); unreadable ones are reported and passed over. Returns those averaged,
    oldest first."""
    run_dir = _run_directory(Path(run_dir), out)
    target = Path(out) if out is not None else run_dir / AVERAGED_NAME
    chosen = _average_into(target, sorted(paths, key=step_of, reverse=True), None, in_run)
    if not chosen:
        raise CheckpointError(f"none of the {len(paths)} checkpoint(s) to average could be read")
    return chosen[::-1]


def _run_directory(run_dir: Path, out: str | Path | None) -> Path:
    """``run_dir`` as a run directory (given as one or as its checkpoints folder), checked to
    exist; ``out`` checked not to be a step checkpoint."""
    if run_dir.name == CHECKPOINT_DIR and not (run_dir / CHECKPOINT_DIR).is_dir():
        run_dir = run_dir.parent  # the run's checkpoints folder, as translate takes it
    if not run_dir.is_dir():
        raise CheckpointError(
            f"{run_dir} does not exist" if not run_dir.exists() else f"{run_dir} is no directory"
        )
    if out is not None:
        where = Path(out).resolve()
        if where.parent.name == CHECKPOINT_DIR and STEP_FILE.match(where.name):
            raise CheckpointError(
                f"{out} is a run's step checkpoint, which training resumes from: write the "
                "average to another file"
            )
    return run_dir


def _average_into(
    target: Path, newest_first: Iterable[Path], limit: int | None, in_run: bool
) -> list[Path]:
    """Average the readable checkpoints of ``newest_first`` (up to ``limit`` of them) into
    ``target``, which takes the newest one's config, tokenizer and step; returns those
    averaged, newest first (none: nothing is written)."""
    total = _ModelSum()
    newest: dict[str, Any] | None = None
    chosen: list[Path] = []
    for path in newest_first:
        if len(chosen) == limit:
            break
        try:
            state = load_checkpoint(path)
        except CheckpointError as err:
            print(f"warning: {err}; left out of the average", file=sys.stderr)
            continue
        total.add_checkpoint(state, path)
        chosen.append(path)
        if newest is None:
            newest = {k: state[k] for k in ("config", "tokenizer", "step", "epoch")}
            newest["labels"] = state.get("labels")
        del state
    if newest is None:
        return []
    payload = model_checkpoint(
        config_from_dict(newest["config"], stored=True),
        total.mean(),
        newest["tokenizer"],
        newest["step"],
        newest["epoch"],
        {"averaged": float(len(chosen)), "first_step": float(step_of(chosen[-1]))},
        labels=newest["labels"],
    )
    save_atomic(payload, target, in_run=in_run)
    return chosen
