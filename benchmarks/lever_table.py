"""The lever table: each lever of ``aiayn.accel`` on and off on the headline figures, on this host.

For each lever of :data:`aiayn.accel.levers.LEVERS` that applies here, the headline figures with
every lever on (as aiayn's commands run: ``process_settings=True``) and with that one lever
left out (``accelerate(..., disable={lever})``): training target tokens/s (on batches of
varied shapes, as a real run's), beam 4 and greedy decoding of a batch of 64 sentences and of
one sentence at a time, SMALL and BASE, and the peak RSS; on a CPU with bfloat16
instructions, also training in bfloat16 (what ``train.precision=auto`` gives there, and the
figure of the levers that only bfloat16 uses). Each measurement runs in a process of its own
(so that the peak RSS is that configuration's), the configurations interleaved within each round::

    make bench-levers                                   # SMALL and BASE, 3 rounds
    python -m benchmarks.lever_table --quick            # SMALL, 1 round, few sentences
    python -m benchmarks.lever_table --levers "grid dropout" "malloc thresholds"

It writes ``benchmarks/results/levers-<host>.md`` and ``.json`` (``--quick``:
``levers-<host>-quick.*``, not a result to keep). Each cell is the lever's on/off ratio, >1
where the lever helps (for latency and RSS: off/on), as the median over rounds and their
spread; ``—`` where the lever does not apply to the figure on this host (it is not among the
levers ``accelerate`` reports there). "earns its place": some speed figure gains 5% or more, or
the peak RSS more than 20%.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import host_slug, json_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# aiayn's weights for each workload and its compiled decoder step's key: written once.
WEIGHTS_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aiayn-levers"

# The figures, in the table's order: (key, column header, higher is better)
FIGURES: tuple[tuple[str, str, bool], ...] = (
    ("train", "training tokens/s", True),
    ("train-bf16", "training tokens/s, bf16", True),
    ("beam-batch", "beam 4, batch 64", True),
    ("greedy-batch", "greedy, batch 64", True),
    ("beam-single", "beam 4, one sentence", False),
    ("greedy-single", "greedy, one sentence", False),
    ("rss", "peak RSS", False),
)
DECODE_MODES = ("beam-batch", "greedy-batch", "beam-single", "greedy-single")
TRAIN_KINDS = ("train", "train-bf16")
SPEED_GAIN = 1.05  # a speed figure this much better: the lever earns its place
MEMORY_GAIN = 1.20  # or the peak RSS this much lower
NOT_APPLIED = "—"

# (warmup, timed updates), (timed runs of each batch, sentences one at a time) per run kind
TRAIN_STEPS = {"full": {"small": (3, 10), "base": (2, 6)}, "quick": {"small": (2, 4)}}
DECODE_REPEATS = {"full": {"small": (3, 24), "base": (2, 12)}, "quick": {"small": (1, 6)}}


# -- one measurement (a child process) ----------------------------------------------------------


def _accelerate_with(disable: frozenset[str], record: list[Any]) -> None:
    """Have every later ``aiayn.accel.accelerate`` call (the benchmark modules import it when
    they build a model) run as aiayn's commands run it, ``disable`` left out; the
    accelerations are appended to ``record``."""
    import aiayn.accel

    plain = aiayn.accel.accelerate

    def accelerate(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(process_settings=True, disable=disable)
        acceleration = plain(*args, **kwargs)
        record.append(acceleration)
        return acceleration

    aiayn.accel.accelerate = accelerate  # type: ignore[assignment]


def _child_train(workload: str, warmup: int, steps: int, bf16: bool) -> dict[str, Any]:
    """Timed updates as ``benchmarks.train_bench`` measures aiayn's (the Trainer's update on
    the CPU in fp32, or bf16: the loss fused with the projection where the acceleration fuses
    it), each on a batch of another shape, as in a real run (``training_batches``)."""
    from benchmarks.common import WORKLOADS, time_calls, training_batches
    from benchmarks.train_bench import aiayn_update

    w = WORKLOADS[workload]
    batches = training_batches(w, warmup + steps)
    times = time_calls(aiayn_update(w, batches, bf16=bf16), warmup, steps)
    tokens = sum(int(b.tgt_out.numel()) for b in batches[warmup:])
    return {"train-bf16" if bf16 else "train": tokens / sum(times), "times_s": times}


def _child_decode(workload: str, repeats: int, single: int, weights: Path) -> dict[str, Any]:
    """The four decoding figures as ``benchmarks.decode_bench`` measures aiayn (its compiled
    decoder step where it was compiled, the weights mapped from a file)."""
    from benchmarks.common import DECODE_WORKLOADS, decode_sources, median, time_calls
    from benchmarks.decode_bench import aiayn_decoder, check_length

    dw = DECODE_WORKLOADS[workload]
    src = decode_sources(dw)
    decode = aiayn_decoder(dw, compiled=True, weights=weights)
    figures: dict[str, Any] = {}
    for mode in DECODE_MODES:
        beam = dw.beam_size if mode.startswith("beam") else 1
        if mode.endswith("batch"):
            check_length("aiayn", decode(src, beam), dw.steps)  # warm-up
            times = time_calls(lambda b=beam: decode(src, b), 0, repeats)
            figures[mode] = src.size(0) / median(times)  # sentences/s
        else:
            rows = src[:single]
            check_length("aiayn", decode(rows[:1], beam), dw.steps)  # warm-up
            times = [time_calls(lambda r=r, b=beam: decode(r[None], b), 0, 1)[0] for r in rows]
            figures[mode] = 1000 * median(times)  # ms
    return figures


def child(args: argparse.Namespace) -> None:
    from benchmarks.common import emit, peak_rss_mb, set_threads

    set_threads()
    record: list[Any] = []
    _accelerate_with(frozenset(args.disable), record)
    if args.child in TRAIN_KINDS:
        warmup, steps = args.steps
        figures = _child_train(args.workload, warmup, steps, bf16=args.child == "train-bf16")
    else:
        figures = _child_decode(args.workload, args.repeats, args.single, args.weights)
    levers = [name for acceleration in record for name in acceleration.levers]
    emit(
        {
            "kind": args.child,
            "workload": args.workload,
            "disable": sorted(args.disable),
            "figures": {k: v for k, v in figures.items() if k != "times_s"},
            "levers": list(dict.fromkeys(levers)),
            "rss": peak_rss_mb(),
        }
    )


# -- the rounds (the parent process) ------------------------------------------------------------


def _child_env() -> dict[str, str]:
    from benchmarks.common import THREADS

    env = dict(os.environ)
    # This checkout's aiayn and benchmarks first (the shared environment's editable install
    # may point at another).
    paths = [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(THREADS)
    return env


def run_child(argv: list[str]) -> dict[str, Any]:
    """Run one measurement (``python -m benchmarks.lever_table --child ...``); its result."""
    from benchmarks.common import parse_results

    cmd = [sys.executable, "-m", "benchmarks.lever_table", *argv]
    print("  $", " ".join(cmd[2:]), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), capture_output=True, text=True)
    results = parse_results(proc.stdout)
    if proc.returncode != 0 or not results:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd[2:])} failed ({proc.returncode}):\n" + "\n".join(tail))
    return results[0]


def _compile_step(workload: str, weights_dir: Path) -> None:
    """The decoder step compiled for the workload's weights, where it is not yet (as
    ``make bench`` does before its rounds): every decode process then loads it."""
    cmd = [sys.executable, "-m", "benchmarks.decode_bench", "--compile-only"]
    cmd += ["--workload", workload, "--ct2-dir", str(weights_dir)]
    print("  $", " ".join(cmd[2:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, env=_child_env(), check=True, capture_output=True)


def measure(
    workloads: Sequence[str], wanted: Sequence[str], rounds: int, kind: str
) -> dict[str, Any]:
    """Every measurement: for each workload, kind (train, train-bf16 where this CPU has
    bfloat16 instructions, decode) and configuration (``on``: every lever; else the lever left
    out), one result per round."""
    from aiayn.accel import cpu_has_bfloat16
    from benchmarks.common import rotated

    kinds = ["train", *(["train-bf16"] if cpu_has_bfloat16() else []), "decode"]

    runs: dict[str, Any] = {}
    for workload in workloads:
        weights_dir = WEIGHTS_DIR / workload
        weights_dir.mkdir(parents=True, exist_ok=True)
        _compile_step(workload, weights_dir)
        warmup, steps = TRAIN_STEPS[kind][workload]
        repeats, single = DECODE_REPEATS[kind][workload]
        flags = {
            "train": ["--steps", str(warmup), str(steps)],
            "train-bf16": ["--steps", str(warmup), str(steps)],
            "decode": ["--repeats", str(repeats), "--single", str(single)],
        }
        flags["decode"] += ["--weights", str(weights_dir / "aiayn-weights.pt")]
        runs[workload] = {what: {} for what in kinds}
        applies: dict[str, list[str]] = {}
        for r in range(rounds):
            print(f"{workload}, round {r + 1}/{rounds}", file=sys.stderr, flush=True)
            for what in kinds:
                base = ["--child", what, "--workload", workload, *flags[what]]
                done = runs[workload][what]
                if r == 0:  # every lever on first: which levers apply here
                    done["on"] = [run_child(base)]
                    applies[what] = [n for n in wanted if n in done["on"][0]["levers"]]
                    order = applies[what]
                else:
                    order = rotated(["on", *applies[what]], r)
                for name in order:
                    argv = base if name == "on" else [*base, "--disable", name]
                    done.setdefault(name, []).append(run_child(argv))
    return runs


def _ratios(on: list[dict[str, Any]], off: list[dict[str, Any]], key: str) -> list[float]:
    """The on/off ratio of each round (off/on for a figure where lower is better)."""
    higher = dict((k, h) for k, _, h in FIGURES)[key]
    pairs = []
    for a, b in zip(on, off, strict=False):
        x = a["rss"] if key == "rss" else a["figures"][key]
        y = b["rss"] if key == "rss" else b["figures"][key]
        pairs.append(x / y if higher else y / x)
    return pairs


def lever_rows(runs: dict[str, Any], wanted: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """For each workload, one row per lever: each figure's ratios over rounds (None where the
    lever does not apply to it here, or it was not measured) and whether it earns its place
    (None: it applies to no figure measured here). The peak RSS is the decoding process's
    where the lever decodes, else the first training process's it applies to."""
    from aiayn.accel.levers import BY_NAME

    table: dict[str, list[dict[str, Any]]] = {}
    for workload, kinds in runs.items():
        rows = []
        for name in wanted:
            applied = {
                what: name in runs_ and name in runs_["on"][0]["levers"]
                for what, runs_ in kinds.items()
            }
            memory = next((w for w in ("decode", *TRAIN_KINDS) if applied.get(w)), None)
            cells: dict[str, list[float] | None] = {}
            for key, _, _ in FIGURES:
                what = memory if key == "rss" else key if key in TRAIN_KINDS else "decode"
                if key != "rss" and what not in kinds:
                    continue  # not measured on this host: no column
                on = what is not None and applied.get(what)
                cells[key] = _ratios(kinds[what]["on"], kinds[what][name], key) if on else None
            mode = BY_NAME[name].mode
            rows.append({"lever": name, "mode": mode, "cells": cells, "earns": earns(cells)})
        table[workload] = rows
    return table


def earns(cells: dict[str, list[float] | None]) -> bool | None:
    """Whether some speed figure gains 5% or the peak RSS more than 20% (median over rounds);
    None where the lever applies to no figure."""
    measured = {k: v for k, v in cells.items() if v}
    if not measured:
        return None
    speed = any(statistics.median(v) >= SPEED_GAIN for k, v in measured.items() if k != "rss")
    memory = "rss" in measured and statistics.median(measured["rss"]) > MEMORY_GAIN
    return speed or memory


def cell(ratios: list[float] | None) -> str:
    """``1.12× (1.09–1.15)``: the median ratio and the spread over rounds; ``—`` not applied."""
    if not ratios:
        return NOT_APPLIED
    return f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"


def render(report: dict[str, Any]) -> str:
    """The Markdown of the lever table (the agreed format: a header line, then one table per
    model size)."""
    from aiayn.accel.levers import BY_NAME

    head = report["header"]
    lines = [
        f"Lever table on {head['cpu']} ({head['host']}), PyTorch {head['torch']}, "
        f"{head['rounds']} interleaved round(s), {head['date']}"
        + (
            " — a QUICK run (few steps and sentences): not a result to keep"
            if head["quick"]
            else ""
        )
        + ".",
        "",
        "Each figure: the lever's on/off ratio with every other lever on (for latency and peak "
        "RSS off/on), so that >1 means the lever helps: the median over rounds and their spread. "
        f"{NOT_APPLIED}: the lever does not apply to that figure here. Peak RSS: the decoding "
        "process's, or the training process's for a lever that only trains. Generated by "
        "`make bench-levers` (benchmarks/lever_table.py); the levers are listed in "
        "`aiayn.accel.levers`.",
    ]
    for workload, rows in report["rows"].items():
        keys = [key for key, _, _ in FIGURES if key in rows[0]["cells"]]
        columns = [header for key, header, _ in FIGURES if key in keys]
        lines += ["", f"### {workload.upper()}", ""]
        lines.append("| lever | mode | " + " | ".join(columns) + " | earns its place |")
        lines.append("|---|---|" + "---:|" * len(columns) + "---|")
        for row in rows:
            figures = " | ".join(cell(row["cells"][key]) for key in keys)
            verdict = {True: "yes", False: "no", None: NOT_APPLIED}[row["earns"]]
            # A table keeps the levers of its run: the mode as it was recorded then.
            mode = row.get("mode") or (
                BY_NAME[row["lever"]].mode if row["lever"] in BY_NAME else ""
            )
            lines.append(f"| {row['lever']} | {mode} | {figures} | {verdict} |")
        base = report.get("baseline", {}).get(workload)
        if base:
            lines += ["", "With every lever on: " + base + "."]
    return "\n".join(lines) + "\n"


def _baseline(kinds: dict[str, Any]) -> str:
    """The absolute figures with every lever on (medians over rounds)."""
    train = [r["figures"]["train"] for r in kinds["train"]["on"]]
    decode = kinds["decode"]["on"]

    def mid(key: str) -> float:
        return statistics.median(r["figures"][key] for r in decode)

    bf16 = ""
    if "train-bf16" in kinds:
        tokens = statistics.median(r["figures"]["train-bf16"] for r in kinds["train-bf16"]["on"])
        bf16 = f", in bf16 {tokens:,.0f}"
    return (
        f"training {statistics.median(train):,.0f} target tokens/s{bf16}; beam 4, batch 64 "
        f"{mid('beam-batch'):.1f} sentences/s; greedy, batch 64 {mid('greedy-batch'):.1f} "
        f"sentences/s; beam 4, one sentence {mid('beam-single'):.1f} ms; greedy, one sentence "
        f"{mid('greedy-single'):.1f} ms; peak RSS decoding "
        f"{statistics.median(r['rss'] for r in decode):.0f} MB, training "
        f"{statistics.median(r['rss'] for r in kinds['train']['on']):.0f} MB"
    )


def main(argv: list[str] | None = None) -> None:
    from aiayn.accel.levers import NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="SMALL, 1 round, few sentences")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3, quick 1)")
    parser.add_argument(
        "--levers", nargs="+", metavar="NAME", choices=NAMES, help="only these levers"
    )
    parser.add_argument("--workloads", nargs="+", choices=("small", "base"))
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    # One measurement, in a process of its own (what the rounds run).
    parser.add_argument("--child", choices=(*TRAIN_KINDS, "decode"), help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="small", help=argparse.SUPPRESS)
    parser.add_argument("--disable", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--steps", nargs=2, type=int, default=(3, 10), help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--single", type=int, default=24, help=argparse.SUPPRESS)
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return

    import torch

    from benchmarks.common import machine

    kind = "quick" if args.quick else "full"
    workloads = args.workloads or (["small"] if args.quick else ["small", "base"])
    if args.quick and workloads != ["small"]:
        parser.error("--quick measures SMALL only")
    rounds = args.rounds or (1 if args.quick else 3)
    wanted = list(args.levers or NAMES)
    start = time.perf_counter()
    runs = measure(workloads, wanted, rounds, kind)
    host = host_slug()
    report = {
        "header": {
            "cpu": machine()["cpu"],
            "host": host,
            "torch": torch.__version__,
            "rounds": rounds,
            "date": dt.date.today().isoformat(),
            "quick": args.quick,
            "minutes": round((time.perf_counter() - start) / 60, 1),
        },
        "rows": lever_rows(runs, wanted),
        "baseline": {w: _baseline(kinds) for w, kinds in runs.items()},
        "runs": runs,
    }
    stem = f"levers-{host}" + ("-quick" if args.quick else "")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    markdown = render(report)
    (args.out_dir / f"{stem}.md").write_text(markdown, encoding="utf-8")
    (args.out_dir / f"{stem}.json").write_text(json_text(report) + "\n")
    print(markdown)
    print(f"wrote {args.out_dir / stem}.md and .json", file=sys.stderr)


if __name__ == "__main__":
    main()
