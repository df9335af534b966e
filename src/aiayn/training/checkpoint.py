"""Writing checkpoints (atomically), resuming a run, and the pieces of a training state.

The file format and reading it: :mod:`aiayn.inference.loading`. Averaging:
:mod:`aiayn.training.averaging`.
"""

from __future__ import annotations

import os
import random
import secrets
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from aiayn.config import RunConfig
from aiayn.inference.loading import (
    CHECKPOINT_DIR,
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    CheckpointCorrupt,
    CheckpointError,
    latest_valid_checkpoint,
)
from aiayn.training.storage import tensor_bytes, writing

BROKEN_SUFFIX = ".broken"


def set_aside(path: Path) -> Path:
    """Rename a corrupt step checkpoint to ``NAME.broken``: no longer a step checkpoint (it
    takes no ``keep_last`` slot, is never averaged), but kept for whoever wants to look."""
    target = path.with_name(path.name + BROKEN_SUFFIX)
    path.replace(target)
    return target


def set_aside_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's step checkpoints that :func:`set_aside` renamed, by name."""
    return sorted((Path(run_dir) / CHECKPOINT_DIR).glob(f"step_*.pt{BROKEN_SUFFIX}"))


def save_atomic(obj: dict[str, Any], path: str | Path, *, in_run: bool = True) -> None:
    """``torch.save`` to a temporary file in the same directory, flush, fsync, rename.

    A crash at any moment leaves either the old file or the complete new one, never a part.
    The file gets the mode a plain ``open(path, "wb")`` would give it (0666 less the umask).
    A full disk or a read-only directory is a one-line :class:`RunDirectoryError` (the
    temporary file removed, the old file intact); ``in_run``: ``path`` is a training run's,
    and the message says how to resume it.
    """
    path = Path(path)
    with writing(path, "the checkpoint", tensor_bytes(obj), in_run):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = _create_temporary(path)
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(obj, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
    _fsync_dir(path.parent)


def _create_temporary(path: Path) -> tuple[int, Path]:
    """A new empty file ``.NAME.RANDOM.tmp`` beside ``path``, open for writing.

    Not ``tempfile.mkstemp``: it creates mode 0600, which would hide the models from the
    other users whatever the umask. Creating with 0666 lets the kernel apply the umask (and a
    default ACL) as for any file; ``O_EXCL`` keeps the name our own.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temporary file name beside {path}")  # pragma: no cover


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Delete the temporary files that a process killed while saving left behind."""
    removed = []
    for folder in (Path(run_dir), Path(run_dir) / CHECKPOINT_DIR):
        if folder.is_dir():
            for path in folder.glob(".*.pt.*.tmp"):
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def resume_point(
    run_dir: str | Path,
    device: str | torch.device = "cpu",
    passed_over: list[Path] | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """Where a run resumes: :func:`latest_valid_checkpoint`, after which each corrupt newer
    checkpoint (what a dead process left) is set aside (:func:`set_aside`, said on stderr), so
    that it takes no ``keep_last`` slot from the resumed run's checkpoints and is never
    averaged. Newer ones that fail otherwise (a newer format, a file that cannot be read right
    now) stay where they are and are listed in ``passed_over``: the run's pruning leaves them
    alone and never counts them as one of its ``keep_last``."""
    failed: dict[Path, CheckpointError] = {}
    found = latest_valid_checkpoint(run_dir, device, failed=failed)
    for path, err in failed.items():
        if isinstance(err, CheckpointCorrupt):
            moved = set_aside(path)
            print(f"set {path.name} aside as {moved.name} (it will never load)", file=sys.stderr)
        elif passed_over is not None:
            passed_over.append(path)
    return found


# -- pieces of state -----------------------------------------------------------------------


def bytes_to_tensor(data: bytes) -> Tensor:
    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def capture_rng() -> dict[str, Any]:
    """The torch, CUDA, numpy and Python random states as tensors and plain lists."""
    np_state: tuple[Any, ...] = np.random.get_state(legacy=True)  # type: ignore[assignment]
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [
            str(np_state[0]),
            [int(x) for x in np_state[1]],
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "python": [int(py_version), [int(x) for x in py_internal], py_gauss],
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") and torch.cuda.is_available():
        cuda_states = [s.cpu() for s in state["cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def model_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's ``state_dict`` on CPU in fp32, tied weights kept as one shared tensor."""
    out: dict[str, Tensor] = {}
    copies: dict[int, Tensor] = {}
    for key, tensor in model.state_dict().items():
        ident = id(tensor) if tensor.numel() == 0 else storage_key(tensor)
        if ident not in copies:
            value = tensor.detach().to("cpu", copy=True)
            copies[ident] = value.float() if value.is_floating_point() else value
        out[key] = copies[ident]
    return out


def storage_key(tensor: Tensor) -> Any:
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def model_checkpoint(
    config: RunConfig,
    model_weights: dict[str, Tensor],
    tokenizer: Tensor,
    step: int,
    epoch: int,
    metrics: dict[str, float] | None = None,
    labels: list[str] | None = None,
) -> dict[str, Any]:
    """A model-only checkpoint (``best.pt``, ``averaged.pt``); a classifier's carries its
    class names (``labels``, in class-index order)."""
    extra = {"labels": list(labels)} if labels else {}
    return {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_VERSION,
        "kind": "model",
        "config": config.to_dict(),
        "model": model_weights,
        "tokenizer": tokenizer,
        "step": int(step),
        "epoch": int(epoch),
        "metrics": dict(metrics or {}),
        **extra,
    }
