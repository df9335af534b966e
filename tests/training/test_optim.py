import itertools

import pytest

from aiayn.config import load_config
from aiayn.errors import ConfigError
from aiayn.model.transformer import Transformer
from aiayn.training.optim import (
    build_optimizer,
    build_schedule,
    inverse_sqrt_lr,
    linear_decay_lr,
)


@pytest.mark.parametrize("step", [1, 2, 100, 3999, 4000, 4001, 10000, 100000])
def test_schedule_is_equation_3(step):
    d_model, warmup = 512, 4000
    # Eq. 3 written out: lrate = d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5)
    expected = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    assert inverse_sqrt_lr(step, d_model, warmup) == pytest.approx(expected, rel=1e-12)
    assert inverse_sqrt_lr(step, d_model, warmup, scale=2.0) == pytest.approx(2 * expected)


def test_schedule_peaks_at_warmup():
    values = [inverse_sqrt_lr(s, 512, 4000) for s in range(3990, 4011)]
    assert max(values) == inverse_sqrt_lr(4000, 512, 4000)
    assert inverse_sqrt_lr(4000, 512, 4000) == pytest.approx(512**-0.5 * 4000**-0.5)
    assert inverse_sqrt_lr(0, 512, 4000) == 0.0


def test_optimizer_uses_the_papers_adam_and_schedule_resumes():
    config = load_config(overrides=["preset=tiny", "train.warmup_steps=10"])
    model = Transformer(config.model)
    optimizer = build_optimizer(model, config.train)
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9
    # The shared embedding is one parameter: counted once.
    assert len(group["params"]) == len({id(p) for p in model.parameters()})
    schedule = build_schedule(optimizer, 32, config.train)
    assert group["lr"] == inverse_sqrt_lr(1, 32, 10)
    for k in range(1, 15):
        optimizer.step()
        schedule.step()
        assert group["lr"] == inverse_sqrt_lr(k + 1, 32, 10)
    state = schedule.state_dict()
    other_opt = build_optimizer(Transformer(config.model), config.train)
    other = build_schedule(other_opt, 32, config.train)
    other_opt.load_state_dict(optimizer.state_dict())
    other.load_state_dict(state)
    other_opt.step()
    other.step()
    assert other_opt.param_groups[0]["lr"] == inverse_sqrt_lr(16, 32, 10)


def test_linear_schedule_warms_up_as_equation_3_then_falls_to_zero():
    d_model, warmup, total = 256, 500, 9000
    for step in (1, 250, 500):
        assert linear_decay_lr(step, d_model, warmup, total, 0.4) == inverse_sqrt_lr(
            step, d_model, warmup, 0.4
        )
    peak = 0.4 * d_model**-0.5 * warmup**-0.5
    rates = [linear_decay_lr(s, d_model, warmup, total, 0.4) for s in range(warmup, total + 2)]
    steps = [a - b for a, b in itertools.pairwise(rates)]
    # The same fall every update, from the peak to zero right after the last update.
    assert steps == pytest.approx([peak / (total + 1 - warmup)] * len(steps), rel=1e-9)
    assert rates[-2] > 0.0 and rates[-1] == 0.0
    assert linear_decay_lr(total + 100, d_model, warmup, total, 0.4) == 0.0
    with pytest.raises(ValueError, match="must exceed warmup_steps"):
        linear_decay_lr(10, d_model, warmup, warmup, 0.4)


def test_linear_schedule_is_chosen_by_the_config_and_needs_max_steps():
    config = load_config(
        overrides=[
            "preset=tiny",
            "train.warmup_steps=10",
            "train.max_steps=40",
            "train.lr_schedule=linear",
        ]
    )
    model = Transformer(config.model)
    optimizer = build_optimizer(model, config.train)
    schedule = build_schedule(optimizer, 32, config.train)
    for k in range(45):
        assert optimizer.param_groups[0]["lr"] == linear_decay_lr(k + 1, 32, 10, 40)
        optimizer.step()
        schedule.step()
        if k == 20:  # a resumed run continues on the same line
            other_opt = build_optimizer(Transformer(config.model), config.train)
            other = build_schedule(other_opt, 32, config.train)
            other_opt.load_state_dict(optimizer.state_dict())
            other.load_state_dict(schedule.state_dict())
            assert other_opt.param_groups[0]["lr"] == linear_decay_lr(22, 32, 10, 40)
    with pytest.raises(ConfigError, match=r"train\.max_steps above train\.warmup_steps=10"):
        load_config(
            overrides=[
                "preset=tiny",
                "train.warmup_steps=10",
                "train.max_steps=0",
                "train.lr_schedule=linear",
            ]
        )
