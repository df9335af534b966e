"""Process-wide settings that make PyTorch faster on the CPU.

PyTorch's CPU tensors come straight from the C library's ``malloc``. glibc hands a block above
its *mmap threshold* (128 KiB, rising with use to at most 32 MiB) to the kernel on ``free`` and
maps fresh pages for the next one; it also gives back the top of the heap once more than the
*trim threshold* is free there. A decoder step or a training update frees and re-allocates the
same multi-megabyte tensors every time (a 256 × 8,000 vocabulary matrix, activations and
gradients), so each of them is faulted in again, page by page (before the decoder kept its
buffers: 76,000 minor page faults in one beam-4 decode of 64 sentences, 11% of its time).

:func:`retain_freed_memory` raises both thresholds to 1 GiB, so freed blocks stay in the heap
and the next tensor of the same size reuses them without a page fault: the behaviour of a
caching allocator (CTranslate2 has one; PyTorch's CPU default does not). A training run
allocates the same sizes at every update, so its peak RSS does not grow (what is kept was in
use at the peak) and updates are 4-7% faster in the benchmark; the process does not shrink
after its peak. :class:`aiayn.training.trainer.Trainer` calls it; ``AIAYN_MALLOC=system``
leaves ``malloc`` as it is.

Decoding does not use it: translating a file allocates caches of a different size for every
batch, and a heap that never gives memory back fragments (``aiayn translate`` on Multi30k
val: 770-850 MB instead of 540 MB peak RSS, for 3%); the decoder step instead keeps its one
vocabulary-sized matrix in the cache (``DecoderCache.scratch``). The setting is for the whole
process, though: where one process trains and then translates (``aiayn demo``), the
translation runs with it too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

ENV_VAR = "AIAYN_MALLOC"
THRESHOLD = 1 << 30  # 1 GiB: blocks below it come from (and go back to) the heap

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to 1 GiB (once per process).

    Returns True when the settings are in force: on Linux with glibc, unless ``AIAYN_MALLOC``
    is ``system``. Elsewhere (macOS, Windows, musl) it does nothing and returns False.
    """
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if os.environ.get(ENV_VAR, "").strip().lower() == "system":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, THRESHOLD)
    )
