"""A run fitted to its time budget (train.lr_schedule = "linear_time", train.average_from) on
simulated hosts: the trainer's clock is patched so that every training batch takes a fixed
number of seconds, whatever the real machine does."""

import json
import types

import pytest
import torch

from aiayn.inference import loading
from aiayn.model.families import build_model
from aiayn.training import trainer as trainer_module
from aiayn.training.averaging import average_checkpoints
from aiayn.training.launch import RUN_INFO_NAME, train_and_average
from aiayn.training.metrics import read_metrics
from aiayn.training.trainer import Trainer
from tests.helpers import FixedSampler, ListCorpus, reverse_pairs, tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")

LENGTH, BATCH, PAIRS = 6, 8, 64
WARMUP = 10
# tiny_config's update_tokens (56) is one batch of 8 pairs of 6 tokens + EOS: one batch, one
# update. Seconds per update that make every clock reading a binary fraction of a minute, so
# that a resumed run's minutes (saved minutes + minutes since) equal the uninterrupted run's.
SLOW, FAST = 3.75, 0.46875


class SimulatedHost:
    """``time.monotonic`` as the trainer reads it: ``seconds`` pass with each training batch
    and no time otherwise. ``start``: where the clock stands (a new process's differs)."""

    def __init__(self, seconds: float, start: float = 1000.0) -> None:
        self.seconds = seconds
        self.now = start

    def monotonic(self) -> float:
        return self.now


class TimedCorpus(ListCorpus):
    def __init__(self, pairs, host: SimulatedHost) -> None:
        super().__init__(pairs)
        self.host = host

    def batch(self, indices):
        self.host.now += self.host.seconds
        return super().batch(indices)


def host_trainer(monkeypatch, run_dir, host: SimulatedHost, *overrides: str) -> Trainer:
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(monotonic=host.monotonic))
    run_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(
        "train.lr_schedule=linear_time",
        f"train.warmup_steps={WARMUP}",
        "train.max_steps=0",
        "train.log_interval=1",
        *overrides,
    )
    torch.manual_seed(config.train.seed)
    corpus = TimedCorpus(reverse_pairs(PAIRS, LENGTH, config.model.vocab_size, 0), host)
    sampler = FixedSampler([list(range(i, i + BATCH)) for i in range(0, PAIRS, BATCH)])
    return Trainer(
        config,
        build_model(config.model),
        corpus,
        sampler,
        run_dir,
        tokenizer_bytes=b"spm",
        show_progress=False,
        tensorboard=False,
    )


def logged(run_dir) -> list[tuple[int, float, float]]:
    """(update, minutes, the rate of the next update) after each update."""
    return [
        (r["step"], r["minutes"], r["lr"]) for r in read_metrics(run_dir) if r["kind"] == "train"
    ]


@pytest.mark.parametrize(("seconds", "updates"), [(SLOW, 32), (FAST, 256)])
def test_the_rate_reaches_zero_as_the_time_budget_ends_on_a_slow_and_a_fast_host(
    monkeypatch, tmp_path, seconds, updates
):
    host = SimulatedHost(seconds)
    trainer = host_trainer(monkeypatch, tmp_path, host, "train.max_minutes=2")
    peak = 32**-0.5 * WARMUP**-0.5  # tiny: d_model 32, lr_scale 1
    result = trainer.train()
    # Stopped by the clock at 120 s, whatever number of updates the host made by then.
    assert result.reason == "reached train.max_minutes=2"
    assert result.step == updates == 120 / seconds
    records = logged(tmp_path)
    assert [step for step, _, _ in records] == list(range(1, updates + 1))
    warmup_end = WARMUP * seconds / 60
    for step, minutes, lr in records[WARMUP - 1 :]:
        # A straight line in the clock from the peak (warmup's end) to zero at 2 minutes.
        assert minutes == step * seconds / 60
        assert lr == pytest.approx(peak * max(0.0, 2 - minutes) / (2 - warmup_end), rel=1e-9)
    # The last update ran at one update's worth of the fall, and the run ends at zero.
    _, _, last_rate = records[-2]
    assert last_rate == pytest.approx(peak * (seconds / 60) / (2 - warmup_end), rel=1e-9)
    assert last_rate < 0.05 * peak
    assert trainer.lr == 0.0


def test_a_resumed_run_keeps_its_time_schedule(monkeypatch, tmp_path):
    """A run stopped after 16 updates (past warmup) and resumed in a new process, whose
    clock starts elsewhere, makes the updates of the run never stopped, at the same rates,
    to the same weights."""
    budget = "train.max_minutes=1"
    straight = host_trainer(monkeypatch, tmp_path / "a", SimulatedHost(1.875), budget)
    assert straight.train().step == 32

    first = host_trainer(
        monkeypatch, tmp_path / "b", SimulatedHost(1.875), budget, "train.max_steps=16"
    )
    assert first.train().step == 16
    path, state = loading.latest_valid_checkpoint(tmp_path / "b")  # weights-only: plain data
    assert state["schedule"]["minutes"] == 0.5 and state["schedule"]["warmup_minutes"] == 0.3125
    torch.manual_seed(1234)
    later = SimulatedHost(1.875, start=50_000.0)
    second = host_trainer(monkeypatch, tmp_path / "b", later, budget)
    second.load_state_dict(state, path)
    result = second.train()
    assert result.reason == "reached train.max_minutes=1" and result.step == 32
    assert logged(tmp_path / "b") == logged(tmp_path / "a")
    assert second.lr == straight.lr == 0.0
    a, b = straight.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize(
    ("schedule", "average_from", "first"),
    [
        # 1.875 s per update, 1 minute: update k ends at k/32 of the budget.
        (["train.lr_schedule=linear_time", "train.max_minutes=1"], 0.5, 16),
        (["train.lr_schedule=linear_time", "train.max_minutes=1"], 0.7, 24),
        # By updates: 32 of max_steps=32; 0.7 of them is 22.4.
        (["train.lr_schedule=linear", "train.max_steps=32"], 0.7, 24),
    ],
)
def test_the_average_takes_exactly_the_checkpoints_of_the_final_fraction(
    monkeypatch, tmp_path, schedule, average_from, first
):
    run = tmp_path / "run"
    run.mkdir()  # with the run.json that aiayn train writes
    (run / RUN_INFO_NAME).write_text(json.dumps({"data": "somewhere"}))
    trainer = host_trainer(
        monkeypatch,
        run,
        SimulatedHost(1.875),
        *schedule,
        "train.save_interval_steps=2",
        "train.keep_last=2",  # fewer than the span: the span's checkpoints are kept anyway
        f"train.average_from={average_from}",
    )
    result = train_and_average(trainer)
    assert result.step == 32
    steps = list(range(first, 33, 2))
    kept = [int(p.name[5:13]) for p in loading.list_step_checkpoints(run)]
    assert kept == steps
    averaged = loading.load_checkpoint(result.averaged)
    assert averaged["metrics"]["averaged"] == len(steps)
    assert averaged["metrics"]["first_step"] == first
    expected = average_checkpoints(loading.list_step_checkpoints(run))
    assert all(torch.equal(averaged["model"][k], expected[k]) for k in expected)
    end = json.loads((run / RUN_INFO_NAME).read_text())["end"]
    assert end["updates"] == 32 and end["averaged"]["steps"] == steps
    assert (
        f"{len(steps)} checkpoints saved at or after {average_from:.0%}"
        in (end["averaged"]["checkpoints"])
    )


def test_no_checkpoint_in_the_span_averages_nothing(monkeypatch, tmp_path, capsys):
    """Stopped by train.max_steps before the span begins: no averaged.pt, and the run says
    why."""
    trainer = host_trainer(
        monkeypatch,
        tmp_path,
        SimulatedHost(1.875),
        "train.max_minutes=1",
        "train.max_steps=12",
        "train.save_interval_steps=2",
        "train.average_from=0.5",
    )
    result = train_and_average(trainer)
    assert result.step == 12 and result.averaged is None
    assert not (tmp_path / loading.AVERAGED_NAME).exists()
    assert "no checkpoint was saved at or after 50% of train.max_minutes=1" in (
        capsys.readouterr().err
    )


def test_a_resumed_run_averages_the_span_the_uninterrupted_one_does(monkeypatch, tmp_path):
    """Stopped inside the span (at update 20 of 32; the span begins at 16), resumed: the
    checkpoints' progress travels in the checkpoints, so the span's earlier ones stay kept and
    are averaged as in the run never stopped."""
    over = [
        "train.max_minutes=1",
        "train.save_interval_steps=2",
        "train.keep_last=2",
        "train.average_from=0.5",
    ]
    straight = host_trainer(monkeypatch, tmp_path / "a", SimulatedHost(1.875), *over)
    train_and_average(straight)
    first = host_trainer(
        monkeypatch, tmp_path / "b", SimulatedHost(1.875), *over, "train.max_steps=20"
    )
    assert train_and_average(first).step == 20
    path, state = loading.latest_valid_checkpoint(tmp_path / "b")
    assert state["progress"]["checkpoint_progress"] == {16: 0.5, 18: 18 / 32, 20: 20 / 32}
    second = host_trainer(monkeypatch, tmp_path / "b", SimulatedHost(1.875, start=7.0), *over)
    second.load_state_dict(state, path)
    assert train_and_average(second).step == 32

    def kept(run):
        return [p.name for p in loading.list_step_checkpoints(run)]

    assert (
        kept(tmp_path / "b")
        == kept(tmp_path / "a")
        == [f"step_{k:08d}.pt" for k in range(16, 33, 2)]
    )
    a = loading.load_checkpoint(tmp_path / "a" / loading.AVERAGED_NAME)
    b = loading.load_checkpoint(tmp_path / "b" / loading.AVERAGED_NAME)
    assert a["metrics"] == b["metrics"] and a["metrics"]["averaged"] == 9
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
