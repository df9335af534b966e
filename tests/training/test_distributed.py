"""Two gloo processes on the CPU give the same parameters as one process on the same batches."""

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aiayn.inference import loading
from aiayn.model.families import build_model
from aiayn.training.distributed import DistInfo
from aiayn.training.trainer import Trainer
from tests.helpers import (
    TINY,
    FixedSampler,
    ListCorpus,
    make_reverse_data,
    reverse_pairs,
    tiny_config,
)

pytestmark = pytest.mark.usefixtures("single_thread")

LENGTH, BATCH, N_BATCHES, STEPS = 5, 4, 8, 3
TOKENS = BATCH * (LENGTH + 1)


def _rank_trainer(
    config: Any, model: Any, corpus: Any, sampler: Any, run_dir: Any, rank: int, world_size: int
) -> Trainer:
    """A quiet Trainer for process ``rank`` of ``world_size`` on the CPU."""
    return Trainer(
        config,
        model,
        corpus,
        sampler,
        run_dir,
        dist_info=DistInfo(rank, world_size, rank, torch.device("cpu")),
        show_progress=False,
        tensorboard=False,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _source(task: str) -> tuple[Any, list[str]]:
    """The examples of ``task`` and its update budget's overrides."""
    from tests.training.test_tasks import Labelled, Sequences

    if task == "translation":
        corpus = ListCorpus(reverse_pairs(BATCH * N_BATCHES, LENGTH, 64, seed=5))
        return corpus, [f"train.update_tokens={2 * TOKENS}"]
    if task == "lm":  # every sequence has the same length: each update is two batches
        sequences = Sequences("lm", BATCH * N_BATCHES)
        sequences.docs = [doc[:6] for doc in sequences.docs]
        return sequences, ["model.task=lm", f"train.update_tokens={2 * BATCH * 5}"]
    labelled = Labelled(BATCH * N_BATCHES)
    return labelled, [
        "model.task=classify",
        "model.n_classes=2",
        f"train.update_tokens={2 * BATCH}",
    ]


def _run(rank: int, world_size: int, run_dir: str, port: int, task: str = "translation") -> None:
    torch.set_num_threads(1)
    if world_size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    corpus, budget = _source(task)
    # Dropout off: each process draws its own dropout masks.
    config = tiny_config(f"train.max_steps={STEPS}", "model.dropout=0", *budget)
    torch.manual_seed(config.train.seed)
    model = build_model(config.model)
    batches = [list(range(i, i + BATCH)) for i in range(0, BATCH * N_BATCHES, BATCH)]
    # One process reads batches 0, 1, 2, ... two at a time; rank r of two reads r, r+2, ...
    sampler = FixedSampler(batches, shuffle=False, rank=rank, world_size=world_size)
    trainer = _rank_trainer(config, model, corpus, sampler, run_dir, rank, world_size)
    trainer.train()
    if world_size > 1:
        dist.destroy_process_group()


def test_two_gloo_processes_equal_one(tmp_path):
    _run(0, 1, str(tmp_path / "single"), 0)
    mp.spawn(_run, args=(2, str(tmp_path / "ddp"), _free_port()), nprocs=2, join=True)
    single = loading.load_checkpoint(loading.step_checkpoint_path(tmp_path / "single", STEPS))
    double = loading.load_checkpoint(loading.step_checkpoint_path(tmp_path / "ddp", STEPS))
    assert len(double["sampler"]) == 2 and len(double["rng"]) == 2
    assert double["sampler"][1] == {"epoch": 0, "position": STEPS}
    assert single["sampler"][0] == {"epoch": 0, "position": 2 * STEPS}
    assert double["progress"]["tokens"] == single["progress"]["tokens"] == STEPS * 2 * TOKENS
    for key, value in single["model"].items():
        torch.testing.assert_close(double["model"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    # Only rank 0 wrote: one directory, no stray temporary files.
    assert sorted(p.name for p in (tmp_path / "ddp" / "checkpoints").iterdir()) == [
        f"step_{STEPS:08d}.pt"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["lm", "classify"])
def test_two_gloo_processes_equal_one_for_the_other_families(tmp_path, task):
    _run(0, 1, str(tmp_path / "single"), 0, task)
    mp.spawn(_run, args=(2, str(tmp_path / "ddp"), _free_port(), task), nprocs=2, join=True)
    single = loading.load_checkpoint(loading.step_checkpoint_path(tmp_path / "single", STEPS))
    double = loading.load_checkpoint(loading.step_checkpoint_path(tmp_path / "ddp", STEPS))
    assert double["sampler"][1] == {"epoch": 0, "position": STEPS}
    assert double["progress"]["tokens"] == single["progress"]["tokens"]
    for key, value in single["model"].items():
        torch.testing.assert_close(double["model"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
def test_cli_under_torchrun(tmp_path):
    aiayn = Path(sys.executable).parent / "aiayn"
    if not aiayn.is_file():
        pytest.skip("the aiayn entry point is not installed next to this Python")
    data = make_reverse_data(tmp_path / "text", n_train=400, n_valid=20)
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(_free_port()), "--no-python", str(aiayn),
        "train", "--config", TINY,
        "--data", str(data), "--out", str(run), "--no-progress",
        "train.max_steps=6", "train.valid_interval=3", "train.save_interval_steps=3",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("done: reached train.max_steps=6") == 1  # rank 0 only
    assert "on 2 × cpu" in result.stderr
    state = loading.load_checkpoint(loading.step_checkpoint_path(run, 6))
    assert len(state["sampler"]) == 2
    assert (run / "averaged.pt").is_file() and (run / "best.pt").is_file()


def _run_timed(rank: int, world_size: int, run_dir: str, port: int) -> None:
    """train.lr_schedule=linear_time on a simulated host whose clock runs at another speed in
    each process (rank 0 of two: 6 s per update, rank 1: 15 s; one process: 6 s too); writes
    each process's rates and weights."""
    import types

    from aiayn.training import trainer as trainer_module

    torch.set_num_threads(1)
    if world_size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    clock = [100.0 * (rank + 1)]
    corpus = ListCorpus(reverse_pairs(BATCH * N_BATCHES, LENGTH, 64, seed=5))
    real_batch = corpus.batch

    def timed_batch(indices):  # one process reads two batches per update, two one each
        clock[0] += 3.0 if world_size == 1 else (6.0, 15.0)[rank]
        return real_batch(indices)

    corpus.batch = timed_batch  # type: ignore[method-assign]
    trainer_module.time = types.SimpleNamespace(monotonic=lambda: clock[0])  # type: ignore[assignment]
    config = tiny_config(
        "train.max_steps=6",
        "model.dropout=0",
        f"train.update_tokens={2 * TOKENS}",
        "train.lr_schedule=linear_time",
        "train.warmup_steps=2",
        "train.max_minutes=1",
    )
    torch.manual_seed(config.train.seed)
    batches = [list(range(i, i + BATCH)) for i in range(0, BATCH * N_BATCHES, BATCH)]
    sampler = FixedSampler(batches, shuffle=False, rank=rank, world_size=world_size)
    model = build_model(config.model)
    trainer = _rank_trainer(config, model, corpus, sampler, run_dir, rank, world_size)
    rates = []
    update = trainer._update

    def recorded_update():  # the rate each update takes
        rates.append(trainer.lr)
        return update()

    trainer._update = recorded_update  # type: ignore[method-assign]
    trainer.train()
    torch.save(
        {"rates": rates, "model": trainer.model.state_dict()}, Path(run_dir) / f"rank{rank}.pt"
    )
    if world_size > 1:
        dist.destroy_process_group()


def test_every_process_takes_rank_0s_clock_for_the_time_schedule(tmp_path):
    """Under torchrun the processes' clocks differ; the time-fitted rate is set from rank 0's
    in all of them, so their weights stay equal, and equal one process's with that clock."""
    (tmp_path / "single").mkdir()
    (tmp_path / "ddp").mkdir()
    _run_timed(0, 1, str(tmp_path / "single"), 0)
    mp.spawn(_run_timed, args=(2, str(tmp_path / "ddp"), _free_port()), nprocs=2, join=True)
    single = torch.load(tmp_path / "single" / "rank0.pt", weights_only=True)
    zero = torch.load(tmp_path / "ddp" / "rank0.pt", weights_only=True)
    one = torch.load(tmp_path / "ddp" / "rank1.pt", weights_only=True)
    # Past warmup (2 updates, 12 s) the rate falls with rank 0's clock, 6 s of 60 per update.
    peak = 32**-0.5 * 2**-0.5
    expected = [peak / 2, peak, *(peak * (60 - 6 * (k - 1)) / (60 - 12) for k in range(3, 7))]
    assert zero["rates"] == pytest.approx(expected, rel=1e-9)
    assert one["rates"] == zero["rates"]
    assert zero["rates"] == single["rates"]
    for key, value in zero["model"].items():
        assert torch.equal(one["model"][key], value), key
        torch.testing.assert_close(single["model"][key], value, rtol=1e-5, atol=1e-6, msg=key)
