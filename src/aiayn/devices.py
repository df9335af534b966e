"""Which device to run on."""

from __future__ import annotations

import contextlib
import os
import platform
import time

import torch

from aiayn.errors import UserError


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """The device for ``requested`` ("auto", "cpu", "cuda", "cuda:1", ...): "auto" and "cuda"
    mean ``cuda:LOCAL_RANK`` (the CPU for "auto" without CUDA). A device that does not exist
    here is a :class:`UserError`, not a failure at the first tensor moved there."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {requested!r} (cpu, cuda, cuda:N, ...)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {requested!r} was requested but CUDA is not available")
        if device.index is None:
            return torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise UserError(f"device {requested!r}: this machine has {count} CUDA device(s)")
    elif device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as err:
            raise UserError(f"device {requested!r} is not available here: {err}") from None
    return device


def describe_host(device: torch.device) -> str:
    """What ``device`` is, in words, for a run's record and a model card: the CUDA device's
    name and count, or the CPU's model name (as /proc/cpuinfo has it) and its logical CPUs."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({torch.cuda.device_count()} CUDA device(s))"
    name = platform.processor() or platform.machine() or "unknown CPU"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else os.cpu_count()
    return f"{name}, {cpus} logical CPUs" if cpus else name


def inference_attention(device: torch.device | str) -> contextlib.AbstractContextManager[None]:
    """The attention kernels for inference on ``device``. On CUDA: flash, memory-efficient
    or math, never cuDNN's. PyTorch takes cuDNN's kernel for bf16 and fp16 where it can, and
    cuDNN builds a plan for every new shape; decoding meets a new shape at every step and
    batch (a longer cache, another source length), so that a first half-precision pass would
    spend most of its time building plans (docs/performance.md, "On a GPU")."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(backends)


def _product_seconds(threads: int, size: int = 384, repeats: int = 8) -> float:
    """Seconds of ``repeats`` float32 products of two (size, size) matrices on ``threads``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size)
        torch.mm(a, a)  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, a)
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(before)


def busy_cpu_slowdown(rounds: int = 5) -> float:
    """How many times slower the process's CPU threads run a small matrix product than one
    thread does (best of ``rounds``, interleaved): well below 1 on an idle machine, above 1
    when another process holds the cores and the threads wait for each other. 0.0 with one
    thread."""
    threads = torch.get_num_threads()
    if threads <= 1:
        return 0.0
    many = min(_product_seconds(threads) for _ in range(rounds))
    one = min(_product_seconds(1) for _ in range(rounds))
    return many / max(one, 1e-9)
