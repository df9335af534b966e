"""``aiayn cache``: the cache's parts and their sizes, and clearing one; and what the
end-of-training compile says of its cost as it starts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from aiayn.cli import main


@pytest.fixture
def caches(tmp_path, monkeypatch) -> tuple[Path, Path]:
    root, inductor = tmp_path / "aiayn", tmp_path / "inductor"
    monkeypatch.setenv("AIAYN_CACHE", str(root))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    return root, inductor


def test_cache_lists_its_parts_and_clears_one(caches, capsys):
    root, inductor = caches
    (root / "compiled" / "step").mkdir(parents=True)
    (root / "compiled" / "step" / "lib.so").write_bytes(b"x" * 2_500_000)
    (root / "bible").mkdir()
    (root / "bible" / "text").write_bytes(b"x" * 300_000)
    inductor.mkdir()
    (inductor / "kernel.cpp").write_bytes(b"x" * 1_200_000)
    assert main(["cache"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["compiled", "2.5", "MB", str(root / "compiled")]
    assert out[1].split() == ["inductor", "1.2", "MB", str(inductor)]
    assert out[2].split() == ["corpora", "0.3", "MB", str(root)]
    assert main(["cache", "--clear", "compiled"]) == 0
    assert capsys.readouterr().out == "compiled: removed 2.5 MB\n"
    assert not (root / "compiled").exists() and (root / "bible" / "text").is_file()
    assert inductor.is_dir()
    assert main(["cache", "--clear", "all"]) == 0
    assert not inductor.exists() and not (root / "bible").exists()
    capsys.readouterr()
    assert main(["cache"]) == 0  # nothing there: zeros, no error
    rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines()[:3]]
    assert rows == [[name, "0.0", "MB"] for name in ("compiled", "inductor", "corpora")]


def test_the_end_of_training_compile_says_its_cost_first(caches, tmp_path, capsys, monkeypatch):
    """As it starts: what it does, about how long, where its files go and how to skip or clear
    them; as it ends, the size it added."""
    import aiayn.accel.compiled as compiled
    from aiayn.cli import train as train_command
    from aiayn.config import load_config
    from aiayn.inference.translator import Translator
    from tests.helpers import TINY

    root, _ = caches

    def compiling(cls, path, **kwargs):  # type: ignore[no-untyped-def]
        said = capsys.readouterr().err  # said before the compile began
        assert said.startswith("compiling the decoder step that translate decodes with"), said
        (root / "compiled").mkdir(parents=True)
        (root / "compiled" / "lib.so").write_bytes(b"x" * 3_000_000)
        return SimpleNamespace(acceleration=SimpleNamespace(levers=["compiled decoder step"])), None

    monkeypatch.setattr(compiled, "cannot_build", lambda: None)
    monkeypatch.setattr(Translator, "from_checkpoint", classmethod(compiling))
    config = load_config(TINY, ["model.vocab_size=20"])
    train_command._compile_step(tmp_path, config, "cpu", 1)
    out = capsys.readouterr().out
    assert f"(1 threads, 0 s, 3 MB in {root / 'compiled'}; train.compile_step = false" in out
    assert "aiayn cache --clear compiled removes it" in out


def test_a_signal_during_the_compile_ends_it_in_one_line(caches, tmp_path, capsys, monkeypatch):
    """SIGTERM while the step compiles abandons the compile at once, says so in one line and
    how the step is had later, and gives the signal its handler back."""
    import os
    import signal
    import time

    import aiayn.accel.compiled as compiled
    from aiayn.cli import train as train_command
    from aiayn.config import load_config
    from aiayn.inference.translator import Translator
    from tests.helpers import TINY

    def compiling(cls, path, **kwargs):  # type: ignore[no-untyped-def]
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # a compile: the signal ends it
        raise AssertionError("the compile went on after SIGTERM")

    monkeypatch.setattr(compiled, "cannot_build", lambda: None)
    monkeypatch.setattr(Translator, "from_checkpoint", classmethod(compiling))
    before = signal.getsignal(signal.SIGTERM)
    start = time.monotonic()
    train_command._compile_step(tmp_path, load_config(TINY, ["model.vocab_size=20"]), "cpu", 1)
    assert time.monotonic() - start < 4
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("train.compile_step: stopped by SIGTERM; the run is saved")
    assert "translate --compiled-step compiles it" in err[-1]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_while_the_run_finished_skips_the_compile(
    reverse_data_dir, tmp_path, capsys, monkeypatch
):
    """A SIGTERM that came after the last update (while the run validated, saved or averaged)
    does not let a compile of a minute start: the command ends, saying so."""
    import signal

    from aiayn.cli import train as train_command
    from aiayn.training import launch
    from aiayn.training.trainer import TrainResult
    from tests.helpers import TINY

    def trained(*args, **kwargs):  # type: ignore[no-untyped-def]
        return TrainResult(step=5, epoch=1, reason="max_steps", signal=signal.SIGTERM)

    def compile_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("compiled after a signal")

    monkeypatch.setattr(launch, "train_run", trained)
    monkeypatch.setattr(train_command, "_compile_step", compile_step)
    command = ["train", "--config", TINY, "--data", str(reverse_data_dir)]
    assert main([*command, "--out", str(tmp_path / "run"), "train.compile_step=true"]) == 0
    err = capsys.readouterr().err
    assert "train.compile_step: skipped (SIGTERM received); the run is saved" in err
