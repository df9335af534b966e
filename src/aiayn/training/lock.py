"""One process at a time in a run directory: ``RUN_DIR/.lock``, held with ``flock``.

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


class RunDirectoryBusy(UserError):
    """Another process trains into the run directory."""


def _holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


@contextlib.contextmanager
def run_lock(run_dir: str | Path) -> Iterator[None]:
    """Hold ``RUN_DIR/.lock`` for the block; :class:`RunDirectoryBusy` naming the holder's PID
    when another process holds it."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        raise UserError(f"{path}: cannot create the run's lock file ({err.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirectoryBusy(
                f"{run_dir} is in use by another aiayn train (PID {_holder(fd)}); wait for it to "
                "end or stop it, or train into another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
