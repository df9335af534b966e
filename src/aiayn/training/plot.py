"""Loss and BLEU curves of a run, from ``metrics.jsonl``, drawn with matplotlib."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from aiayn.errors import UserError
from aiayn.training.metrics import METRICS_NAME, read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the curves of ``run_dir`` to ``out`` (default ``RUN_DIR/curves.png``)."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise UserError(f"{run_dir / METRICS_NAME} is missing or empty: nothing to plot")
    train = [r for r in records if r.get("kind") == "train"]
    valid = [r for r in records if r.get("kind") == "valid"]
    averaged = [r for r in records if r.get("kind") == "averaged"]
    with_bleu = [r for r in valid if "bleu" in r]
    # matplotlib's object API and the Agg canvas: no pyplot, no process-wide backend.
    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    ax_loss, ax_bleu = fig.subplots(1, 2)
    if train:
        steps = [r["step"] for r in train]
        ax_loss.plot(steps, [r["loss"] for r in train], label="train loss (smoothed labels)")
        ax_loss.plot(steps, [r["nll"] for r in train], label="train NLL", alpha=0.7)
    if valid:
        steps = [r["step"] for r in valid]
        ax_loss.plot(steps, [r["loss"] for r in valid], "o-", label="valid loss")
        ax_loss.plot(steps, [r["nll"] for r in valid], "s--", label="valid NLL")
    ax_loss.set_xlabel("update")
    ax_loss.set_ylabel("loss per target token (nats)")
    ax_loss.set_title("loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if with_bleu:
        ax_bleu.plot(
            [r["step"] for r in with_bleu],
            [r["bleu"] for r in with_bleu],
            "o-",
            label="valid BLEU (greedy)",
        )
        for record in averaged:
            if "bleu" in record:
                ax_bleu.plot(
                    [record["step"]],
                    [record["bleu"]],
                    "*",
                    markersize=14,
                    label="averaged checkpoints",
                )
        top = max(with_bleu, key=lambda r: r["bleu"])
        ax_bleu.annotate(
            f"{top['bleu']:.1f}",
            (top["step"], top["bleu"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
        )
        ax_bleu.legend()
    else:
        ax_bleu.text(
            0.5, 0.5, "no BLEU recorded", ha="center", va="center", transform=ax_bleu.transAxes
        )
    ax_bleu.set_xlabel("update")
    ax_bleu.set_ylabel("sacreBLEU")
    ax_bleu.set_title("validation BLEU")
    ax_bleu.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    target = Path(out) if out is not None else run_dir / "curves.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    return target
