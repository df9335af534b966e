"""The figures of docs/comparison.md: the Transformer, RNNsearch and Luong's global attention on
Multi30k English→German, each trained for the same minutes on this machine through the CLI a
user runs, with the same prepared data (one joint 8k vocabulary), optimizer, schedule, label
smoothing, checkpoint averaging and beam search.

For each model: ``aiayn train --config configs/<recipe>.toml`` for ``--minutes`` with every
step checkpoint kept; then, in this process, the averaged model (``averaged.pt``, the last 5)
translates the validation source with the recipe's beam 4 and α = 0.6 (timed: sentences/s),
scored with sacreBLEU and chrF; and at each of ``--points`` minutes, the average of the last 5
checkpoints saved by then is translated the same way (the BLEU-against-minutes curve).

Writes ``experiments/results/NAME.{json,md}`` after each model and ``docs/images/NAME.png``
(or all three into ``--out``); ``--quick`` trains each model for 0.3 minutes and scores the
first 10 sentences, into a temporary folder.

    .venv/bin/python -m experiments.comparison --data data/multi30k \
        --source data/multi30k/valid.en --reference data/multi30k/valid.de --work runs/comparison
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import finished_run, json_text, machine, token_rate  # noqa: E402

from experiments import add_output_options, output_folders  # noqa: E402

MODELS = {
    "transformer": ("configs/multi30k.toml", "Transformer (small)"),
    "rnnsearch": ("configs/multi30k_rnnsearch.toml", "RNNsearch (Bahdanau)"),
    "luong": ("configs/multi30k_luong.toml", "Luong (global, general)"),
}
AVERAGE = 5
# --quick: training minutes of each model, and the validation sentences scored.
QUICK_MINUTES, QUICK_LINES = 0.3, 10
# --quick: no decoder step compiled after training (minutes); decoding is eager unless this
# machine compiled one for the model's shape before.
QUICK_TRAIN = ("train.compile_step=false",)


def _train(recipe: str, data: Path, out: Path, minutes: float, *extra: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "aiayn", "train", "--config", recipe, "--data", str(data),
               "--out", str(out), "--no-progress", f"train.max_minutes={minutes:g}",
               "train.keep_last=100000", *extra]  # fmt: skip
    print("+ " + " ".join(command[2:]), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, cwd=ROOT)
    figures = finished_run(out)
    figures["tokens_per_s"], figures["tokens_per_s_range"] = token_rate(out)
    return figures


def _score(translator: Any, sources: list[str], references: list[str]) -> dict[str, float]:
    from aiayn.evaluation.bleu import sacrebleu_bleu, sacrebleu_chrf

    start = time.perf_counter()
    hypotheses = translator.translate(sources)
    seconds = time.perf_counter() - start
    return {
        "bleu": round(sacrebleu_bleu(hypotheses, [references]).score, 2),
        "chrf": round(sacrebleu_chrf(hypotheses, [references]).score, 2),
        "decode_s": round(seconds, 2),
        "sentences_per_s": round(len(sources) / seconds, 1),
    }


def checkpoint_times(run: Path) -> tuple[list[Path], list[float], list[int]]:
    """The step checkpoints of ``run``, with the training minutes and update of each."""
    from aiayn.inference import loading

    paths = loading.list_step_checkpoints(run)
    minutes, steps = [], []
    for path in paths:  # one at a time: each holds the optimizer state too
        state = loading.load_checkpoint(path)
        minutes.append(float(state["progress"]["minutes"]))
        steps.append(int(state["step"]))
    return paths, minutes, steps


def evaluate(
    run: Path,
    sources: list[str],
    references: list[str],
    points: list[float],
    test: tuple[list[str], list[str]] | None = None,
    average: int = AVERAGE,
    saved: tuple[list[Path], list[float], list[int]] | None = None,
) -> dict[str, Any]:
    """The averaged model's scores and decoding speed (and its scores on ``test``, sources and
    references), and the curve at ``points`` minutes: the average of the last ``average``
    checkpoints saved by then, decoded with the run's settings. ``saved``: the run's
    :func:`checkpoint_times`, if already read."""
    from aiayn.inference.translator import Translator
    from aiayn.training import averaging

    translator, _ = Translator.from_checkpoint(run / "averaged.pt")
    params = sum(p.numel() for p in translator.model.parameters())
    final = _score(translator, sources, references)
    test_scores = _score(translator, *test) if test else None
    paths, minutes, steps = saved if saved is not None else checkpoint_times(run)
    curve = []
    for point in points:
        upto = [i for i, m in enumerate(minutes) if m <= point + 1e-6]
        if not upto:
            continue
        last = upto[-1]
        window = paths[max(0, last - average + 1) : last + 1]
        translator.model.load_state_dict(averaging.average_checkpoints(window))
        scores = _score(translator, sources, references)
        curve.append(
            {"point": point, "minutes": round(minutes[last], 2), "update": steps[last],
             "averaged": len(window), "bleu": scores["bleu"], "chrf": scores["chrf"]}
        )  # fmt: skip
        print(f"  {run.name} {minutes[last]:.1f} min: BLEU {scores['bleu']}", file=sys.stderr)
    return {"parameters": params, "final": final, "test": test_scores, "curve": curve}


def _markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    tested = any(run.get("test") for run in result["models"].values())
    lines = [
        f"# Transformer, RNNsearch and Luong on Multi30k en→de, {result['minutes']:g} minutes each",
        "",
        f"{m['cpu']}, {m['logical_cpus']} logical CPUs, PyTorch {result['torch']}, "
        f"{result['date']}. Validation set ({result['sentences']} sentences), beam 4, α = 0.6, "
        f"the average of the last {AVERAGE} checkpoints. Training tokens/s: the median (and "
        "range) over the run's log intervals; decoding: the validation set at batches of the "
        "recipe's size, model loading not timed.",
        "",
        "| model | parameters | updates | train target tok/s (range) | val BLEU | val chrF | "
        "decode sent/s |" + (" test BLEU | test chrF |" if tested else ""),
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if tested else ""),
    ]
    for name, run in result["models"].items():
        t, f = run["training"], run["final"]
        low, high = t.get("tokens_per_s_range") or (0, 0)
        row = (
            f"| {MODELS[name][1]} | {run['parameters']:,} | {t['updates']:,} | "
            f"{t['tokens_per_s']:,.0f} ({low:,.0f}–{high:,.0f}) | {f['bleu']:.2f} | "
            f"{f['chrf']:.2f} | {f['sentences_per_s']:.1f} |"
        )
        if tested:
            test = run.get("test")
            row += f" {test['bleu']:.2f} | {test['chrf']:.2f} |" if test else " | |"
        lines.append(row)
    lines += [
        "",
        f"BLEU of the average of the last {AVERAGE} checkpoints saved by each minute (in "
        "brackets: the training minutes of the last of them):",
        "",
    ]
    curves = {MODELS[name][1]: run["curve"] for name, run in result["models"].items()}
    lines += curve_table(result["points"], curves)
    return "\n".join(lines) + "\n"


def curve_table(points: list[float], curves: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Markdown rows: BLEU at each of ``points`` for each labelled curve, with the training
    minutes of the last checkpoint averaged in brackets (empty where a curve has no point)."""
    lines = [
        "| minutes | " + " | ".join(curves) + " |",
        "|---:|" + "---:|" * len(curves),
    ]
    for point in points:
        cells = []
        for curve in curves.values():
            at = [p for p in curve if p["point"] == point]
            cells.append(f"{at[0]['bleu']:.2f} ({at[0]['minutes']:.1f})" if at else "")
        lines.append(f"| {point:g} | " + " | ".join(cells) + " |")
    return lines


def _plot(result: dict[str, Any], path: Path) -> None:
    curves = {MODELS[name][1]: run["curve"] for name, run in result["models"].items()}
    plot_curves(curves, result["machine"]["cpu"], "sacreBLEU, Multi30k val (beam 4)", path)


def plot_curves(
    curves: dict[str, list[dict[str, Any]]],
    cpu: str,
    ylabel: str,
    path: Path,
    target: float | None = None,
) -> None:
    """BLEU against training minutes, a line for each of ``curves`` (points with ``minutes``
    and ``bleu``), with a dashed line at ``target`` if given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, curve in curves.items():
        ax.plot([p["minutes"] for p in curve], [p["bleu"] for p in curve], marker="o", label=label)
    if target is not None:
        ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training minutes (2 CPU cores)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"Multi30k en→de on {cpu}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="an `aiayn prepare` directory")
    parser.add_argument("--source", type=Path)
    parser.add_argument("--reference", type=Path)
    parser.add_argument("--work", type=Path, help="the runs' folder (default: runs/comparison)")
    parser.add_argument("--minutes", type=float, default=45.0)
    parser.add_argument(
        "--points", default="5,10,15,20,30,45", help="curve minutes, scaled by --minutes/45"
    )
    parser.add_argument("--only", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--name", default="comparison")
    parser.add_argument("--test-source", type=Path, help="also score the averaged models here")
    parser.add_argument("--test-reference", type=Path)
    parser.add_argument("--fresh", action="store_true", help="delete earlier runs in --work")
    parser.add_argument(
        "--report", action="store_true", help="only write the markdown and plot of NAME.json"
    )
    add_output_options(
        parser, f"{QUICK_MINUTES} minutes a model, the first {QUICK_LINES} sentences"
    )
    args = parser.parse_args(argv)
    results, images = output_folders(args)
    json_path = results / f"{args.name}.json"
    if args.report:
        _write(json.loads(json_path.read_text()), args.name, results, images)
        return 0
    if not args.data or not args.source or not args.reference:
        parser.error("--data, --source and --reference are needed (or --report)")

    import torch

    from aiayn.inference.textio import read_lines

    sources, references = read_lines(args.source), read_lines(args.reference)
    work = args.work or ROOT / "runs" / "comparison"
    if args.quick:
        args.minutes, work = QUICK_MINUTES, args.work or results / "runs"
        sources, references = sources[:QUICK_LINES], references[:QUICK_LINES]
    test = None
    if args.test_source and args.test_reference:
        test = (read_lines(args.test_source), read_lines(args.test_reference))
    scale = args.minutes / 45.0
    points = [float(p) * scale for p in args.points.split(",")]
    if args.quick:  # the last point takes the final checkpoint, saved after the time limit
        points = [QUICK_MINUTES, 4 * QUICK_MINUTES]
    result: dict[str, Any] = {
        "machine": machine(),
        "torch": torch.__version__,
        "date": dt.date.today().isoformat(),
        "minutes": args.minutes,
        "sentences": len(sources),
        "points": points,
        "models": {},
    }
    for name in args.only:
        recipe = MODELS[name][0]
        out = work / name
        if args.fresh and out.exists():
            shutil.rmtree(out)
        training = _train(recipe, args.data, out, args.minutes, *QUICK_TRAIN * args.quick)
        figures = evaluate(out, sources, references, points, test)
        result["models"][name] = {"recipe": recipe, "training": training, **figures}
        json_path.write_text(json_text(result))
        print(_write(result, args.name, results, images), flush=True)
    return 0


def _write(result: dict[str, Any], name: str, results: Path, images: Path) -> str:
    """Write ``NAME.md`` into ``results`` and ``NAME.png`` into ``images``; the markdown."""
    text = _markdown(result)
    (results / f"{name}.md").write_text(text)
    _plot(result, images / f"{name}.png")
    return text


if __name__ == "__main__":
    sys.exit(main())
