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
A compiled decoder step's weights, read in place from its library's file
(:mod:`aiayn.accel.library_constants`), are the kernel's to page in and out:
:func:`release_file_pages` hands back this process's pages of that file (Linux; elsewhere it
does nothing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
import os
import platform
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path

from torch import Tensor

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


# -- pages of mapped files ---------------------------------------------------------------------

_MADV_DONTNEED = 4  # a file's pages leave this process; the kernel's page cache keeps them
_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim the range's pages; a private page written to stays
_PAGE = mmap.PAGESIZE

# (start, end, path) of a mapping of a file
Mapping = tuple[int, int, str]


def file_mappings() -> list[Mapping]:
    """(start, end, path) of this process's mappings of files that are not executable code,
    adjacent parts of one file's mapping as one; empty where /proc/self/maps cannot be read."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    found: list[Mapping] = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or "x" in fields[1] or not fields[5].startswith("/"):
            continue
        start, end = (int(a, 16) for a in fields[0].split("-"))
        if found and found[-1][1] == start and found[-1][2] == fields[5]:
            # One mapping that advice split in parts (madvise gives a range flags of its own).
            found[-1] = (found[-1][0], end, fields[5])
        else:
            found.append((start, end, fields[5]))
    return found


@cache
def _libc() -> ctypes.CDLL | None:
    """The C library (Linux), or None."""
    if platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _madvise(start: int, end: int, advice: int) -> int:
    """madvise(2) over the whole pages of [start, end): the bytes advised (0 where none)."""
    start, end = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    libc = _libc()
    if end <= start or libc is None:
        return 0
    ok = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) == 0
    return end - start if ok else 0


def _pages_can_go(path: str) -> bool:
    """Whether Linux hands back this process's pages of the file ``path``: only to its owner
    or to a process that may write it (``MADV_PAGEOUT`` skips a file's pages otherwise)."""
    try:
        return os.stat(path).st_uid == os.geteuid() or os.access(path, os.W_OK)
    except (OSError, AttributeError):
        return False


def _mapped_span(tensor: Tensor, mappings: list[Mapping]) -> tuple[int, int, str] | None:
    """The bytes of ``tensor`` (contiguous, on the CPU) and the file, where they lie in a
    mapping of one."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for lo, hi, path in mappings:
        if lo <= start and end <= hi:
            return start, end, path
    return None


def page_out(tensor: Tensor, mappings: list[Mapping] | None = None, *, cached: bool = False) -> int:
    """Hand back the pages of ``tensor`` if its bytes are mapped from a file whose pages Linux
    hands back for this process, and return how many bytes were advised (0 for memory of the
    process's own). Nothing is lost: a page read again comes back from the file (a file on a
    disk; tmpfs keeps its pages in memory, where they stay). ``cached``: they leave this
    process and stay in the kernel's page cache (``MADV_DONTNEED``, which also takes a page
    that another mapping holds, where ``MADV_PAGEOUT`` leaves it; for a mapping nothing
    writes)."""
    span = _mapped_span(tensor, file_mappings() if mappings is None else mappings)
    if span is None or not (cached or _pages_can_go(span[2])):
        return 0
    return _madvise(span[0], span[1], _MADV_DONTNEED if cached else _MADV_PAGEOUT)


def release_file_pages(path: Path, *, cached: bool = False) -> int:
    """Hand back the pages this process holds of ``path``'s non-executable mappings over
    1 MiB, and return how many bytes of mappings were advised (a compiled library's
    weights: mapped by AOTInductor's loader, which copies them, and by
    :mod:`aiayn.accel.library_constants`, from which its steps then read them). ``cached``:
    the pages stay in the kernel's page cache, to be read again soon without the disk."""
    advised = 0
    advice = _MADV_DONTNEED if cached else _MADV_PAGEOUT
    for start, end, name in file_mappings():
        if name == str(path) and end - start > 1 << 20 and (cached or _pages_can_go(name)):
            advised += _madvise(start, end, advice)
    return advised
