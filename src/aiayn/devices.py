"""Which device to run on."""

from __future__ import annotations

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
