"""aiayn and CTranslate2 float32 taking turns, batch by batch: ``make bench-paired``.

``make bench`` times each system in a process of its own, round after round; on a host whose
speed drifts over minutes (a shared virtual machine), a system's figure moves with the minute
it ran in, and a ratio of two medians taken minutes apart carries that drift. Here aiayn's
default decode (the compiled step) and CTranslate2 float32 at 1 and 2 threads are each loaded
once, in a process of its own that waits for the next turn, and take turns on the same input,
the order rotating from turn to turn, so that each pair of timings is seconds apart; a
figure's ratio is the median over the pairs of
``aiayn / CTranslate2`` (throughput at batch 64, latency for one sentence at a time), against
CTranslate2's setting with the better median, with its quartiles and range. The workloads,
decode settings and inputs are ``decode_bench``'s.

Processes, not one: both systems bring an OpenMP runtime (CTranslate2 its own), whose threads
spin for a while after their work; in one process one system's spinning threads took the
cores from the other's (aiayn's one-sentence latency 2.5× its own process's). A process
waiting for its turn sleeps, and each turn starts :data:`GAP_S` after the one before, once the
last one's threads have gone to sleep. On a CPU with AVX-512 a third CTranslate2 process
takes turns too, its oneDNN limited to AVX2 (faster there at batches: ``decode_bench``'s
``ct2-float32-avx2``); elsewhere that setting is the first one's. What it does not measure:
the compiling of aiayn's libraries (compiled first, where they are not in the cache yet).

With ``--write`` it writes ``benchmarks/results/paired-<host>.{md,json}`` (``<host>``:
:func:`benchmarks.common.host_slug`); without, it prints the table only.

    .venv/bin/python -m benchmarks.paired_decode [--workload small base] [--pairs 9] [--write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make the ``benchmarks`` package importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    DECODE_WORKLOADS,
    THREADS,
    cpu_instructions,
    cpu_model,
    decode_sources,
    emit,
    host_slug,
    json_text,
    peak_rss_mb,
    rotated,
    set_threads,
    versions,
)
from benchmarks.decode_bench import (  # noqa: E402
    AIAYN_WEIGHTS,
    CT2_AVX2,
    MODES,
    aiayn_decoder,
    check_length,
    ct2_decoder,
)
from benchmarks.peers import available, convert_to_ctranslate2  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
AIAYN = "aiayn"
# CTranslate2 float32 by its intra-op threads.
PEERS = {"ct2-float32": 2, "ct2-float32-1thread": 1}
# Its setting with oneDNN limited to AVX2 (2 threads), a peer where the CPU has AVX-512.
PEER_AVX2 = "ct2-float32-avx2"
ALL_PEERS = {**PEERS, PEER_AVX2: 2}


def peers(instructions: Sequence[str]) -> list[str]:
    """The CTranslate2 settings that take turns on a CPU with ``instructions``: the
    AVX2-limited one only where the CPU has AVX-512 (elsewhere it is the 2-thread one)."""
    return [*PEERS, PEER_AVX2] if "avx512f" in instructions else list(PEERS)


# Seconds between one turn and the next: the last system's OpenMP threads stop spinning.
GAP_S = 0.05
# The goals of docs/performance.md: batch throughput at least CTranslate2's, one-sentence
# latency at most 1.5× its.
BATCH_GOAL, SINGLE_GOAL = 1.0, 1.5


def take_turns(calls: dict[str, Callable[[int], float]], pairs: int) -> dict[str, list[float]]:
    """The seconds each of ``calls`` reports (given the turn's index) over ``pairs`` turns: in
    each turn every call runs once, in an order rotated by one from the turn before and
    reversed every other round of rotations, so that each runs first, last and after each
    other alike."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for turn in range(pairs):
        order = rotated(names, turn)
        if (turn // len(names)) % 2:
            order.reverse()
        for name in order:
            times[name].append(calls[name](turn))
    return times


def quartiles(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and range of ``values``."""
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": med, "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def paired_figure(times: dict[str, list[float]], batch: bool, rows: int) -> dict[str, Any]:
    """aiayn's figure against the faster CTranslate2 setting (by its median): each system's
    median (sentences/s for a batch of ``rows``, ms for one sentence) and the per-pair ratios
    (aiayn's throughput over CTranslate2's, or aiayn's latency over CTranslate2's), with
    whether the goal holds at their median."""
    settings = [name for name in ALL_PEERS if name in times]
    best = min(settings, key=lambda name: statistics.median(times[name]))
    ours, theirs = times[AIAYN], times[best]
    # Throughput ratio = their time / our time; latency ratio = our time / their time.
    ratios = [t / o if batch else o / t for o, t in zip(ours, theirs, strict=True)]
    spread = quartiles(ratios)

    def figure(seconds: list[float]) -> float:
        med = statistics.median(seconds)
        return rows / med if batch else 1000 * med

    goal_met = spread["median"] >= BATCH_GOAL if batch else spread["median"] <= SINGLE_GOAL
    return {
        "unit": "sentences/s" if batch else "ms",
        "figures": {name: figure(seconds) for name, seconds in times.items()},
        "best_peer": best,
        "ratio": spread,
        "goal_met": goal_met,
        "pairs": len(ratios),
    }


def serve(system: str, workload: str, models: Path) -> None:
    """A system's process: loads it, then decodes each turn it is told on stdin (``MODE
    INDEX``: the batch, or sentence INDEX alone) and answers with the seconds it took; on
    ``quit``, its peak RSS (MB)."""
    set_threads()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    dw = DECODE_WORKLOADS[workload]
    src = decode_sources(dw)
    if system == AIAYN:
        decode = aiayn_decoder(dw, compiled=True, weights=models / AIAYN_WEIGHTS)
    else:
        decode = ct2_decoder(dw, "float32", models, ALL_PEERS[system])
    warm: set[str] = set()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            print(peak_rss_mb(), flush=True)
            return
        mode, index = line.split()
        beam = dw.beam_size if mode.startswith("beam") else 1
        rows = src if mode.endswith("batch") else src[int(index) % src.size(0)][None]
        if mode not in warm:  # warm-up, and the system decodes exactly its steps
            check_length(system, decode(rows, beam), dw.steps)
            warm.add(mode)
        start = time.perf_counter()
        decode(rows, beam)
        print(time.perf_counter() - start, flush=True)


class Worker:
    """A :func:`serve` process."""

    def __init__(self, system: str, workload: str, models: Path) -> None:
        env = dict(os.environ)
        if system == PEER_AVX2:  # read by oneDNN when it first runs, so set for the process
            env[CT2_AVX2[0]] = CT2_AVX2[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.paired_decode", "--serve", system,
             "--workload", workload, "--models", str(models)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.system = system
        if self._answer() != "ready":
            raise RuntimeError(f"{system} did not start")

    def _answer(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.system} stopped (exit status {self.process.wait()})")
        return line.strip()

    def ask(self, request: str) -> float:
        assert self.process.stdin is not None
        self.process.stdin.write(request + "\n")
        self.process.stdin.flush()
        return float(self._answer())

    def close(self) -> float:
        """Ends the process; its peak RSS (MB)."""
        rss = self.ask("quit")
        self.process.wait()
        return rss


def run_workload(
    name: str, modes: Sequence[str], pairs: int, single: int, models: Path
) -> dict[str, Any]:
    rows = DECODE_WORKLOADS[name].n_sentences
    workers = [Worker(system, name, models) for system in (AIAYN, *peers(cpu_instructions()))]
    figures: dict[str, Any] = {}
    try:
        for mode in modes:
            batch = mode.endswith("batch")

            def turn(worker: Worker, mode: str = mode) -> Callable[[int], float]:
                def call(index: int) -> float:
                    time.sleep(GAP_S)
                    return worker.ask(f"{mode} {index}")

                return call

            calls = {worker.system: turn(worker) for worker in workers}
            times = take_turns(calls, pairs if batch else single)
            figures[mode] = paired_figure(times, batch, rows)
            print(f"{name} {mode}: {summary_line(figures[mode])}", file=sys.stderr, flush=True)
    finally:
        rss = {worker.system: worker.close() for worker in workers}
    for figure in figures.values():
        figure["peak_rss_mb"] = rss
    return figures


def summary_line(figure: dict[str, Any]) -> str:
    r = figure["ratio"]
    ours = figure["figures"][AIAYN]
    theirs = figure["figures"][figure["best_peer"]]
    return (
        f"aiayn {ours:.1f} {figure['unit']}, {figure['best_peer']} {theirs:.1f}: "
        f"{r['median']:.2f}× (quartiles {r['q1']:.2f}–{r['q3']:.2f}, "
        f"range {r['min']:.2f}–{r['max']:.2f}, {figure['pairs']} pairs)"
    )


MODE_NAMES = {
    "beam-batch": "beam 4, batch 64 (sent/s)",
    "greedy-batch": "greedy, batch 64 (sent/s)",
    "beam-single": "beam 4, one sentence (ms)",
    "greedy-single": "greedy, one sentence (ms)",
}


def render(result: dict[str, Any]) -> str:
    """The results as a Markdown paragraph and table."""
    lines = [
        f"Run of {result['date']} ({result['time']}) on {result['cpu']} "
        f"({', '.join(result['instructions']) or 'no listed instruction sets'}; "
        f"{result['threads']} threads), the code of {result['commit']}, "
        f"{result['minutes']:.1f} minutes; CTranslate2 {result['versions']['ctranslate2']}, "
        f"PyTorch {result['versions']['torch']}.",
        "",
        "| workload | figure | aiayn | CTranslate2's faster setting | paired ratio: median "
        "(quartiles; range) | pairs | goal |",
        "|---|---|---:|---:|---|---:|---|",
    ]
    for workload, figures in result["workloads"].items():
        for mode, f in figures.items():
            r = f["ratio"]
            threads = ALL_PEERS[f["best_peer"]]
            peer = f"{f['figures'][f['best_peer']]:.1f}, {threads} thread{'s' * (threads > 1)}"
            if f["best_peer"] == PEER_AVX2:
                peer += ", oneDNN limited to AVX2"
            spread = f"{r['q1']:.2f}–{r['q3']:.2f}; {r['min']:.2f}–{r['max']:.2f}"
            ratio = f"{r['median']:.2f}× ({spread})"
            lines.append(
                f"| {workload.upper()} | {MODE_NAMES[mode]} | {f['figures'][AIAYN]:.1f} | {peer} "
                f"| {ratio} | {f['pairs']} | {'met' if f['goal_met'] else 'not met'} |"
            )
    for workload, figures in result["workloads"].items():
        rss = next((f["peak_rss_mb"] for f in figures.values() if "peak_rss_mb" in f), None)
        if rss:
            each = ", ".join(f"{system} {mb:.0f}" for system, mb in rss.items())
            lines += ["", f"Peak RSS of each process at {workload.upper()} (MB): {each}."]
    return "\n".join(lines)


def write(result: dict[str, Any], folder: Path = RESULTS) -> Path:
    """Write ``paired-<host>.md`` and ``.json`` into ``folder``; the Markdown file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"paired-{host_slug()}.md"
    path.with_suffix(".json").write_text(json_text(result), encoding="utf-8")
    path.write_text(
        "# aiayn and CTranslate2 taking turns, batch by batch\n\n"
        "Written by `make bench-paired` (benchmarks/paired_decode.py).\n\n" + render(result) + "\n",
        encoding="utf-8",
    )
    return path


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", choices=sorted(DECODE_WORKLOADS),
                        default=["small", "base"])  # fmt: skip
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--pairs", type=int, default=9, help="turns of each batch mode")
    parser.add_argument("--single", type=int, default=16, help="sentences one at a time")
    parser.add_argument("--models", type=Path, help="converted models (default: a new folder)")
    parser.add_argument("--serve", choices=(AIAYN, *ALL_PEERS), help=argparse.SUPPRESS)
    parser.add_argument(
        "--write", action="store_true", help="write benchmarks/results/paired-<host>.{md,json}"
    )
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.workload[0], args.models)
        return
    if args.pairs < 2 or args.single < 2:
        parser.error("--pairs and --single need at least 2 turns (for quartiles)")
    missing = [m for m in ("ctranslate2", "transformers") if not available(m)]
    if missing:
        print(f"skipped: {', '.join(missing)} not installed (pip install -e '.[bench]')")
        return
    start = time.perf_counter()
    now = dt.datetime.now()
    result: dict[str, Any] = {
        "date": now.date().isoformat(),
        "time": now.strftime("%H:%M"),
        "cpu": cpu_model(),
        "instructions": cpu_instructions(),
        "threads": THREADS,
        "commit": _commit(),
        "versions": versions(),
        "workloads": {},
    }
    for name in args.workload:
        models = args.models / name if args.models else Path(tempfile.mkdtemp(prefix="aiayn-pair-"))
        models.mkdir(parents=True, exist_ok=True)
        if not (models / "ct2-float32").is_dir():
            convert_to_ctranslate2(DECODE_WORKLOADS[name].model, models)
        result["workloads"][name] = run_workload(name, args.modes, args.pairs, args.single, models)
    result["minutes"] = (time.perf_counter() - start) / 60
    emit({"kind": "paired", **result})
    print(render(result))
    if args.write:
        print(f"written: {write(result)}", file=sys.stderr)


if __name__ == "__main__":
    main()
