"""What the CPU can do, and which PyTorch the private operators were verified with."""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

import torch

# The PyTorch releases (major, minor) whose underscore-prefixed operators the levers that
# need them were verified with (tests/accel). PyTorch documents no entry point for a packed
# product: oneDNN's and MKL's (accel.linear) are such operators. On other releases those
# levers are off, and accelerate says why in one line (:func:`private_ops_unverified`).
VERIFIED_TORCH = ((2, 13),)


def torch_release() -> tuple[int, int]:
    """This PyTorch's (major, minor)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def unverified(what: str) -> str | None:
    """``what`` (something that uses PyTorch internals) and why it is off with this PyTorch,
    in one line, or None where this PyTorch is one of :data:`VERIFIED_TORCH`."""
    if torch_release() in VERIFIED_TORCH:
        return None
    verified = ", ".join(f"{major}.{minor}" for major, minor in VERIFIED_TORCH)
    return f"{what}, verified with PyTorch {verified} only (this is {torch.__version__})"


def private_ops_unverified() -> str | None:
    """Why the levers that call PyTorch's underscore-prefixed operators are off with this
    PyTorch, or None where it is one they were verified with."""
    return unverified("packed weights are off: they call PyTorch operators that are not public")


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@cache
def cpu_vendor() -> str:
    """The CPU's vendor string as /proc/cpuinfo has it (``GenuineIntel``, ``AuthenticAMD``),
    or "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def cpu_has_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively. On x86, AVX512-BF16 or AMX's bfloat16
    (its flags); elsewhere (Arm's bf16 extension, which PyTorch does not report) and where
    the flags cannot be read, assume it does."""
    flags = cpu_flags()
    if not x86() or not flags:
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16"})
