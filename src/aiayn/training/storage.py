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
def writing(path: Path, what: str, needed: int = 0, in_run: bool = True) -> Iterator[None]:
    """Turn a full disk or a read-only directory while writing ``path`` (``what`` it is,
    ``needed`` bytes) into a :class:`RunDirectoryError`; other errors pass through.
    ``in_run``: ``path`` is a training run's, and the message says how the run goes on."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        # torch.save's zip writer raises a RuntimeError: the OSError of the failed write is
        # chained to it where there was one (a later record's "unexpected pos").
        cause = err if isinstance(err, OSError) else _chained_os_error(err)
        if cause is not None and cause.errno in _FULL:
            raise _full(path, what, needed, in_run) from None
        if cause is not None and cause.errno in _READ_ONLY:
            raise _read_only(path, what, cause, in_run) from None
        if isinstance(err, RuntimeError) and "write" in str(err).lower():
            free = _free(path.parent)  # a write failure on a disk without room
            if free is not None and free < max(needed, 1):
                raise _full(path, what, needed, in_run) from None
        raise


def _chained_os_error(err: BaseException) -> OSError | None:
    """The first OSError among the exceptions ``err`` was raised from or while handling."""
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        if isinstance(link, OSError) and link.errno is not None:
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _full(path: Path, what: str, needed: int, in_run: bool = True) -> RunDirectoryError:
    free = _free(path.parent)
    have = f", {_mb(free)} free" if free is not None else ""
    start = (
        f"no space left on the device of {path.parent} to write {what} {path.name} (it needs "
        f"about {_mb(needed)}{have}); free some space there"
    )
    if not in_run:
        return RunDirectoryError(f"{start}, or write it elsewhere")
    return RunDirectoryError(
        f"{start}, or keep fewer checkpoints (train.keep_last; train.average_last of them "
        "are kept at least, or with train.average_from those it averages, and best.pt "
        "besides), then run the same command again: the run resumes from its last checkpoint"
    )


def _read_only(path: Path, what: str, err: OSError, in_run: bool = True) -> RunDirectoryError:
    if not in_run:
        return RunDirectoryError(
            f"cannot write {what} {path} ({err.strerror or err}): write it elsewhere"
        )
    return RunDirectoryError(
        f"cannot write {what} {path} ({err.strerror or err}): the run directory has become "
        "read-only or lost its permissions; its last checkpoint is intact: make it writable "
        "(or copy it elsewhere) and run the same command again to resume"
    )
