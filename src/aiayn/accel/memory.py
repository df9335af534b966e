"""glibc's malloc thresholds, raised while an acceleration holds them (Linux with glibc).

PyTorch's CPU tensors come straight from ``malloc``. glibc gives a block above its *mmap
threshold* (128 KiB, rising with use to at most 32 MiB) back to the kernel on ``free`` and maps
fresh pages for the next one, and gives back the top of the heap once more than the *trim
threshold* is free there. A training update or a decoder step frees and allocates the same
multi-megabyte tensors every time, so each would be faulted in again, page by page. With the
thresholds raised, freed blocks stay in the heap and are reused without page faults, as a
caching allocator would (figures: docs/performance.md):

- :data:`TRAIN`: both thresholds at 1 GiB. A run allocates the same sizes at every update, so
  its peak does not grow; the process does not shrink after its peak.
- :data:`DECODE`: blocks under 16 MiB from the heap and up to 32 MiB free at its top kept: a
  step's activations and a small batch's caches are reused, while the caches of a big batch are
  still mapped afresh and given back, so that a heap of many batches' sizes does not fragment.
  A decode whose packed projection makes (rows, V) logits above 16 MiB at every step holds the
  mmap threshold above them while it lives
  (:meth:`aiayn.accel.linear.LogitsBuffer.keep_in_heap`).

The thresholds are the process's: while several holders are alive the largest applies; when
the last is released, glibc's defaults (128 KiB each) are set again, without glibc's automatic
raising of the mmap threshold, which an explicit setting switches off for good.
``AIAYN_MALLOC=system`` leaves ``malloc`` alone.

The thresholds are the process's, not the model's: :func:`aiayn.accel.accelerate` holds them
only with ``process_settings=True``, which aiayn's commands pass and library code does not.
mallopt(3) has no Python binding: it is called through ``ctypes`` in glibc (not in
PyTorch).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
import platform
import threading
from collections.abc import Callable
from functools import cache

ENV_VAR = "AIAYN_MALLOC"
# (mmap threshold, trim threshold) in bytes
TRAIN = (1 << 30, 1 << 30)
DECODE = (16 << 20, 32 << 20)
GLIBC_DEFAULT = (128 << 10, 128 << 10)

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Holders come and go on several threads (a server's decodes, finalizers of their caches).
_lock = threading.Lock()
_holders: dict[int, tuple[int, int]] = {}
_tokens = itertools.count(1)
_in_force: tuple[int, int] | None = None


def hold(thresholds: tuple[int, int]) -> int | None:
    """Raise the thresholds to at least ``thresholds`` until :func:`release` of the returned
    token; None (and nothing changed) where this module leaves malloc alone."""
    mallopt = _mallopt()
    if mallopt is None:
        return None
    with _lock:
        token = next(_tokens)
        _holders[token] = thresholds
        if not _apply(mallopt):
            del _holders[token]
            return None
    return token


def release(token: int | None) -> None:
    """Give up a :func:`hold`; the thresholds fall to what the remaining holders need."""
    with _lock:
        if token is None or _holders.pop(token, None) is None:
            return
        mallopt = _mallopt()
        if mallopt is not None:
            _apply(mallopt)


def in_force() -> tuple[int, int] | None:
    """The (mmap, trim) thresholds this module has set, or None when none are held."""
    return _in_force


def _apply(mallopt: Callable[[int, int], int]) -> bool:
    """Set the thresholds the holders need (glibc's defaults when there are none)."""
    global _in_force
    if _holders:
        wanted = (max(t[0] for t in _holders.values()), max(t[1] for t in _holders.values()))
    elif _in_force is None:
        return True
    else:
        wanted = GLIBC_DEFAULT
    if wanted == _in_force:
        return True
    ok = bool(mallopt(_M_MMAP_THRESHOLD, wanted[0]) and mallopt(_M_TRIM_THRESHOLD, wanted[1]))
    _in_force = wanted if ok and _holders else None
    return ok


def _glibc() -> ctypes.CDLL | None:
    """glibc, or None where this module leaves malloc alone."""
    if os.environ.get(ENV_VAR, "").strip().lower() == "system":
        return None
    if platform.libc_ver()[0] != "glibc":
        return None
    return _libc()


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None where this module leaves malloc alone."""
    libc = _glibc()
    try:
        mallopt = None if libc is None else libc.mallopt
    except AttributeError:
        return None
    if mallopt is None:
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


@cache
def _libc() -> ctypes.CDLL | None:
    """The C library (Linux), or None."""
    if platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
