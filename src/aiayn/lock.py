"""One process at a time in a run directory (``RUN_DIR/.lock``) or a data directory being
prepared (``DATA_DIR/.prepare.lock``), held with ``flock``.

The kernel releases the lock when the process ends, however it ends (``kill -9`` included),
so a crashed run never leaves the directory locked; the file itself stays, with the PID of the
last holder, for the message a second process gets. Where ``fcntl`` does not exist (Windows),
runs are not locked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from aiayn.errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".lock"
PREPARE_LOCK_NAME = ".prepare.lock"


class RunDirectoryBusy(UserError):
    """Another process trains into the run directory (or prepares the data directory)."""


def _holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


def run_lock(run_dir: str | Path) -> contextlib.AbstractContextManager[None]:
    """Hold ``RUN_DIR/.lock`` for the block; :class:`RunDirectoryBusy` naming the holder's PID
    when another process holds it."""
    return directory_lock(
        run_dir, LOCK_NAME, "aiayn train", "train into another directory", "the run's lock file"
    )


def prepare_lock(data_dir: str | Path) -> contextlib.AbstractContextManager[None]:
    """Hold ``DATA_DIR/.prepare.lock`` for the block, as :func:`run_lock` does a run's."""
    return directory_lock(
        data_dir,
        PREPARE_LOCK_NAME,
        "aiayn process preparing data",
        "prepare into another directory",
        "its lock file (is the directory writable?)",
    )


@contextlib.contextmanager
def directory_lock(
    directory: str | Path, name: str, holder: str, instead: str, what: str
) -> Iterator[None]:
    """Hold ``directory/name`` for the block; :class:`RunDirectoryBusy` naming the holder's
    PID when another process (``holder``) holds it. A lock file another user made, which this
    one may not write, is locked all the same (without the PID)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    path = Path(directory) / name
    try:
        fd, writable = os.open(path, os.O_RDWR | os.O_CREAT, 0o666), True
    except OSError as err:
        try:
            if not isinstance(err, PermissionError):
                raise
            fd, writable = os.open(path, os.O_RDONLY), False
        except OSError:
            raise UserError(f"{path}: cannot create {what} ({err.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirectoryBusy(
                f"{directory} is in use by another {holder} (PID {_holder(fd)}); wait for it to "
                f"end or stop it, or {instead}"
            ) from None
        if writable:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
