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
