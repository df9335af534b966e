"""``aiayn train`` / ``average`` / ``plot`` end to end in temporary directories."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from aiayn.cli import main
from aiayn.devices import describe_host
from aiayn.inference import loading
from tests.helpers import ROOT, TINY

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def data_dir(reverse_data_dir):
    return reverse_data_dir


def _exact_match(run_dir, data_dir) -> float:
    import aiayn.cli  # noqa: F401  (the translator imports the CLI's error types)
    from aiayn.inference.translator import Translator

    translator, _ = Translator.from_checkpoint(run_dir, decode_overrides={"beam_size": 1})
    sources = (data_dir / "valid.src").read_text().splitlines()
    references = (data_dir / "valid.tgt").read_text().splitlines()
    hypotheses = translator.translate(sources)
    return sum(h == r for h, r in zip(hypotheses, references, strict=True)) / len(references)


def test_tiny_model_learns_to_reverse_through_the_cli(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--config", TINY, "--data", str(data_dir), "--out", str(run)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "reached train.max_steps=500" in out and "averaged model" in out
    assert (run / "config.toml").is_file() and (run / "averaged.pt").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "valid"] == [250, 500]
    assert all(
        {"loss", "lr", "tgt_tokens_per_s"} <= r.keys() for r in records if r["kind"] == "train"
    )
    # An untrained model matches no line. The share after 500 updates moves with the CPU's
    # float rounding: 0.79 on an AMD EPYC with AVX2 only, 0.9 or more on an Intel Xeon.
    assert _exact_match(run, data_dir) >= 0.7
    # Decoding settings named and typed as the config file's [decode] keys.
    from aiayn.errors import ConfigError
    from aiayn.inference.translator import Translator

    for bad, message in (
        ({"beam": 2}, r"unknown key\(s\) decode\.beam; valid keys in \[decode\]"),
        ({"beam_size": "four"}, "decode.beam_size must be an integer, got 'four'"),
    ):
        with pytest.raises(ConfigError, match=message):
            Translator.from_checkpoint(run, decode_overrides=bad)

    # The written config reads back as the resolved one (vocabulary size from the data).
    from aiayn.config import load_config

    assert load_config(run / "config.toml").model.vocab_size == 13

    assert main(["average", str(run), "--last", "2", "--out", str(tmp_path / "avg.pt")]) == 0
    assert loading.load_checkpoint(tmp_path / "avg.pt")["kind"] == "model"
    assert main(["plot", str(run)]) == 0
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_config_that_does_not_fit_the_data_is_refused(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(run)]
    assert main([*args, "model.vocab_size=99"]) == 2
    assert "model.vocab_size=99 but the tokenizer" in capsys.readouterr().err
    assert main([*args, "model.max_positions=4"]) == 2
    assert "model.max_positions=4" in capsys.readouterr().err
    assert main([*args, "train.bogus=1"]) == 2
    assert "valid keys in [train]" in capsys.readouterr().err
    assert not (run / "checkpoints").exists()


def test_a_translation_model_goes_on_training_on_new_text(data_dir, tmp_path, capsys):
    first = tmp_path / "first"
    quick = ["--no-progress", "train.valid_interval=0", "train.average_last=0"]
    args = ["train", "--config", TINY, "--out", str(first), *quick, "train.max_steps=30"]
    assert main([*args, "--data", str(data_dir)]) == 0
    # New text of the same task, encoded with the first run's tokenizer.
    text = tmp_path / "text"
    text.mkdir()
    for name in ("train.src", "train.tgt"):
        lines = (data_dir / name).read_text(encoding="utf-8").splitlines()
        (text / name).write_text("\n".join(lines[:200]) + "\n", encoding="utf-8")
    prepare = ["prepare", "--train", str(text / "train"), "--valid", str(text / "train")]
    prepare += ["--src", "src", "--tgt", "tgt", "--out", str(tmp_path / "new")]
    assert main([*prepare, "--tokenizer", str(first)]) == 0
    assert (tmp_path / "new" / "spm.model").read_bytes() == (data_dir / "spm.model").read_bytes()
    # The second run is the first model's (a recipe of another shape: model.d_model=64),
    # and starts from its weights exactly. (Not compiling its decoder step at the end, as
    # the base preset would: 35-57 s of the suite, tested in tests/accel/test_compiled.py.)
    last = loading.load_checkpoint(first / "checkpoints" / "step_00000030.pt")
    second = tmp_path / "second"
    go_on = ["train", "--config", TINY, "--data", str(tmp_path / "new"), "--out", str(second)]
    go_on += [*quick, "train.max_steps=1", "train.lr_scale=0", "model.dropout=0.0"]
    go_on += ["train.compile_step=false"]
    init = f"train.init_from={first / 'checkpoints' / 'step_00000030.pt'}"
    assert main([*go_on, init, "preset=base"]) == 0
    started = loading.load_checkpoint(second / "checkpoints" / "step_00000001.pt")
    assert started["config"]["model"] == {**last["config"]["model"], "dropout": 0.0}
    for name, tensor in last["model"].items():
        assert torch.equal(started["model"][name], tensor), name
    # Data with a vocabulary of its own: refused before training, naming the remedy.
    own = tmp_path / "own"
    assert main([*prepare[:-1], str(own), "--vocab-size", "30"]) == 0
    capsys.readouterr()
    go_on[4], go_on[6] = str(own), str(tmp_path / "third")
    assert main([*go_on, init]) == 2
    assert "prepare the data with --tokenizer" in capsys.readouterr().err


def test_resume_falls_back_past_a_truncated_checkpoint(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    over = ["train.max_steps=6", "train.save_interval_steps=3", "train.valid_interval=0"]
    args = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(run), "--no-progress"]
    assert main([*args, *over, "train.average_last=0"]) == 0
    recorded = json.loads((run / "run.json").read_text())
    assert recorded["world_size"] == 1 and recorded["data"] == str(data_dir.resolve())
    assert recorded["host"] == describe_host(torch.device("cpu"))  # the model card's host
    newest = loading.step_checkpoint_path(run, 6)
    newest.write_bytes(newest.read_bytes()[:1000])
    capsys.readouterr()
    # Running again into the same RUN_DIR resumes (config and data from the run).
    code = main(["train", "--out", str(run), "train.max_steps=8", "train.average_last=0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "step_00000006.pt is unreadable" in err and "falling back" in err
    assert "resuming from" in err and "step_00000003.pt" in err
    assert "at update 8" in out
    # A different [model] section cannot resume, and the run's config.toml stays as it was.
    assert main(["train", "--out", str(run), "model.d_ff=128", "train.max_steps=9"]) == 2
    assert "model config differs from the checkpoint's: d_ff" in capsys.readouterr().err
    assert "d_ff = 64" in (run / "config.toml").read_text()


def test_garbage_checkpoints_are_set_aside_and_never_push_out_good_ones(data_dir, tmp_path, capsys):
    """The newest checkpoint is random bytes and keep_last=1: resuming sets it aside, so the
    checkpoints that the resumed run writes are kept, and the run can resume again."""
    run = tmp_path / "run"
    over = ["train.save_interval_steps=2", "train.valid_interval=0", "train.average_last=0"]
    args = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(run), "--no-progress"]
    assert main([*args, *over, "train.keep_last=1", "train.max_steps=4"]) == 0
    garbage = loading.step_checkpoint_path(run, 6)
    garbage.write_bytes(os.urandom(4096))
    capsys.readouterr()
    resume = ["train", "--out", str(run), "--no-progress", "train.keep_last=1"]
    assert main([*resume, "train.max_steps=5"]) == 0
    err = capsys.readouterr().err
    assert "set step_00000006.pt aside as step_00000006.pt.broken" in err
    assert [p.name for p in loading.list_step_checkpoints(run)] == ["step_00000005.pt"]
    assert main([*resume, "train.max_steps=6"]) == 0
    assert "resuming from" in capsys.readouterr().err


def test_a_run_whose_checkpoints_are_all_unreadable_stops(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    over = ["train.save_interval_steps=2", "train.valid_interval=0", "train.average_last=0"]
    args = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(run), "--no-progress"]
    assert main([*args, *over, "train.max_steps=2"]) == 0
    for path in loading.list_step_checkpoints(run):
        path.write_bytes(b"\x00" * 100)
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--no-progress", "train.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert "holds 1 checkpoint and none can be read (1 set aside as *.broken)" in err
    assert "--start-over" in err
    lines = [line for line in err.splitlines() if line.startswith("aiayn train: error")]
    assert len(lines) == 1
    # Again: the same one checkpoint, set aside by the attempt before, and no other.
    assert main(["train", "--out", str(run), "--no-progress", "train.max_steps=3"]) == 2
    assert "holds 1 checkpoint and none can be read (1 set aside" in capsys.readouterr().err
    # Asked to, it starts over, and keeps the broken files aside for whoever wants to look.
    assert (
        main(["train", "--out", str(run), "--no-progress", "--start-over", "train.max_steps=3"])
        == 0
    )
    assert "starting over" in capsys.readouterr().err
    assert (run / loading.CHECKPOINT_DIR / "step_00000002.pt.broken").is_file()


def test_sigterm_saves_and_the_run_resumes(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    command = [
        sys.executable,
        "-c",
        "import sys; from aiayn.cli import main; sys.exit(main())",
        "train",
        "--config",
        TINY,
        "--data",
        str(data_dir),
        "--out",
        str(run),
        "train.max_steps=100000",
        "train.log_interval=1",
        "train.valid_interval=0",
        "train.save_interval_steps=0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        metrics = run / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "SIGTERM received" in err and "Resume with: aiayn train --out" in err
    # The stop is said once: the update and the checkpoint, then how to resume.
    assert err.count("SIGTERM at update") == 1 and "checkpoint saved to" not in err, err
    assert re.search(
        r"^stopped by SIGTERM at update \d+, epoch \d+; checkpoint \S+\nResume", err, re.M
    )
    saved = loading.latest_valid_checkpoint(run)
    assert saved is not None
    step = saved[1]["step"]
    assert step >= 3
    # Resume and finish two updates later (in this process: a second one would only cost the
    # start of another Python).
    capsys.readouterr()
    resume = ["train", "--out", str(run), "--resume", f"train.max_steps={step + 2}"]
    assert main([*resume, "train.average_last=0"]) == 0
    out, err = capsys.readouterr()
    assert f"resuming at update {step}" in err
    assert f"at update {step + 2}" in out


def test_kill_9_leaves_the_newest_complete_checkpoint(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    command = [
        sys.executable,
        "-c",
        "import sys; from aiayn.cli import main; sys.exit(main())",
        "train",
        "--config",
        TINY,
        "--data",
        str(data_dir),
        "--out",
        str(run),
        "--no-progress",
        "train.max_steps=100000",
        "train.valid_interval=0",
        "train.save_interval_steps=1",  # saving all the time: a kill lands in a save
        "train.log_interval=1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while len(loading.list_step_checkpoints(run)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        proc.kill()
        proc.wait()
    # Whatever the moment, every step checkpoint on disk is complete.
    paths = loading.list_step_checkpoints(run)
    assert paths and all(loading.load_checkpoint(p)["step"] > 0 for p in paths)
    (run / "checkpoints" / ".step_00099999.pt.abc.tmp").write_bytes(b"partial")  # as if cut
    step = loading.latest_valid_checkpoint(run)[1]["step"]
    capsys.readouterr()
    assert main(["train", "--out", str(run), f"train.max_steps={step + 1}"]) == 0
    err = capsys.readouterr().err
    assert "left by an interrupted save" in err
    assert f"resuming at update {step}" in err
    assert not list((run / "checkpoints").glob("*.tmp"))
    # The updates redone after the resume are recorded once.
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_config_loads(path):
    from aiayn.config import load_config

    config = load_config(path)
    train = config.train
    assert train.max_steps > 0 or train.max_epochs > 0 or train.max_minutes > 0
    assert train.keep_last >= train.average_last


def test_a_run_directory_is_owned_by_one_process(data_dir, tmp_path, capsys):
    """A second train into a directory in use is refused with the holder's PID; the first
    process's work is untouched; a holder killed with -9 leaves nothing locked."""
    from aiayn.lock import run_lock

    run = tmp_path / "run"
    run.mkdir()
    args = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(run), "--no-progress"]
    with run_lock(run):  # as a running `aiayn train` holds it
        assert main([*args, "train.max_steps=2"]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another aiayn train (PID {os.getpid()})" in err
        assert not (run / "metrics.jsonl").exists() and not (run / "config.toml").exists()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from aiayn.lock import run_lock\n"
         "with run_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)", str(run)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    assert main([*args, "train.max_steps=2"]) == 2
    assert f"PID {holder.pid}" in capsys.readouterr().err
    holder.kill()
    holder.wait()
    assert main([*args, "train.max_steps=2", "train.valid_interval=0"]) == 0


def _chained(first: OSError, then: RuntimeError) -> RuntimeError:
    """``then`` raised while ``first`` was being handled, as torch.save's writer does."""
    try:
        raise first
    except OSError:
        try:
            raise then
        except RuntimeError as err:
            return err


@pytest.mark.parametrize(
    ("failure", "message"),
    [
        (OSError(28, "No space left on device"), "no space left on the device"),
        (OSError(30, "Read-only file system"), "has become read-only"),
        # torch's zip writer reports a full disk without errno: read from the free space.
        (RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
         "no space left on the device"),
        # ... or as a later record's position, the failed write's OSError chained to it.
        (_chained(OSError(28, "No space left on device"),
                  RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")),
         "no space left on the device"),
    ],
)  # fmt: skip
def test_a_full_or_read_only_disk_is_one_line_and_the_run_resumes(
    data_dir, tmp_path, capsys, monkeypatch, failure, message
):
    import torch

    run = tmp_path / "run"
    over = ["train.save_interval_steps=2", "train.valid_interval=0", "train.average_last=0"]
    args = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(run), "--no-progress"]
    assert main([*args, *over, "train.max_steps=2"]) == 0
    real_save = torch.save

    def failing_save(obj, handle, *rest, **kwargs):
        handle.write(b"PK\x03\x04 half a checkpoint")
        raise failure

    monkeypatch.setattr(torch, "save", failing_save)
    if isinstance(failure, RuntimeError) and failure.__context__ is None:
        import shutil

        from aiayn.training import storage

        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(storage.shutil, "disk_usage", lambda _: usage._replace(free=1000))
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--no-progress", "train.max_steps=4"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("aiayn train: error")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_00000002.pt"]  # the last one intact, no temporary left
    monkeypatch.setattr(torch, "save", real_save)
    assert main(["train", "--out", str(run), "--no-progress", "train.max_steps=4"]) == 0
    assert "resuming from" in capsys.readouterr().err


def test_a_lowered_keep_last_makes_room_before_the_save(data_dir, tmp_path, monkeypatch):
    run = tmp_path / "run"
    over = ["train.save_interval_steps=1", "train.valid_interval=0", "train.average_last=0"]
    args = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(run), "--no-progress"]
    assert main([*args, *over, "train.max_steps=4", "train.keep_last=4"]) == 0
    seen: list[list[str]] = []
    from aiayn.training import checkpoint as ckpt

    real = ckpt.save_atomic

    def watching(obj, path):
        if "checkpoints" in str(path):
            seen.append(sorted(p.name for p in (run / "checkpoints").glob("step_*.pt")))
        real(obj, path)

    monkeypatch.setattr(ckpt, "save_atomic", watching)
    again = ["train", "--out", str(run), "--no-progress", "train.max_steps=5"]
    assert main([*again, "train.keep_last=2"]) == 0
    # Before writing step 5, only the newest (step 4) was left: room made first.
    assert seen[0] == ["step_00000004.pt"]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*.pt")) == [
        "step_00000004.pt",
        "step_00000005.pt",
    ]


def test_config_takes_a_shipped_recipe_by_name_anywhere(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # outside the repository: no configs/ folder here
    args = ["train", "--data", str(data_dir), "--out", "run", "--no-progress"]
    assert main([*args, "--config", "tiny", "train.max_steps=1", "train.valid_interval=0"]) == 0
    assert 'preset = "tiny"' in (tmp_path / "run" / "config.toml").read_text()
    capsys.readouterr()
    assert main([*args[:3], "--out", "other", "--config", "nonesuch"]) == 2
    err = capsys.readouterr().err
    assert "config file nonesuch does not exist, nor is there a recipe of that name (" in err
    assert "multi30k, " in err and len(err.strip().splitlines()) == 1
    help_text = subprocess.run(
        [sys.executable, "-m", "aiayn", "train", "--help"], capture_output=True, text=True
    ).stdout
    assert "multi30k" in help_text and "bible_lm" in help_text


def test_a_busy_cpu_is_measured_and_said(data_dir, tmp_path, monkeypatch, capsys):
    import torch

    from aiayn import devices
    from aiayn.training import launch

    assert devices.busy_cpu_slowdown() == 0.0  # one thread (this test module's fixture)
    monkeypatch.setattr(launch, "busy_cpu_slowdown", lambda: 6.5)
    args = ["train", "--config", TINY, "--data", str(data_dir), "--no-progress", "--device", "cpu"]
    over = ["train.max_steps=1", "train.valid_interval=0"]
    assert main([*args, "--out", str(tmp_path / "a"), *over]) == 0
    err = capsys.readouterr().err
    assert "6.5x slower than 1 thread" in err and "--threads 1" in err
    monkeypatch.setattr(launch, "busy_cpu_slowdown", lambda: 0.5)
    assert main([*args, "--out", str(tmp_path / "b"), *over]) == 0
    assert "busy with other work" not in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "c"), "--threads", "0", *over]) == 2
    before = torch.get_num_threads()
    try:
        assert main([*args, "--out", str(tmp_path / "d"), "--threads", "2", *over]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_machine_that_cannot_compile_the_step_is_told_in_one_line(
    data_dir, tmp_path, monkeypatch, capsys
):
    from aiayn.accel import panels

    monkeypatch.setattr(panels.shutil, "which", lambda name: None)
    args = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(tmp_path / "run")]
    over = ["--no-progress", "--device", "cpu", "train.max_steps=2", "train.valid_interval=0"]
    assert main([*args, *over, "train.compile_step=true"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("train.compile_step: no C++ compiler here") == 1
    assert "decoder step compiled" not in captured.out


def test_resuming_a_run_that_lost_its_config_or_data_says_what_to_pass(data_dir, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    args = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(run)]
    assert main([*args, "train.max_steps=1", "train.valid_interval=0", "--no-progress"]) == 0
    resume = ["train", "--out", str(run), "--no-progress", "train.max_steps=2"]
    (run / "run.json").write_text("{torn")
    assert main(resume) == 2
    assert "run.json, which names the data a resumed run reads, is unreadable" in (
        capsys.readouterr().err
    )
    moved = tmp_path / "moved"
    shutil.copytree(data_dir, moved)
    (run / "run.json").write_text(json.dumps({"data": str(tmp_path / "gone")}))
    assert main(resume) == 2
    assert f"the data directory {tmp_path / 'gone'} that" in capsys.readouterr().err
    assert main([*resume, "--data", str(moved)]) == 0  # the advice, followed
    (run / "config.toml").unlink()
    assert main([*resume, "--data", str(moved), "train.max_steps=3"]) == 2
    assert "config.toml, the config a resumed run reads, is missing" in capsys.readouterr().err
