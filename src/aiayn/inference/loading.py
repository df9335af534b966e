"""Reading checkpoints: the file format, safe loads, and a model with its tokenizer for inference.

A checkpoint is one ``torch.save`` file holding a dict with no pickled objects, so it loads
with ``torch.load(weights_only=True)`` and loading never runs code; it is written by
:mod:`aiayn.training.checkpoint`:

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

For inference (:func:`load_model`) the checkpoint is mapped, not read
(``torch.load(mmap=True)``, privately): the model's parameters are the file's pages, read
when used. aiayn writes checkpoints to a new file renamed over the old one,
which leaves a mapped file as it was; a checkpoint that a running process translates with is
not to be written over in place (``mmap=False`` reads it instead).

Files of a run directory: ``checkpoints/step_00001234.pt`` (train kind, the newest
``keep_last`` kept), ``best.pt`` (model kind, best validation score) and ``averaged.pt``
(model kind, the average of the last ``average_last``).
"""

from __future__ import annotations

import contextlib
import errno
import mmap as mmap_module
import pickle
import re
import sys
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import RunConfig, config_from_dict
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import ConfigError, UserError
from aiayn.model.families import TranslationModel, build_model

CHECKPOINT_FORMAT = "aiayn-checkpoint"
CHECKPOINT_VERSION = 1
CHECKPOINT_DIR = "checkpoints"
BEST_NAME = "best.pt"
AVERAGED_NAME = "averaged.pt"
STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


class CheckpointError(UserError):
    """A checkpoint that cannot be read: missing, truncated, corrupt or of another format."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file whose bytes are damaged (empty, truncated, corrupt): what a crash, a
    kill or a full disk leaves behind; unlike a file of a newer format or one that cannot be
    read right now, it will never load."""


# -- files ---------------------------------------------------------------------------------


def step_checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{step:08d}.pt"


def step_of(path: Path) -> int:
    """The update count in a step checkpoint's file name (-1 for another file)."""
    match = STEP_FILE.match(path.name)
    return int(match.group(1)) if match else -1


def list_step_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's step checkpoints, oldest first (by step number, not by file time)."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [(step_of(path), path) for path in folder.iterdir()]
    return [path for step, path in sorted(found) if step >= 0]


_ZIP_MAGIC = b"PK\x03\x04"


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu", *, mmap: bool = False
) -> dict[str, Any]:
    """Read and check one checkpoint with ``weights_only=True``; CheckpointError if unusable.
    With ``mmap`` its tensors are mapped from the file (on the CPU) instead of read."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with path.open("rb") as handle:
            head = handle.read(4)
        if not head:
            raise CheckpointCorrupt(f"checkpoint {path} is empty (truncated?)")
        if head[:1] == b"\x80":  # a pickle: torch.save's format before PyTorch 1.6, or plain
            raise CheckpointError(
                f"{path} is not an aiayn checkpoint: a pickle (PyTorch's format before 1.6, "
                "or Python's own), which aiayn does not read"
            )
        if head != _ZIP_MAGIC:  # torch.save writes a zip archive
            # Bytes that are no zip archive at all never load: corrupt, like a truncated one.
            raise CheckpointCorrupt(f"{path} is not an aiayn checkpoint (not a PyTorch file)")
        if (record := _record_failing_crc(path)) is not None:
            raise CheckpointCorrupt(
                f"checkpoint {path} is corrupt: its record {record} does not match its CRC-32"
            )
        state = _mapped(path) if mmap else None
        if state is None:
            state = torch.load(path, map_location=device, weights_only=True)
    except CheckpointError:
        raise
    except OSError as err:
        # PyTorch's zip reader raises EINVAL where a cut-short file's records point before its
        # start: the bytes, as any other truncation, where the archive is indeed unreadable.
        # Otherwise (EINVAL is also what some file systems, and Windows for unmapped errors,
        # say of a read that failed) the file, not its bytes: permissions, I/O errors.
        if err.errno == errno.EINVAL and _not_a_zip_archive(path):
            raise CheckpointCorrupt(
                f"checkpoint {path} is unreadable (truncated or corrupt?): its zip directory "
                "is missing or points outside the file"
            ) from None
        reason = err.strerror or err
        raise CheckpointError(f"checkpoint {path} cannot be read: {reason}") from None
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
        reason = _first_sentence(err)
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


_MINIZ_PARAGRAPH = ". This is an internal miniz error"


def _first_sentence(err: BaseException) -> str:
    """The first line of what ``err`` says, without the paragraph on filing a bug report that
    PyTorch's zip reader appends to the errors of its miniz library."""
    first = (str(err).strip().splitlines() or [""])[0]
    return first.split(_MINIZ_PARAGRAPH, 1)[0].strip() or type(err).__name__


def _record_failing_crc(path: Path) -> str | None:
    """The first record of the zip archive at ``path`` whose bytes do not match the CRC-32
    stored for them (bytes changed on disk or in transit; PyTorch's own reader does not
    check), or None. Records stored without one (CRC 0: PyTorch's
    ``torch.utils.serialization.config.save.compute_crc32`` off) are not checked; an archive
    Python cannot open is left to ``torch.load``'s judgement. It reads the whole file once."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0:
                    continue
                try:
                    with archive.open(info) as record:
                        while record.read(1 << 20):
                            pass
                except zipfile.BadZipFile:
                    return info.filename
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        return None
    return None


def _not_a_zip_archive(path: Path) -> bool:
    """Whether ``path``'s bytes are no readable zip archive (its central directory missing or
    out of bounds), as Python's own zip reader finds them; False where it cannot read them."""
    try:
        with zipfile.ZipFile(path):
            return False
    except zipfile.BadZipFile:
        return True
    except (OSError, ValueError, EOFError):
        return False


def _mapped(path: Path) -> Any:
    """The checkpoint at ``path`` with its tensors mapped from the file (privately: a write to
    a tensor never reaches the file), or None where the file cannot be mapped (a file system
    without mappings, an address-space limit) or does not load so (read, it is judged)."""
    private = getattr(mmap_module, "MAP_PRIVATE", None)  # None on Windows: torch's own way
    options = (
        contextlib.nullcontext()
        if private is None
        else torch.serialization.set_default_mmap_options(private)
    )
    try:
        with options:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (MemoryError, pickle.UnpicklingError):
        raise  # a refused or unreadable pickle: judged as the read would judge it
    except Exception:
        return None


def latest_valid_checkpoint(
    run_dir: str | Path,
    device: str | torch.device = "cpu",
    warn: bool = True,
    failed: dict[Path, CheckpointError] | None = None,
    mmap: bool = False,
) -> tuple[Path, dict[str, Any]] | None:
    """The newest step checkpoint that loads (``mmap``: see :func:`load_checkpoint`), falling
    back past broken ones (with a message); ``failed``, when given, receives each newer one
    passed over and why."""
    for path in reversed(list_step_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path, device, mmap=mmap)
        except CheckpointError as err:
            if failed is not None:
                failed[path] = err
            if warn:
                print(f"warning: {err}; falling back to the previous checkpoint", file=sys.stderr)
    return None


def tensor_to_bytes(tensor: Tensor) -> bytes:
    return tensor.to(torch.uint8).cpu().numpy().tobytes()


# -- inference -----------------------------------------------------------------------------


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file as given, or for a run directory: ``averaged.pt`` if present, else the
    newest readable step checkpoint; for a run's ``checkpoints/`` folder, its newest readable
    step checkpoint."""
    return resolve_and_load(path)[0]


def resolve_and_load(path: str | Path, *, mmap: bool = False) -> tuple[Path, dict[str, Any]]:
    """:func:`resolve_checkpoint` and the checkpoint read (``mmap``: mapped) from it."""
    path = Path(path)
    if (
        path.is_dir()
        and path.name == CHECKPOINT_DIR
        and not (path / CHECKPOINT_DIR).is_dir()
        and not (path / AVERAGED_NAME).is_file()
    ):
        found = latest_valid_checkpoint(path.parent, mmap=mmap)  # a run's checkpoints folder
        if found is None:
            raise CheckpointError(f"{path} holds no readable step checkpoint")
        return found
    if path.is_dir():
        if (path / AVERAGED_NAME).is_file():
            return path / AVERAGED_NAME, load_checkpoint(path / AVERAGED_NAME, mmap=mmap)
        found = latest_valid_checkpoint(path, mmap=mmap)
        if found is None:
            raise CheckpointError(f"{path} holds no {AVERAGED_NAME} and no readable checkpoint")
        return found
    return path, load_checkpoint(path, mmap=mmap)


def assign_weights(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """``model.load_state_dict(state)`` (strict) without a copy: ``state``'s tensors become the
    parameters and buffers (those of a mapped checkpoint stay mapped), in the model's dtypes.
    A parameter the model holds under several names (the tied embedding and projection) stays
    one parameter."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    dtypes = {name: t.dtype for name, t in model.state_dict(keep_vars=True).items()}
    model.load_state_dict(state, assign=True)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.dtype != dtypes[name]:  # a checkpoint of other dtypes: a converted copy
            tensor.data = tensor.data.to(dtypes[name])
    for shared in names.values():
        first = model.get_parameter(shared[0])
        for name in shared[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, first)


@dataclass
class LoadedModel:
    """A checkpoint ready for inference: the model of its task (eval mode), its config, its
    tokenizer, a classifier's class names, the file it came from, and the tokenizer's bytes
    as the checkpoint holds them (a data directory prepared with it holds the same)."""

    model: nn.Module
    config: RunConfig
    tokenizer: Tokenizer
    labels: list[str]
    path: Path
    tokenizer_bytes: bytes = b""


# What each task's model is used with, for the error that a wrong command gets.
TASK_COMMANDS = {
    "translation": "aiayn translate",
    "lm": "aiayn generate",
    "mlm": "a classify run that fine-tunes it (train.init_from), then aiayn classify",
    "classify": "aiayn classify",
}


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    *,
    tasks: Sequence[str] | None = None,
    mmap: bool = True,
) -> LoadedModel:
    """The model (eval mode, on ``device``), config, tokenizer and class names from a
    checkpoint file or a run directory (see :func:`resolve_checkpoint`). With ``tasks``, a
    checkpoint of another task is refused with a :class:`CheckpointError` naming the command
    that serves it. ``mmap``: the weights mapped from the file (the module docstring), else
    read into memory."""
    path, state = resolve_and_load(path, mmap=mmap)
    try:
        config = config_from_dict(state["config"], stored=True)
    except ConfigError as err:
        raise CheckpointError(f"{path}: stored config is invalid: {err}") from None
    task = config.model.task
    if tasks is not None and task not in tasks:
        raise CheckpointError(
            f"{path} holds a model for the {task} task (model.task); use it with "
            f"{TASK_COMMANDS[task]}"
        )
    model = build_model(config.model)
    assign_weights(model, state["model"])
    model.to(device).eval()
    if "tokenizer" not in state or state["tokenizer"].numel() == 0:
        raise CheckpointError(f"{path} carries no tokenizer")
    tokenizer_bytes = tensor_to_bytes(state["tokenizer"])
    try:
        tokenizer = Tokenizer.from_bytes(tokenizer_bytes)
    except (RuntimeError, ValueError, OSError) as err:  # sentencepiece's parse errors
        raise CheckpointCorrupt(
            f"{path}: its tokenizer cannot be read (corrupt?): {_first_sentence(err)}"
        ) from None
    pieces = (tokenizer.vocab_size, tokenizer.target_vocab_size)
    sizes = (config.model.vocab_size, config.model.target_vocab_size)
    if pieces != sizes:  # its ids would not be the model's: a wrong piece or an IndexError
        raise CheckpointError(
            f"{path}: its model has a vocabulary of {sizes[0]} pieces "
            + (f"({sizes[1]} on the target side) " if sizes[1] != sizes[0] else "")
            + f"but its tokenizer {pieces[0]}"
            + (f" ({pieces[1]} on the target side)" if pieces[1] != pieces[0] else "")
            + ": it was trained with a model.vocab_size that is not its data's"
        )
    labels = [str(name) for name in state.get("labels") or []]
    if task == "classify" and len(labels) != config.model.n_classes:
        raise CheckpointError(f"{path}: {len(labels)} class names for {config.model.n_classes}")
    return LoadedModel(model, config, tokenizer, labels, path, tokenizer_bytes)


def load_for_inference(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[TranslationModel, RunConfig, Tokenizer]:
    """The translation model (eval mode, on ``device``), its config and its tokenizer from a
    checkpoint file or a run directory (see :func:`resolve_checkpoint`)."""
    loaded = load_model(path, device, tasks=("translation",))
    assert isinstance(loaded.model, TranslationModel)
    return loaded.model, loaded.config, loaded.tokenizer
