"""Checkpoints as plain data plus tensors: atomic writes, safe loads, resume, averaging.

A checkpoint is one ``torch.save`` file holding a dict with no pickled objects, so it loads
with ``torch.load(weights_only=True)`` and loading never runs code:

==================  ======================================================================
key                 value
==================  ======================================================================
``format``          ``"aiayn-checkpoint"``
``format_version``  ``CHECKPOINT_VERSION`` (int)
``kind``            ``"train"`` (resumable) or ``"model"`` (best / averaged: no optimizer)
``config``          ``RunConfig.to_dict()``
``model``           the model's ``state_dict()`` (fp32; the shared embedding's three names
                    refer to one storage)
``tokenizer``       the sentencepiece model file as a uint8 tensor
``step``            optimizer updates done
``epoch``           epochs done
``metrics``         the last validation metrics (dict of floats), maybe empty
``optimizer``       Adam's ``state_dict()``                             (train only)
``schedule``        LambdaLR's ``state_dict()``                         (train only)
``scaler``          GradScaler's ``state_dict()`` or ``{}``             (train only)
``sampler``         one batch sampler ``state_dict()`` per rank (plain ints) (train only)
``rng``             one dict per rank: ``torch`` (uint8 tensor), ``cuda`` (list of uint8
                    tensors), ``numpy`` and ``python`` (plain lists)    (train only)
``progress``        ``best_value``, ``best_step``, ``bad_evals`` (patience counter),
                    ``minutes`` (training wall time so far), ``tokens`` (target tokens
                    seen), ``skipped`` (non-finite updates skipped)      (train only)
==================  ======================================================================

Files of a run directory: ``checkpoints/step_00001234.pt`` (train kind, the newest
``keep_last`` kept), ``best.pt`` (model kind, best validation score) and ``averaged.pt``
(model kind, the average of the last ``average_last``).
"""

from __future__ import annotations

import os
import pickle
import random
import re
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from aiayn.config import RunConfig, config_from_dict
from aiayn.errors import ConfigError, UserError

if TYPE_CHECKING:
    from aiayn.data.tokenizer import Tokenizer
    from aiayn.model.transformer import Transformer

CHECKPOINT_FORMAT = "aiayn-checkpoint"
CHECKPOINT_VERSION = 1
CHECKPOINT_DIR = "checkpoints"
BEST_NAME = "best.pt"
AVERAGED_NAME = "averaged.pt"
_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


class CheckpointError(UserError):
    """A checkpoint that cannot be read: missing, truncated, corrupt or of another format."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file whose bytes are damaged (empty, truncated, corrupt): what a crash, a
    kill or a full disk leaves behind; unlike a file of a newer format or one that cannot be
    read right now, it will never load."""


# -- files ---------------------------------------------------------------------------------


def step_checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{step:08d}.pt"


def list_step_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's step checkpoints, oldest first (by step number, not by file time)."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _STEP_FILE.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def set_aside(path: Path) -> Path:
    """Rename a corrupt step checkpoint to ``NAME.broken``: no longer a step checkpoint (it
    takes no ``keep_last`` slot, is never averaged), but kept for whoever wants to look."""
    target = path.with_name(path.name + ".broken")
    path.replace(target)
    return target


def save_atomic(obj: dict[str, Any], path: str | Path) -> None:
    """``torch.save`` to a temporary file in the same directory, flush, fsync, rename.

    A crash at any moment leaves either the old file or the complete new one, never a part.
    The file gets the mode a plain ``open(path, "wb")`` would give it (0666 less the umask).
    """
    path = Path(path)
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


_ZIP_MAGIC = b"PK\x03\x04"


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Read and check one checkpoint with ``weights_only=True``; CheckpointError if unusable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with path.open("rb") as handle:
            head = handle.read(4)
        if not head:
            raise CheckpointCorrupt(f"checkpoint {path} is empty (truncated?)")
        if head != _ZIP_MAGIC:  # torch.save writes a zip archive
            raise CheckpointError(f"{path} is not an aiayn checkpoint (not a PyTorch file)")
        state = torch.load(path, map_location=device, weights_only=True)
    except CheckpointError:
        raise
    except OSError as err:  # the file, not its bytes: permissions, I/O errors
        raise CheckpointError(f"checkpoint {path} cannot be read: {err.strerror or err}") from None
    except MemoryError:
        raise
    except pickle.UnpicklingError as err:
        if "weights only" not in str(err).lower():
            raise CheckpointCorrupt(f"checkpoint {path} is unreadable (corrupt?): {err}") from None
        # Loading it would mean running the code it names: never done here.
        raise CheckpointError(
            f"{path} is not an aiayn checkpoint: it holds Python objects that only loading "
            "it as code could rebuild (aiayn checkpoints hold tensors and plain data)"
        ) from None
    except Exception as err:  # truncated zip, missing records, ...
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointCorrupt(
            f"checkpoint {path} is unreadable (truncated or corrupt?): {reason}"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not an aiayn checkpoint")
    version = state.get("format_version")
    if not isinstance(version, int) or version > CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version!r}; this aiayn reads up to "
            f"{CHECKPOINT_VERSION}"
        )
    for key in ("config", "model", "step"):
        if key not in state:
            raise CheckpointError(f"checkpoint {path} lacks {key!r}")
    return state


def latest_valid_checkpoint(
    run_dir: str | Path,
    device: str | torch.device = "cpu",
    warn: bool = True,
    failed: dict[Path, CheckpointError] | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """The newest step checkpoint that loads, falling back past broken ones (with a message);
    ``failed``, when given, receives each newer one passed over and why."""
    for path in reversed(list_step_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path, device)
        except CheckpointError as err:
            if failed is not None:
                failed[path] = err
            if warn:
                print(f"warning: {err}; falling back to the previous checkpoint", file=sys.stderr)
    return None


def resume_point(
    run_dir: str | Path, device: str | torch.device = "cpu"
) -> tuple[Path, dict[str, Any]] | None:
    """Where a run resumes: :func:`latest_valid_checkpoint`, after which each corrupt newer
    checkpoint (what a dead process left) is set aside (:func:`set_aside`, said on stderr), so
    that it takes no ``keep_last`` slot from the resumed run's checkpoints and is never
    averaged. Newer ones that fail otherwise (a newer format, a file that cannot be read right
    now) stay where they are."""
    failed: dict[Path, CheckpointError] = {}
    found = latest_valid_checkpoint(run_dir, device, failed=failed)
    for path, err in failed.items():
        if isinstance(err, CheckpointCorrupt):
            moved = set_aside(path)
            print(f"set {path.name} aside as {moved.name} (it will never load)", file=sys.stderr)
    return found


# -- pieces of state -----------------------------------------------------------------------


def bytes_to_tensor(data: bytes) -> Tensor:
    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def tensor_to_bytes(tensor: Tensor) -> bytes:
    return tensor.to(torch.uint8).cpu().numpy().tobytes()


def capture_rng() -> dict[str, Any]:
    """The torch, CUDA, numpy and Python random states as tensors and plain lists."""
    np_state = np.random.get_state()
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
        ident = id(tensor) if tensor.numel() == 0 else _storage_key(tensor)
        if ident not in copies:
            value = tensor.detach().to("cpu", copy=True)
            copies[ident] = value.float() if value.is_floating_point() else value
        out[key] = copies[ident]
    return out


def _storage_key(tensor: Tensor) -> Any:
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


# -- averaging -----------------------------------------------------------------------------


class _ModelSum:
    """A running float64 sum of model state dicts, checked for equal names and shapes.

    Tensors shared within the first state (the tied embedding) are summed once and stay
    shared in the mean. Integer buffers are taken from the last state added.
    """

    def __init__(self) -> None:
        self.total: dict[str, Tensor] = {}
        self.alias: dict[str, str] = {}  # key -> first key with the same storage
        self.reference: Path | None = None
        self.count = 0

    def add(self, state: dict[str, Tensor], path: Path) -> None:
        if self.reference is None:
            self.reference = path
            first_by_storage: dict[Any, str] = {}
            for key, tensor in state.items():
                self.alias[key] = first_by_storage.setdefault(_storage_key(tensor), key)
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


def average_checkpoints(paths: Sequence[str | Path]) -> dict[str, Tensor]:
    """Element-wise mean of the models of ``paths`` in fp32 (§6.1 averages the last 5 or 20),
    accumulated in float64, one file in memory at a time.

    All checkpoints must have the same parameter names and shapes (CheckpointError naming the
    first difference otherwise). Tensors shared within a checkpoint (the tied embedding) stay
    shared in the result. Integer buffers are taken from the last checkpoint.
    """
    total = _ModelSum()
    for path in paths:
        total.add(load_checkpoint(path)["model"], Path(path))
    return total.mean()


def model_checkpoint(
    config: RunConfig,
    model_weights: dict[str, Tensor],
    tokenizer: Tensor,
    step: int,
    epoch: int,
    metrics: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A model-only checkpoint (``best.pt``, ``averaged.pt``)."""
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
    }


def average_run(run_dir: str | Path, last: int, out: str | Path | None = None) -> Path:
    """Average the newest ``last`` readable step checkpoints of ``run_dir`` into ``out``
    (default ``RUN_DIR/averaged.pt``); unreadable ones are reported and passed over."""
    run_dir = Path(run_dir)
    if last <= 0:
        raise CheckpointError(f"--last must be positive, got {last}")
    total = _ModelSum()
    newest: dict[str, Any] | None = None
    chosen: list[Path] = []
    for path in reversed(list_step_checkpoints(run_dir)):
        if len(chosen) == last:
            break
        try:
            state = load_checkpoint(path)
        except CheckpointError as err:
            print(f"warning: {err}; left out of the average", file=sys.stderr)
            continue
        total.add(state["model"], path)
        chosen.append(path)
        if newest is None:
            newest = {k: state[k] for k in ("config", "tokenizer", "step", "epoch")}
        del state
    if newest is None:
        raise CheckpointError(f"{run_dir} has no readable checkpoints in {CHECKPOINT_DIR}/")
    if len(chosen) < last:
        print(
            f"warning: only {len(chosen)} checkpoint(s) available, averaging those",
            file=sys.stderr,
        )
    target = Path(out) if out is not None else run_dir / AVERAGED_NAME
    payload = model_checkpoint(
        config_from_dict(newest["config"], stored=True),
        total.mean(),
        newest["tokenizer"],
        newest["step"],
        newest["epoch"],
        {"averaged": float(len(chosen)), "first_step": float(_step_of(chosen[-1]))},
    )
    save_atomic(payload, target)
    return target


def _step_of(path: Path) -> int:
    match = _STEP_FILE.match(path.name)
    return int(match.group(1)) if match else -1


# -- inference -----------------------------------------------------------------------------


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file as given, or for a run directory: ``averaged.pt`` if present, else the
    newest readable step checkpoint."""
    return _resolve_and_load(path)[0]


def _resolve_and_load(path: str | Path) -> tuple[Path, dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        if (path / AVERAGED_NAME).is_file():
            return path / AVERAGED_NAME, load_checkpoint(path / AVERAGED_NAME)
        found = latest_valid_checkpoint(path)
        if found is None:
            raise CheckpointError(f"{path} holds no {AVERAGED_NAME} and no readable checkpoint")
        return found
    return path, load_checkpoint(path)


def load_for_inference(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[Transformer, RunConfig, Tokenizer]:
    """The model (eval mode, on ``device``), its config and its tokenizer from a checkpoint
    file or a run directory (see :func:`resolve_checkpoint`)."""
    from aiayn.data.tokenizer import Tokenizer
    from aiayn.model.transformer import Transformer

    path, state = _resolve_and_load(path)
    try:
        config = config_from_dict(state["config"], stored=True)
    except ConfigError as err:
        raise CheckpointError(f"{path}: stored config is invalid: {err}") from None
    model = Transformer(config.model)
    model.load_state_dict(state["model"])
    model.to(device).eval()
    if "tokenizer" not in state or state["tokenizer"].numel() == 0:
        raise CheckpointError(f"{path} carries no tokenizer")
    tokenizer = Tokenizer.from_bytes(tensor_to_bytes(state["tokenizer"]))
    return model, config, tokenizer
