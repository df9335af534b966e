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

Decoding keeps a bounded version, :func:`reuse_decoding_memory` (called by
:class:`aiayn.inference.translator.Translator` on the CPU): blocks under 16 MiB come from the
heap, and up to 32 MiB free at its top stays there. A step's activations, the search's
temporaries and a small batch's caches and vocabulary matrix are then reused from one step or
batch to the next (the benchmark's beam 4 over 64 sentences: ~14,500 minor page faults per
decode → ~0, 3-4% faster; greedy ~3%), while larger blocks, such as the caches of a big
batch, are still mapped afresh and given back, so that a heap of many batches' different sizes
does not fragment. Keeping everything instead (1 GiB, as in training) made ``aiayn
translate`` on Multi30k val peak at 770-850 MB instead of 540 MB; with the bounded setting it
peaks at 547-548 MB (528-554 MB without), in the same time (4.8-5.2 s). The settings are for
the whole process and are only ever raised: where one process trains and then translates
(``aiayn demo``), the translation runs with the training setting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Callable

ENV_VAR = "AIAYN_MALLOC"
THRESHOLD = 1 << 30  # 1 GiB: blocks below it come from (and go back to) the heap
DECODING_MMAP_THRESHOLD = 16 << 20  # decoding: blocks below 16 MiB come from the heap
DECODING_TRIM_THRESHOLD = 32 << 20  # ... and up to 32 MiB free at its top stays there

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# The (mmap, trim) thresholds this module has set, or False once it found it cannot (not
# glibc, or AIAYN_MALLOC=system); None before the first call.
_in_force: tuple[int, int] | bool | None = None


def retain_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to 1 GiB (training).

    Returns True when the settings are in force: on Linux with glibc, unless ``AIAYN_MALLOC``
    is ``system``. Elsewhere (macOS, Windows, musl) it does nothing and returns False.
    """
    return _raise_thresholds(THRESHOLD, THRESHOLD)


def reuse_decoding_memory() -> bool:
    """Keep freed blocks under 16 MiB in the heap, and up to 32 MiB free at its top
    (decoding); a larger setting already in force (training's) stays. Returns True when these
    thresholds or larger ones are in force, under the same conditions as
    :func:`retain_freed_memory`."""
    return _raise_thresholds(DECODING_MMAP_THRESHOLD, DECODING_TRIM_THRESHOLD)


def _raise_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """Set the thresholds to at least these values (never lower what this module set)."""
    global _in_force
    if _in_force is False:
        return False
    if isinstance(_in_force, tuple):
        if _in_force[0] >= mmap_threshold and _in_force[1] >= trim_threshold:
            return True
        mmap_threshold = max(mmap_threshold, _in_force[0])
        trim_threshold = max(trim_threshold, _in_force[1])
    mallopt = _mallopt()
    if mallopt is None or not (
        mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    ):
        _in_force = False
        return False
    _in_force = (mmap_threshold, trim_threshold)
    return True


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None where this module leaves malloc alone."""
    if os.environ.get(ENV_VAR, "").strip().lower() == "system":
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def cpu_has_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively. On x86, AVX512-BF16 or AMX as PyTorch's
    CPU feature checks report; elsewhere (Arm's bf16 extension, which PyTorch does not
    report) and where those checks are missing, assume it does."""
    import torch

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    checks = [
        getattr(torch.cpu, name, None)
        for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    if any(check is None for check in checks):
        return True
    return any(check() for check in checks if check is not None)
