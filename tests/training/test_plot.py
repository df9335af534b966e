"""The run's curves: the panels a run's metrics call for, and short runs still visible."""

import json
from pathlib import Path

import pytest
from matplotlib.image import imread

from aiayn.errors import UserError
from aiayn.training import plot
from aiayn.training.plot import plot_run


def _run(tmp_path: Path, *records: dict) -> Path:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def _width(png: Path) -> int:
    return int(imread(png).shape[1])


TRAIN = {"kind": "train", "step": 10, "loss": 5.0, "nll": 4.5}
VALID = {"kind": "valid", "step": 10, "loss": 4.8, "nll": 4.2}


def test_a_run_without_scores_gets_the_loss_panel_alone(tmp_path):
    png = plot_run(_run(tmp_path, TRAIN, VALID))
    assert png == tmp_path / "curves.png" and _width(png) == 700


def test_bleu_or_accuracy_adds_a_second_panel(tmp_path):
    png = plot_run(_run(tmp_path, TRAIN, {**VALID, "bleu": 12.5}), tmp_path / "a.png")
    assert _width(png) == 1200
    png = plot_run(_run(tmp_path, {**VALID, "accuracy": 0.5, "macro_f1": 0.4}), tmp_path / "b.png")
    assert _width(png) == 1200


def test_single_points_are_drawn_with_a_marker(tmp_path, monkeypatch):
    drawn = []
    original = plot._plot_losses

    def spy(ax, *args):
        original(ax, *args)
        drawn.extend(ax.get_lines())

    monkeypatch.setattr(plot, "_plot_losses", spy)
    plot_run(_run(tmp_path, TRAIN))
    assert drawn and all(line.get_marker() not in (None, "None", "") for line in drawn)


def test_no_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="nothing to plot"):
        plot_run(tmp_path)
    with pytest.raises(UserError, match=r"nope: no such run directory"):
        plot_run(tmp_path / "nope")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match=r"metrics\.jsonl is a file; give the run directory"):
        plot_run(tmp_path / "metrics.jsonl")
