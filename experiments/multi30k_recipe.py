"""The figures of docs/results.md's Multi30k recipes: for runs trained with every checkpoint
kept, BLEU against training minutes (each run with its own recipe's averaging and decoding
settings) and the decoding-time levers measured on the same checkpoints: how many of the last
checkpoints are averaged, the length penalty α and the beam size.

Train each run through the CLI a user runs, keeping every checkpoint (it does not change the
model, the data order or the average):

    .venv/bin/aiayn train --config configs/multi30k.toml --data data/multi30k \\
        --out runs/multi30k --no-progress train.keep_last=100000
    .venv/bin/python -m experiments.multi30k_recipe --run "60-minute recipe=runs/multi30k" \\
        --source data/multi30k/valid.en --reference data/multi30k/valid.de

Writes ``experiments/results/NAME.{json,md}`` and ``docs/images/NAME.png`` (or all three into
``--out``); ``--report`` rewrites them from the JSON. ``--quick`` scores a short run (e.g. one of
``experiments.comparison --quick``) on 10 sentences, into a temporary folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import finished_run, json_text, machine, token_rate  # noqa: E402

from experiments import add_output_options, output_folders  # noqa: E402
from experiments.comparison import (  # noqa: E402
    _score,
    checkpoint_times,
    curve_table,
    evaluate,
    plot_curves,
)

# --quick: the validation sentences scored.
QUICK_LINES = 10


def _numbers(text: str, kind: type = float) -> list[Any]:
    return [kind(x) for x in text.split(",") if x.strip()]


def levers(
    run: Path,
    sources: list[str],
    references: list[str],
    minutes: float,
    averages: list[int],
    alphas: list[float],
    beams: list[int],
    saved: tuple[list[Path], list[float], list[int]],
) -> dict[str, Any]:
    """BLEU of the average of the last N checkpoints saved by ``minutes``, for every N of
    ``averages``, decoded with every beam size and α. ``saved``: :func:`checkpoint_times`."""
    from aiayn.inference.translator import Translator
    from aiayn.training import averaging

    paths, times, steps = saved
    upto = [i for i, m in enumerate(times) if m <= minutes + 1e-6]
    paths = paths[: upto[-1] + 1]
    translator, _ = Translator.from_checkpoint(paths[-1])
    settings = translator.decode
    grid = []
    for n in sorted({min(n, len(paths)) for n in averages}):
        translator.model.load_state_dict(averaging.average_checkpoints(paths[-n:]))
        since = round(times[len(paths) - n], 2)  # when the oldest averaged was saved
        for beam, alpha in itertools.product(beams, alphas):
            translator.decode = replace(settings, beam_size=beam, alpha=alpha)
            scores = _score(translator, sources, references)
            grid.append({"average": n, "since": since, "beam": beam, "alpha": alpha,
                         "bleu": scores["bleu"]})  # fmt: skip
            print(f"  {run.name} {minutes:g} min, last {n}, beam {beam}, α {alpha}: "
                  f"BLEU {scores['bleu']}", file=sys.stderr, flush=True)  # fmt: skip
    return {"minutes": minutes, "last_update": steps[upto[-1]], "grid": grid}


def _recipe(run: Path) -> dict[str, Any]:
    """What the run trained and decodes with: from its config.toml, its last checkpoint and,
    for the number of checkpoints averaged, the ``end`` its run.json records (a run that
    averages by ``train.average_from`` chooses how many only as it ends)."""
    import tomllib

    from aiayn.inference import loading
    from aiayn.training.launch import saved_run_info

    config = tomllib.loads((run / "config.toml").read_text())
    ran = loading.load_checkpoint(loading.list_step_checkpoints(run)[-1])["config"]["train"]
    averaged = saved_run_info(run).get("end", {}).get("averaged", {}).get("steps", [])
    return {
        "dropout": config["model"]["dropout"],
        "precision": config["train"]["precision"],
        "precision_ran": ran["precision"],
        "schedule": config["train"].get("lr_schedule", "inverse_sqrt"),
        "average_from": config["train"].get("average_from", 0.0) if averaged else 0.0,
        "average_last": len(averaged) or config["train"]["average_last"],
        "beam": config["decode"]["beam_size"],
        "alpha": config["decode"]["alpha"],
    }


def _averaged(recipe: dict[str, Any]) -> str:
    """Which checkpoints a run averaged, as the table says it."""
    frac = recipe.get("average_from", 0.0)
    last = f"last {recipe['average_last']}"
    return f"{last} (from {frac:.0%} of the run)" if frac else last


def _markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# Multi30k en→de recipes: BLEU against training minutes",
        "",
        f"{m['cpu']} ({m['instructions']}), {m['logical_cpus']} logical CPUs, PyTorch "
        f"{result['torch']}, {result['date']}. Validation set ({result['sentences']} "
        "sentences), sacreBLEU. Each run is scored with its own recipe: the average of its last "
        "N checkpoints, its beam and α. Training tokens/s: the median (and range) over the "
        "run's log intervals.",
        "",
        "| run | precision | dropout | updates | train target tok/s (range) | averaged | "
        "beam, α | val BLEU | chrF |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for label, run in result["runs"].items():
        r, t, f = run["recipe"], run["training"], run["final"]
        low, high = t.get("tokens_per_s_range") or (0, 0)
        precision = r["precision"]
        if precision == "auto":
            precision += f" ({r['precision_ran']})"
        lines.append(
            f"| {label} | {precision} | {r['dropout']} | {t['updates']:,} | "
            f"{t['tokens_per_s']:,.0f} ({low:,.0f}–{high:,.0f}) | {_averaged(r)} | "
            f"{r['beam']}, {r['alpha']} | {f['bleu']:.2f} | {f['chrf']:.2f} |"
        )
    lines += [
        "",
        "BLEU at each minute (in brackets: the training minutes of the last checkpoint averaged):",
        "",
        *curve_table(result["points"], {k: run["curve"] for k, run in result["runs"].items()}),
    ]
    for label, run in result["runs"].items():
        for lever in run["levers"]:
            grid = lever["grid"]
            columns = sorted({(g["beam"], g["alpha"]) for g in grid})
            lines += [
                "",
                f"{label}, the checkpoints saved by {lever['minutes']:g} minutes (last: update "
                f"{lever['last_update']:,}): BLEU by how many are averaged, the beam and α.",
                "",
                "| averaged | " + " | ".join(f"beam {b}, α {a}" for b, a in columns) + " |",
                "|---:|" + "---:|" * len(columns),
            ]
            for n in sorted({g["average"] for g in grid}):
                cells = [g for g in grid if g["average"] == n]
                row = {(g["beam"], g["alpha"]): g["bleu"] for g in cells}
                since = f" (from minute {cells[0]['since']:.1f})" if "since" in cells[0] else ""
                lines.append(
                    f"| last {n}{since} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + " |"
                )
    return "\n".join(lines) + "\n"


def _plot(result: dict[str, Any], path: Path) -> None:
    curves = {label: run["curve"] for label, run in result["runs"].items()}
    plot_curves(curves, result["machine"]["cpu"], "sacreBLEU, Multi30k val", path, target=40.0)


def _write(result: dict[str, Any], name: str, results: Path, images: Path) -> str:
    text = _markdown(result)
    (results / f"{name}.md").write_text(text)
    _plot(result, images / f"{name}.png")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", default=[], metavar="LABEL=DIR",
                        help="a finished run that kept every checkpoint (repeat)")  # fmt: skip
    parser.add_argument("--source", type=Path)
    parser.add_argument("--reference", type=Path)
    parser.add_argument(
        "--average-last",
        action="append",
        default=[],
        metavar="LABEL=N",
        help="score run LABEL with the average of its last N checkpoints instead of the "
        "number the run averaged (from its run.json, else its config's train.average_last)",
    )
    parser.add_argument("--points", default="5,10,15,20,30,45,60", help="curve minutes")
    parser.add_argument("--levers-at", default="45,60", help="minutes to measure the levers at")
    parser.add_argument("--averages", default="5,10,20")
    parser.add_argument("--alphas", default="0.6,1.0,1.5")
    parser.add_argument("--beams", default="4")
    parser.add_argument("--name", default="multi30k-recipe")
    parser.add_argument("--report", action="store_true", help="only rewrite from NAME.json")
    add_output_options(
        parser,
        f"the first {QUICK_LINES} sentences, curve points at 0.5 to 5 minutes, the levers at the "
        "last checkpoint (last 1 or 2 averaged, α 0.6)",
    )
    args = parser.parse_args(argv)
    results, images = output_folders(args)
    json_path = results / f"{args.name}.json"
    if args.report:
        print(_write(json.loads(json_path.read_text()), args.name, results, images))
        return 0
    if not args.run or not args.source or not args.reference:
        parser.error("--run, --source and --reference are needed (or --report)")

    import torch

    from aiayn.accel import cpu_has_bfloat16
    from aiayn.inference.textio import read_lines

    sources, references = read_lines(args.source), read_lines(args.reference)
    if args.quick:
        sources, references = sources[:QUICK_LINES], references[:QUICK_LINES]
        args.points, args.averages, args.alphas = "0.5,1,2,5", "1,2", "0.6"
    points = _numbers(args.points)
    has = "bfloat16 instructions" if cpu_has_bfloat16() else "no bfloat16 instructions"
    result: dict[str, Any] = {
        "machine": {**machine(), "instructions": has},
        "torch": torch.__version__,
        "date": dt.date.today().isoformat(),
        "sentences": len(sources),
        "points": points,
        "runs": {},
    }
    average_last = {k: int(n) for k, _, n in (s.rpartition("=") for s in args.average_last)}
    labels = {spec.partition("=")[0] for spec in args.run}
    if unknown := [k for k in average_last if k not in labels]:
        parser.error(f"--average-last names no --run label: {', '.join(map(repr, unknown))}")
    for spec in args.run:
        label, _, directory = spec.partition("=")
        run = Path(directory)
        recipe = _recipe(run)
        if label in average_last:
            recipe["average_last"] = average_last[label]
        training = finished_run(run)
        training["tokens_per_s"], training["tokens_per_s_range"] = token_rate(run)
        saved = checkpoint_times(run)
        figures = evaluate(
            run, sources, references, points, average=recipe["average_last"], saved=saved
        )
        at = saved[1][-1:] if args.quick else _numbers(args.levers_at)  # the last checkpoint
        measured = [
            levers(run, sources, references, minutes, _numbers(args.averages, int),
                   _numbers(args.alphas), _numbers(args.beams, int), saved)
            for minutes in at
            if minutes <= training["minutes"] + 0.5
        ]  # fmt: skip
        result["runs"][label] = {"dir": str(run), "recipe": recipe, "training": training,
                                 **figures, "levers": measured}  # fmt: skip
        json_path.write_text(json_text(result))
    print(_write(result, args.name, results, images), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
