"""Writing into the run directory when the disk is full or read-only: one line that says what
happened and what to do, instead of a traceback.

``torch.save`` reports a failed write as a ``RuntimeError`` of its zip writer, without the
operating system's error number; such a failure is read as a full disk when the file system
has less free space than the file needed, else passed on.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import Tensor

from aiayn.errors import UserError

_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


class RunDirectoryError(UserError):
    """The run directory cannot be written (full, read-only, no permission)."""


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a (nested) checkpoint dict: about its size on disk."""
    seen: set[int] = set()

    def walk(value: Any) -> int:
        if isinstance(value, Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() in seen:
                return 0
            seen.add(storage.data_ptr())
            return storage.nbytes()
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(walk(v) for v in value)
        return 0

    return walk(obj)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 1e6 else f"{n / 1e3:,.0f} kB"


def _free(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


@contextmanager
def writing(path: Path, what: str, needed: int = 0) -> Iterator[None]:
    """Turn a full disk or a read-only run directory while writing ``path`` (``what`` it is,
    ``needed`` bytes) into a :class:`RunDirectoryError`; other errors pass through."""
    try:
        yield
    except OSError as err:
        if err.errno in _FULL:
            raise _full(path, what, needed) from None
        if err.errno in _READ_ONLY:
            raise _read_only(path, what, err) from None
        raise
    except RuntimeError as err:
        free = _free(path.parent)
        if "write" in str(err).lower() and free is not None and free < max(needed, 1):
            raise _full(path, what, needed) from None
        raise


def _full(path: Path, what: str, needed: int) -> RunDirectoryError:
    free = _free(path.parent)
    have = f", {_mb(free)} free" if free is not None else ""
    return RunDirectoryError(
        f"no space left on the device of {path.parent} to write {what} {path.name} (it needs "
        f"about {_mb(needed)}{have}); free some space there, or lower train.keep_last (older "
        "checkpoints are removed before the next save), then run the same command again: "
        "the run resumes from its last checkpoint"
    )


def _read_only(path: Path, what: str, err: OSError) -> RunDirectoryError:
    return RunDirectoryError(
        f"cannot write {what} {path} ({err.strerror or err}): the run directory has become "
        "read-only or lost its permissions; its last checkpoint is intact: make it writable "
        "(or copy it elsewhere) and run the same command again to resume"
    )
