"""torchrun / DistributedDataParallel plumbing: one process per device, gloo on CPU, NCCL on CUDA.

Under ``torchrun`` the environment carries ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; without
it the run is a single process and every collective below is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from aiayn.devices import pick_device


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: its rank among ``world_size`` and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(requested_device: str = "auto") -> DistInfo:
    """Join the process group that torchrun describes in the environment (if any)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(requested_device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    return DistInfo(rank, world_size, local_rank, device)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def reduce_device(info: DistInfo) -> torch.device:
    """Where collectives run: the process's CUDA device under NCCL, else the CPU (gloo, or a
    single process)."""
    if info.distributed and info.device.type == "cuda":
        return info.device
    return torch.device("cpu")


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a tensor (float64 stays float64) over all ranks, in place; returns it."""
    if info.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj``, in rank order (a one-element list without DDP)."""
    if not info.distributed:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()
