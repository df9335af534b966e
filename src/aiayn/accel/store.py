"""Where the CPU speed layer keeps what it builds, and which of those files it will load.

Compiled decoder steps (:mod:`aiayn.accel.compiled`) and aiayn's own kernels
(:mod:`aiayn.accel.panels`) are native code: they are kept in one directory of the user's cache
and loaded only from files that the user alone may write.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def compiled_dir() -> Path:
    """Where compiled steps are kept: ``compiled/`` in aiayn's cache directory
    (``$AIAYN_CACHE``, else ``$XDG_CACHE_HOME/aiayn``, else ``~/.cache/aiayn``)."""
    from aiayn.data.sources.download import default_cache_dir

    return default_cache_dir() / "compiled"


def trusted(path: Path) -> bool:
    """Whether ``path`` and its directory belong to this user and nobody else may write them
    (native code is loaded from it)."""
    getuid = getattr(os, "getuid", None)
    for item in (path, path.parent):
        info = item.stat()
        if getuid is not None and info.st_uid != getuid():
            return False
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return False
    return True


def require_trusted(path: Path) -> None:
    """Raise ``PermissionError`` where ``path`` is not :func:`trusted`."""
    if not trusted(path):
        raise PermissionError(f"{path}: not loaded: it or its directory is not this user's alone")
