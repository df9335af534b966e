import pytest

from aiayn.config import load_config
from aiayn.model.transformer import Transformer
from aiayn.training.optim import build_optimizer, build_schedule, inverse_sqrt_lr


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
