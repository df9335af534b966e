"""Loss and score curves of a run, from ``metrics.jsonl``, drawn with matplotlib.

The left panel holds the losses; the right one the run's validation score when it has one:
BLEU (translation with ``train.valid_bleu``) or accuracy and macro-F1 (classification). A run
without a score gets the loss panel alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from aiayn.errors import UserError
from aiayn.training.metrics import METRICS_NAME, read_metrics

Record = dict[str, Any]

# Series with fewer points than this are drawn with a marker on each point, so that a short
# run's single point is visible.
_MARKED = 30


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the curves of ``run_dir`` to ``out`` (default ``RUN_DIR/curves.png``)."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise UserError(f"{run_dir} is a file; give the run directory that holds it")
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    records = read_metrics(run_dir)
    if not records:
        raise UserError(f"{run_dir / METRICS_NAME} is missing or empty: nothing to plot")
    train = [r for r in records if r.get("kind") == "train"]
    valid = [r for r in records if r.get("kind") == "valid"]
    averaged = [r for r in records if r.get("kind") == "averaged"]
    scores = _scores(valid + averaged)
    # matplotlib's object API and the Agg canvas: no pyplot, no process-wide backend.
    fig = Figure(figsize=(12 if scores else 7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if scores else 1, squeeze=False)[0]
    _plot_losses(axes[0], train, valid, averaged)
    if scores:
        _plot_scores(axes[1], scores, valid, averaged)
    fig.suptitle(str(run_dir))
    target = Path(out) if out is not None else run_dir / "curves.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    return target


def _scores(records: list[Record]) -> list[tuple[str, str, float]]:
    """(key, label, scale) of the scores that some validation record holds."""
    known = [
        ("bleu", "sacreBLEU (greedy)", 1.0),
        ("accuracy", "accuracy (%)", 100.0),
        ("macro_f1", "macro-F1 (%)", 100.0),
    ]
    return [s for s in known if any(s[0] in r for r in records)]


def _style(n: int, color: str) -> dict[str, Any]:
    return {"color": color, "marker": "o" if n < _MARKED else None, "markersize": 4}


def _plot_losses(
    ax: Axes, train: list[Record], valid: list[Record], averaged: list[Record]
) -> None:
    if train:
        steps = [r["step"] for r in train]
        if any(r["loss"] != r["nll"] for r in train):
            ax.plot(steps, [r["loss"] for r in train], label="train loss (smoothed labels)",
                    **_style(len(train), "C0"))  # fmt: skip
        ax.plot(steps, [r["nll"] for r in train], label="train NLL", alpha=0.8,
                **_style(len(train), "C1"))  # fmt: skip
    if valid:
        steps = [r["step"] for r in valid]
        if any(r["loss"] != r["nll"] for r in valid):
            ax.plot(steps, [r["loss"] for r in valid], "o-", markersize=5, color="C2",
                    label="valid loss")  # fmt: skip
        ax.plot(steps, [r["nll"] for r in valid], "s--", markersize=5, color="C3",
                label="valid NLL")  # fmt: skip
    for i, record in enumerate(averaged):
        ax.plot([record["step"]], [record["nll"]], "*", markersize=14, color="C3", alpha=0.7,
                label="valid NLL, averaged checkpoints" if i == 0 else None)  # fmt: skip
    per = "example" if any("accuracy" in r for r in valid + averaged) else "target token"
    _axis(ax)
    ax.set_ylabel(f"cross-entropy per {per} (nats)")
    ax.set_title("loss")
    ax.legend()


def _axis(ax: Axes) -> None:
    ax.set_xlabel("update")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(y=0.12)  # room for the annotations
    ax.grid(alpha=0.3)


def _plot_scores(
    ax: Axes, scores: list[tuple[str, str, float]], valid: list[Record], averaged: list[Record]
) -> None:
    for i, (key, label, scale) in enumerate(scores):
        color = f"C{i}"
        points = [r for r in valid if key in r]
        if points:
            ax.plot([r["step"] for r in points], [scale * r[key] for r in points],
                    label=f"valid {label}", **_style(len(points), color))  # fmt: skip
            top = max(points, key=lambda r: float(r[key]))
            ax.annotate(f"{scale * top[key]:.1f}", (top["step"], scale * top[key]),
                        textcoords="offset points", xytext=(0, 8), ha="center",
                        color=color)  # fmt: skip
        for record in (r for r in averaged if key in r):
            ax.plot([record["step"]], [scale * record[key]], "*", markersize=14, alpha=0.7,
                    color=color, label=f"{label}, averaged checkpoints")  # fmt: skip
    names = [label for _, label, _ in scores]
    _axis(ax)
    ax.set_ylabel(" / ".join(names))
    ax.set_title("validation " + " and ".join(n.split(" (")[0] for n in names))
    ax.legend()
