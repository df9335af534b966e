"""`aiayn demo` end to end on a slice of the embedded corpus with the tiny preset: the same
code path as the 10-minute default (prepare, train, average, beam-translate the test verses,
score, draw), in seconds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.demo import DemoOptions, _start_fresh, demo_config
from aiayn.inference.translator import Translator
from aiayn.training.trainer import TrainResult

QUICK = [
    "--minutes",
    "5",
    "--train-pairs",
    "300",
    "--test-pairs",
    "12",
    "--vocab-size",
    "300",
    "--no-progress",
    "preset=tiny",
    "train.max_steps=24",
    "train.update_tokens=600",
    "train.save_interval_steps=8",
    "train.valid_interval=12",
    "decode.max_len_b=12",  # an untrained model runs to the length limit: keep it short
]


def _demo(tmp_path: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "demo",
        "--out",
        str(tmp_path / "run"),
        "--data",
        str(tmp_path / "data"),
        "--cache-dir",
        str(cache),
        *QUICK,
        *extra,
    ]


def _printed(out: str, label: str) -> list[str]:
    return [m.group(1) for m in re.finditer(rf"^  {label} +(.*)$", out, flags=re.M)]


def test_demo_end_to_end_then_resume_then_fresh(tmp_path, bible_cache, capsys):
    assert main(_demo(tmp_path, bible_cache)) == 0
    out, err = capsys.readouterr()
    for n in range(1, 6):
        assert f"[{n}/5]" in err
    run = tmp_path / "run"
    model = run / "averaged.pt"
    assert model.is_file() and (run / "config.toml").is_file()
    # The scores, with their signatures, and the baseline.
    assert re.search(r"^test BLEU\|nrefs:1\|.*= +\d+\.\d+ ", out, flags=re.M), out
    assert re.search(r"^test chrF2.*= +\d+\.\d+", out, flags=re.M), out
    assert re.search(r"^baseline \(copying the English source\): BLEU \d+\.\d", out, flags=re.M)
    # The printed translations are the model's: the hypothesis file's lines, and what the
    # averaged model gives for the printed sources now.
    sources, refs, hyps = (_printed(out, k) for k in ("source", "reference", "aiayn"))
    assert 1 <= len(sources) == len(refs) == len(hyps) <= 5
    written = (run / "test.hyp.es").read_text(encoding="utf-8").splitlines()
    assert len(written) == 12 and all(h in written for h in hyps)
    translator, _ = Translator.from_checkpoint(model)
    assert translator.translate(sources) == hyps
    # The pictures and the command to use the model.
    curve = re.search(r"^loss curve +(\S+)", out, flags=re.M).group(1)
    attention = re.search(r"^attention map +(\S+)", out, flags=re.M).group(1)
    assert Path(curve).read_bytes()[:4] == b"\x89PNG"
    assert Path(attention).read_bytes()[:4] == b"\x89PNG"
    assert f"translate {model}" in out

    # Again: the corpus and the finished run are reused (no new updates), same scores.
    steps = sorted((run / "checkpoints").iterdir())
    assert main(_demo(tmp_path, bible_cache)) == 0
    again, err = capsys.readouterr()
    assert "resuming" in err and "reached train.max_steps" in err
    assert sorted((run / "checkpoints").iterdir()) == steps
    score = re.compile(r"^test BLEU.*$", flags=re.M)
    assert score.search(again).group(0) == score.search(out).group(0)

    # The corpus prepared anew (another slice, another tokenizer): resuming is refused.
    assert main(_demo(tmp_path, bible_cache, "--train-pairs", "250")) == 2
    assert "another tokenizer" in capsys.readouterr().err
    # --fresh starts over.
    (run / "marker").write_text("x")
    assert main(_demo(tmp_path, bible_cache, "--fresh", "--train-pairs", "250")) == 0
    capsys.readouterr()
    assert not (run / "marker").exists() and model.is_file()


def test_interrupted_training_says_how_to_continue(tmp_path, bible_cache, capsys, monkeypatch):
    import aiayn.demo as demo

    def interrupted(config, data_dir, run_dir, **kwargs):
        return TrainResult(
            step=7, epoch=0, reason="stopped by SIGINT", interrupted=True, checkpoint=Path("c.pt")
        )

    monkeypatch.setattr(demo, "train_run", interrupted)
    assert main(_demo(tmp_path, bible_cache)) == 0
    out, err = capsys.readouterr()
    assert "stopped by SIGINT at update 7" in err and "Run the demo again to continue" in err
    assert "test BLEU" not in out


def test_fresh_refuses_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="does not look like a run directory"):
        _start_fresh(tmp_path)
    assert (tmp_path / "notes.txt").exists()


def test_recipe_is_sized_for_the_device_and_minutes(tmp_path, bible_cache):
    from aiayn.demo import prepare_demo_data

    options = DemoOptions(
        data_dir=tmp_path / "data",
        cache_dir=bible_cache,
        train_pairs=200,
        test_pairs=10,
        vocab_size=200,
    )
    prepare_demo_data(options, lambda message: None)
    cpu = demo_config(options.data_dir, 7.5, "cpu")
    assert cpu.preset == "small" and cpu.model.d_model == 256 and cpu.model.vocab_size == 200
    assert cpu.train.max_minutes == 7.5 and cpu.train.save_interval_minutes == 0.75
    assert cpu.train.precision == "auto" and cpu.decode.beam_size == 4
    gpu = demo_config(options.data_dir, 10, "cuda")
    assert gpu.preset == "base" and gpu.model.d_model == 512 and gpu.train.precision == "bf16"
    with pytest.raises(Exception, match="--minutes must be positive"):
        demo_config(options.data_dir, 0, "cpu")


def test_a_demo_of_empty_translations_says_what_helps(tmp_path, bible_cache, capsys, monkeypatch):
    """A model trained too briefly ends most beam-4 translations at once (the model of a
    0.5-minute demo did): BLEU 0 and blank lines, with a note that says why and what helps."""
    import aiayn.demo as demo

    translate = demo._translate_with_progress

    def mostly_empty(translator, lines, log):  # type: ignore[no-untyped-def]
        return ["" if i % 4 else text for i, text in enumerate(translate(translator, lines, log))]

    monkeypatch.setattr(demo, "_translate_with_progress", mostly_empty)
    assert main([*_demo(tmp_path, bible_cache), "train.max_steps=1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^note: 9 of 12 non-empty lines have an empty translation: ", out, re.M)
    assert "train longer; beam search (beam 4) prefers ending at once" in out, out
    assert "--beam 1 (or decode.beam_size=1)" in out and "here: a larger --minutes" in out
