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


def linear_time_lr(
    step: int,
    d_model: int,
    warmup_steps: int,
    minutes: float,
    warmup_minutes: float,
    total_minutes: float,
    scale: float = 1.0,
) -> float:
    """Eq. 3's warmup, then a straight line from its peak to zero as the training clock
    reaches ``total_minutes``.

    ``step`` counts updates from 1 as for :func:`inverse_sqrt_lr`; ``minutes`` is the training
    clock as update ``step`` starts, ``warmup_minutes`` its reading when update
    ``warmup_steps`` ended. Up to ``warmup_steps`` the rate is Eq. 3's; after, it is
    ``peak · (total_minutes - minutes) / (total_minutes - warmup_minutes)``, held within
    ``[0, peak]``: the peak right after warmup, 0 once the clock reaches ``total_minutes``.
    The rate falls by the same amount per minute on a fast host as on a slow one, so a run
    stopped by ``train.max_minutes`` ends at a settled model however many updates it made
    (docs/training.md, "Learning-rate schedule").
    """
    if step <= warmup_steps:
        return inverse_sqrt_lr(step, d_model, warmup_steps, scale)
    peak = scale * d_model**-0.5 * warmup_steps**-0.5
    span = total_minutes - warmup_minutes
    if span <= 0:  # warmup took the whole budget
        return 0.0
    return peak * min(1.0, max(0.0, (total_minutes - minutes) / span))


class LinearTimeLR(LambdaLR):
    """``train.lr_schedule = "linear_time"``: :func:`linear_time_lr` over the training clock.

    The trainer records the clock after each update (:meth:`record`) before ``step()`` sets the
    rate of the next one, so the rate is a function of recorded state alone: the update count,
    the last reading (``minutes``) and the reading when warmup ended (``warmup_minutes``,
    taken by the first ``step()`` past warmup). ``state_dict()`` is LambdaLR's, plain data,
    with those two readings: a resumed run goes on along the same line from the saved clock.
    The warmup, the peak and the budget are the config's, not the checkpoint's.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        d_model: int,
        warmup_steps: int,
        total_minutes: float,
        scale: float = 1.0,
    ) -> None:
        self.minutes = 0.0
        self.warmup_minutes: float | None = None

        def factor(updates_done: int) -> float:
            step = updates_done + 1
            if step > warmup_steps and self.warmup_minutes is None:
                self.warmup_minutes = self.minutes  # recorded as update warmup_steps ended
            warmup_minutes = self.minutes if self.warmup_minutes is None else self.warmup_minutes
            return linear_time_lr(
                step, d_model, warmup_steps, self.minutes, warmup_minutes, total_minutes, scale
            )

        super().__init__(optimizer, lr_lambda=factor)

    def record(self, minutes: float) -> None:
        """The training clock (``Trainer.minutes``) after an update, before ``step()``."""
        self.minutes = float(minutes)


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
    on exactly the same curve. With ``"linear_time"``, a :class:`LinearTimeLR` to zero at
    ``train.max_minutes``, whose clock the trainer records before each ``step()``.
    """
    warmup, scale = train.warmup_steps, train.lr_scale
    total = train.max_steps

    if train.lr_schedule == "linear_time":
        return LinearTimeLR(optimizer, d_model, warmup, train.max_minutes, scale)
    if train.lr_schedule == "linear":

        def factor(updates_done: int) -> float:
            return linear_decay_lr(updates_done + 1, d_model, warmup, total, scale)

    else:

        def factor(updates_done: int) -> float:
            return inverse_sqrt_lr(updates_done + 1, d_model, warmup, scale)

    return LambdaLR(optimizer, lr_lambda=factor)


def schedule_progress(train: TrainConfig, step: int, minutes: float) -> float | None:
    """How far along its schedule a run is after ``step`` updates and ``minutes`` of its
    training clock, as a fraction (1 at the end): of ``train.max_minutes`` for
    ``"linear_time"``, of ``train.max_steps`` for ``"linear"``; None for Eq. 3, which has no
    end. ``train.average_from`` compares checkpoints by it."""
    if train.lr_schedule == "linear_time":
        return minutes / train.max_minutes
    if train.lr_schedule == "linear":
        return step / train.max_steps
    return None


def describe_schedule(d_model: int, train: TrainConfig) -> str:
    """The learning-rate schedule of ``train`` in words, as a run reports it."""
    peak = train.lr_scale * d_model**-0.5 * train.warmup_steps**-0.5
    warmup = f"Eq. 3's warmup over {train.warmup_steps:,} updates to {peak:.3g}"
    if train.lr_schedule == "linear_time":
        return (
            f"{warmup}, then linear to zero at train.max_minutes={train.max_minutes:g} of "
            "the training clock, however many updates that is"
        )
    if train.lr_schedule == "linear":
        return f"{warmup}, then linear to zero at train.max_steps={train.max_steps:,}"
    return f"{warmup}, then Eq. 3's fall as 1/sqrt(update)"
