"""What the CPU can do."""

from __future__ import annotations

import platform

import torch


def cpu_has_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively. On x86, AVX512-BF16 or AMX as PyTorch's
    CPU feature checks report; elsewhere (Arm's bf16 extension, which PyTorch does not
    report) and where those checks are missing, assume it does."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    checks = [
        getattr(torch.cpu, name, None)
        for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    if any(check is None for check in checks):
        return True
    return any(check() for check in checks if check is not None)
