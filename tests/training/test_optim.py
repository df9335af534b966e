import itertools

import pytest
import torch

from aiayn.config import load_config
from aiayn.errors import ConfigError
from aiayn.model.transformer import Transformer
from aiayn.training.optim import (
    LinearTimeLR,
    build_optimizer,
    build_schedule,
    describe_schedule,
    inverse_sqrt_lr,
    linear_decay_lr,
    linear_time_lr,
    schedule_progress,
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


def test_time_schedule_warms_up_as_equation_3_then_falls_to_zero_with_the_clock():
    d_model, warmup, total, scale = 256, 500, 60.0, 0.4
    for step in (1, 250, 500):  # within warmup the clock is not read
        assert linear_time_lr(step, d_model, warmup, 7.0, 3.0, total, scale) == inverse_sqrt_lr(
            step, d_model, warmup, scale
        )
    peak = scale * d_model**-0.5 * warmup**-0.5
    warmup_end = 3.0  # the clock when update 500 ended
    minutes = [warmup_end + i * (total - warmup_end) / 10 for i in range(11)]
    rates = [linear_time_lr(501, d_model, warmup, m, warmup_end, total, scale) for m in minutes]
    assert rates[0] == pytest.approx(peak, rel=1e-12)
    assert rates == pytest.approx([peak * (10 - i) / 10 for i in range(11)], rel=1e-9, abs=1e-15)
    assert rates[-1] == 0.0
    # The update count after warmup does not matter, only the clock; past the budget, 0.
    assert linear_time_lr(9000, d_model, warmup, 31.5, warmup_end, total, scale) == pytest.approx(
        peak / 2
    )
    assert linear_time_lr(600, d_model, warmup, 61.0, warmup_end, total, scale) == 0.0
    # Warmup took the whole budget: nothing left to fall over.
    assert linear_time_lr(501, d_model, warmup, 60.0, 60.0, total, scale) == 0.0


def _time_schedule(config):
    optimizer = build_optimizer(Transformer(config.model), config.train)
    return optimizer, build_schedule(optimizer, 32, config.train)


def test_time_schedule_reads_the_recorded_clock_and_resumes_from_its_state(tmp_path):
    over = ["preset=tiny", "train.warmup_steps=4", "train.max_minutes=2"]
    config = load_config(overrides=[*over, "train.lr_schedule=linear_time"])
    optimizer, schedule = _time_schedule(config)
    assert isinstance(schedule, LinearTimeLR)
    peak = 32**-0.5 * 4**-0.5
    clock = [0.1 * k for k in range(1, 30)]  # minutes after each update: 0.1 per update
    lrs = []
    for k, minutes in enumerate(clock, start=1):
        lrs.append(optimizer.param_groups[0]["lr"])  # the rate update k uses
        optimizer.step()
        schedule.record(minutes)
        schedule.step()
        if k == 9:  # a checkpoint, as plain data that a weights-only load reads
            torch.save(
                {"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()},
                tmp_path / "state.pt",
            )
    assert lrs[:4] == [inverse_sqrt_lr(k, 32, 4) for k in range(1, 5)]
    # Update 5 starts as warmup ends (minute 0.4): the peak; then 1/16 of it per 0.1 minute.
    # Held at 0 once the clock passes 2 minutes.
    expected = [peak * max(0.0, 2.0 - clock[k - 2]) / (2.0 - 0.4) for k in range(5, 30)]
    assert lrs[4:] == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert lrs[19] > 0.0 and lrs[20:] == [0.0] * 9
    assert optimizer.param_groups[0]["lr"] == 0.0  # the clock passed 2 minutes

    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    assert saved["schedule"]["minutes"] == pytest.approx(0.9)
    assert saved["schedule"]["warmup_minutes"] == pytest.approx(0.4)
    other_opt, other = _time_schedule(config)
    other_opt.load_state_dict(saved["optimizer"])
    other.load_state_dict(saved["schedule"])
    resumed = []
    for minutes in clock[9:]:
        resumed.append(other_opt.param_groups[0]["lr"])
        other_opt.step()
        other.record(minutes)
        other.step()
    assert resumed == lrs[9:]
    # The budget is the config's: a resumed run given more minutes falls to zero later.
    longer = load_config(
        overrides=[*over[:2], "train.max_minutes=4", "train.lr_schedule=linear_time"]
    )
    more_opt, more = _time_schedule(longer)
    more_opt.load_state_dict(saved["optimizer"])
    more.load_state_dict(saved["schedule"])
    more_opt.step()
    more.record(1.0)
    more.step()
    assert more_opt.param_groups[0]["lr"] == pytest.approx(peak * (4.0 - 1.0) / (4.0 - 0.4))


def test_schedules_say_what_they_do_and_how_far_along_a_run_is():
    base = ["preset=tiny", "train.warmup_steps=10", "train.max_steps=40"]
    by_time = load_config(
        overrides=[*base, "train.lr_schedule=linear_time", "train.max_minutes=60"]
    )
    by_steps = load_config(overrides=[*base, "train.lr_schedule=linear"])
    paper = load_config(overrides=base)
    assert "linear to zero at train.max_minutes=60" in describe_schedule(32, by_time.train)
    assert "linear to zero at train.max_steps=40" in describe_schedule(32, by_steps.train)
    assert "1/sqrt(update)" in describe_schedule(32, paper.train)
    assert schedule_progress(by_time.train, 10, 45.0) == 0.75
    assert schedule_progress(by_steps.train, 30, 45.0) == 0.75
    assert schedule_progress(paper.train, 30, 45.0) is None
