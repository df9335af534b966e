"""Adam with the paper's hyper-parameters (§5.3) and the learning-rate schedule of Eq. 3."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from aiayn.config import TrainConfig


def inverse_sqrt_lr(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """Eq. 3: ``lrate = scale · d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5)``.

    ``step`` counts optimizer updates from 1 (the first update uses ``step = 1``). The formula
    is undefined at ``step = 0``; its limit, 0, is returned there.
    """
    if warmup_steps <= 0:
        raise ValueError(f"warmup_steps must be positive, got {warmup_steps}")
    if step <= 0:
        return 0.0
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def linear_decay_lr(
    step: int, d_model: int, warmup_steps: int, total_steps: int, scale: float = 1.0
) -> float:
    """Eq. 3's warmup, then a straight line from its peak to zero at ``total_steps``.

    The rise over the first ``warmup_steps`` updates and the peak are Eq. 3's; after the peak
    the rate falls linearly, by the same amount each update, to reach 0 right after update
    ``total_steps`` (the last update still moves the weights). For a
    run with a fixed budget of updates this ends at a settled model instead of Eq. 3's
    still-large rate (docs/training.md, "Learning-rate schedule").
    """
    if total_steps <= warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")
    if step <= warmup_steps:
        return inverse_sqrt_lr(step, d_model, warmup_steps, scale)
    peak = scale * d_model**-0.5 * warmup_steps**-0.5
    return peak * max(0.0, (total_steps + 1 - step) / (total_steps + 1 - warmup_steps))


def build_optimizer(model: nn.Module, train: TrainConfig) -> torch.optim.Adam:
    """Adam, β1 = 0.9, β2 = 0.98, ε = 1e-9 by default (§5.3).

    The base learning rate is 1.0: the schedule's factor *is* the learning rate. A shared
    embedding matrix appears once in ``model.parameters()``, so it gets one Adam state.

    With every parameter on the CPU or a CUDA device, Adam's fused kernel does the update: one
    pass per parameter instead of a dozen elementwise ones, the same algorithm
    (docs/performance.md).
    """
    params = list(model.parameters())
    fused = bool(params) and all(
        p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params
    )
    return torch.optim.Adam(
        params,
        lr=1.0,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_eps,
        weight_decay=train.weight_decay,
        fused=fused,
    )


def build_schedule(optimizer: torch.optim.Optimizer, d_model: int, train: TrainConfig) -> LambdaLR:
    """A LambdaLR whose ``last_epoch`` counts the updates done so far.

    After ``k`` calls of ``schedule.step()`` the learning rate is the schedule's rate at update
    ``k + 1`` (``inverse_sqrt_lr`` or, with ``train.lr_schedule = "linear"``,
    ``linear_decay_lr`` to zero at ``train.max_steps``): the rate the (k+1)-th update uses. Its
    ``state_dict()`` is plain data (the lambda itself is not saved), so a resumed run continues
    on exactly the same curve.
    """
    warmup, scale = train.warmup_steps, train.lr_scale
    total = train.max_steps

    if train.lr_schedule == "linear":

        def factor(updates_done: int) -> float:
            return linear_decay_lr(updates_done + 1, d_model, warmup, total, scale)

    else:

        def factor(updates_done: int) -> float:
            return inverse_sqrt_lr(updates_done + 1, d_model, warmup, scale)

    return LambdaLR(optimizer, lr_lambda=factor)
