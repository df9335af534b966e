"""Nothing process-wide unasked: a Translator, a Trainer and accelerate() built by library code
leave glibc's malloc thresholds and the process's pages (PyTorch's code) alone; with
``process_settings=True``, as aiayn's commands pass it, they set them (the positive control,
so that the spies below can fail)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.accel import accelerate, memory
from aiayn.config import ModelConfig, load_config
from aiayn.inference.translator import Translator
from aiayn.model.transformer import Transformer
from aiayn.training.trainer import Trainer
from tests.helpers import LetterTokenizer, loader_settings


class _Call:
    """A C function of the spied C library: records each call (name, arguments)."""

    def __init__(self, name: str, calls: list[tuple[str, tuple[Any, ...]]]) -> None:
        self.name, self.calls = name, calls

    def __call__(self, *args: Any) -> int:
        self.calls.append((self.name, args))
        return 1


class Spies:
    """Stands in for the C library aiayn reaches (the only way it changes the process: malloc's
    settings, and any other libc call such as madvise or malloc_trim) and records each call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        # A fresh process's state: nothing held, nothing set (so that a hold must call).
        monkeypatch.setattr(memory, "_holders", {})
        monkeypatch.setattr(memory, "_in_force", None)
        calls = self.calls

        class Libc:
            def __getattr__(self, name: str) -> _Call:
                return _Call(name, calls)

        monkeypatch.setattr(memory, "_libc", lambda: Libc())

    @property
    def mallopt(self) -> list[tuple[Any, ...]]:
        return [args for name, args in self.calls if name == "mallopt"]

    @property
    def touched(self) -> bool:
        return bool(self.calls or memory.in_force() is not None)


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> Spies:
    return Spies(monkeypatch)


def _model() -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=50, d_model=32, d_ff=64, n_heads=4, n_layers=1)
    return Transformer(config)


def _trainer(tmp_path: Path, **kwargs: Any) -> Trainer:
    config = load_config(None, ["preset=tiny", "model.vocab_size=50"])
    model = Transformer(config.model)
    return Trainer(
        config,
        model,
        [],  # type: ignore[arg-type]
        [],  # type: ignore[arg-type]
        tmp_path,
        show_progress=False,
        tensorboard=False,
        **kwargs,
    )


def test_a_library_translator_leaves_the_process_alone(spies: Spies) -> None:
    translator = Translator(_model(), LetterTokenizer())  # type: ignore[arg-type]
    assert translator.acceleration is not None and translator.acceleration.levers
    translator.translate(["hello", "a longer sentence"] * 8)  # decoding's own holds too
    translator.acceleration.undo()
    assert not spies.touched, spies.calls


def test_a_library_trainer_leaves_the_process_alone(spies: Spies, tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    assert trainer.acceleration is not None and trainer.acceleration.levers
    trainer.close()
    assert not spies.touched, spies.calls


def test_accelerate_leaves_the_process_alone(spies: Spies) -> None:
    for mode in ("train", "decode"):
        with accelerate(_model().train(mode == "train"), mode) as acceleration:  # type: ignore[arg-type]
            assert acceleration.levers
    assert not spies.touched


def test_asked_for_a_translator_sets_them_and_undo_gives_them_back(spies: Spies) -> None:
    if memory._glibc() is None:
        pytest.skip("malloc thresholds are glibc's (and AIAYN_MALLOC=system leaves them)")
    translator = Translator(_model(), LetterTokenizer(), process_settings=True)  # type: ignore[arg-type]
    assert translator.acceleration is not None
    assert memory.in_force() == memory.DECODE and spies.mallopt
    assert {name for name, _ in spies.calls} == {"mallopt"}
    translator.acceleration.undo()
    assert memory.in_force() is None and spies.mallopt[-2:] == [
        (memory._M_MMAP_THRESHOLD, memory.GLIBC_DEFAULT[0]),
        (memory._M_TRIM_THRESHOLD, memory.GLIBC_DEFAULT[1]),
    ]


def test_asked_for_a_trainer_sets_them(spies: Spies, tmp_path: Path) -> None:
    if memory._glibc() is None:
        pytest.skip("malloc thresholds are glibc's (and AIAYN_MALLOC=system leaves them)")
    trainer = _trainer(tmp_path, process_settings=True)
    assert memory.in_force() == memory.TRAIN and spies.mallopt
    assert {name for name, _ in spies.calls} == {"mallopt"}
    trainer.close()
    assert memory.in_force() is None


def test_the_commands_ask_for_them_and_say_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiayn import demo
    from aiayn.cli import main
    from aiayn.cli.process import PROCESS_SETTINGS
    from aiayn.serving.engine import Engine
    from aiayn.training import launch, run_config

    checkpoint = str(tmp_path / "model.pt")
    for owner, argv in (
        (Translator, ["translate", checkpoint]),
        (Engine, ["serve", checkpoint]),
    ):
        assert loader_settings(monkeypatch, owner, argv)["process_settings"] is True

    seen: dict[str, Any] = {}

    def stop(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs, args=args)
        raise SystemExit(0)

    monkeypatch.setattr(run_config, "resolve_config", lambda *args: None)
    monkeypatch.setattr(launch, "train_run", stop)
    with pytest.raises(SystemExit):
        main(["train", "--config", "tiny", "--data", str(tmp_path), "--out", str(tmp_path / "r")])
    assert seen.pop("process_settings") is True
    monkeypatch.setattr(demo, "run_demo", stop)
    with pytest.raises(SystemExit):
        main(["demo", "--out", str(tmp_path / "demo")])
    assert seen["args"][0].process_settings is True
    # A library caller's DemoOptions leave the process alone, as Translator and Trainer do.
    assert demo.DemoOptions().process_settings is False

    words = " ".join(PROCESS_SETTINGS.split())
    for command in ("train", "translate", "serve", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert words in " ".join(capsys.readouterr().out.split())
