"""Every benchmark, one command: ``make bench`` (or ``--quick`` for a smoke run).

Each (system, workload) runs in a subprocess of its own, so that its peak RSS is its own and
no system inherits another's allocator state or thread pool. Systems are interleaved: each
round runs every system once, in an order rotated from round to round, and the timings of all
rounds are pooled before taking medians; the matmul ceiling is measured once per round too.
Writes ``benchmarks/results/bench-<host>.{md,json}`` (``<host>``: :func:`common.host_slug`,
e.g. ``epyc-zen4``); the JSON holds each figure's median, its rounds and the count of timings,
not the timings themselves. ``--quick`` writes to a new temporary folder unless ``--out`` is
given. docs/performance.md points at the file of each host.

    .venv/bin/python benchmarks/run_all.py [--quick] [--only train decode] [--rounds N]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make the ``benchmarks`` package importable
    sys.path.insert(0, str(ROOT))

from aiayn.accel.memory import TRAIN as RETAINED_THRESHOLDS  # noqa: E402
from benchmarks import decode_bench, train_bench  # noqa: E402
from benchmarks.common import (  # noqa: E402
    THREADS,
    WORKLOADS,
    busy_cpu_seconds,
    host_slug,
    json_text,
    load_average,
    machine,
    median,
    parse_results,
    rotated,
    training_flops_per_target_token,
    versions,
    wait_for_quiet,
)
from benchmarks.report import render  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

# Every system each benchmark knows, in that order.
TRAIN_SYSTEMS = list(train_bench.SYSTEMS)
DECODE_SYSTEMS = list(decode_bench.SYSTEMS)
BASE_DECODE_SYSTEMS = [
    "aiayn",
    "aiayn-eager",
    "ct2-float32",
    "ct2-float32-1thread",
    "ct2-float32-avx2",
]

# (warm-up updates, timed updates) per round.
TRAIN_STEPS = {
    "full": {"small": (3, 8), "base": (2, 4)},
    "quick": {"small": (2, 3), "base": (1, 2)},
}
DECODE_ARGS = {"full": ["--repeats", "3"], "quick": ["--repeats", "1", "--single", "8"]}


# aiayn's training processes keep freed memory for reuse (the malloc thresholds of
# ``aiayn.accel.accelerate(mode="train")``, as its Trainer has them; its decoding processes the
# bounded decoding setting, as its Translator does); ``--peer-malloc retained`` gives the
# peers' processes the training setting through the environment, to show what it is worth.
RETAINED_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(RETAINED_THRESHOLDS[0]),
    "MALLOC_TRIM_THRESHOLD_": str(RETAINED_THRESHOLDS[1]),
}
PEER_MALLOC: dict[str, str] = {}

# ``--isa avx2``: every process (both systems, the matmul ceiling, the compiled step's build)
# limited to the instructions of a host without AVX-512, through each library's own switch:
# oneDNN (PyTorch's and CTranslate2's), PyTorch's kernels, MKL, CTranslate2's kernels, and the
# compiler flags of the compiled step (else ``-march=native``). The cores, caches and memory
# stay this host's: it shows what the code does without AVX-512, not what another CPU does.
ISA_LIMITS = {
    "avx2": {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "CT2_FORCE_CPU_ISA": "AVX2",
        "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3",
    },
}
ISA_LIMIT: dict[str, str] = {}


def child_env(system: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # The 1-thread CTranslate2 row is one thread throughout: with OMP_NUM_THREADS=2 its MKL
    # products still fork, and on the 2-core machine one sentence at a time took 69-94 ms
    # instead of 20-30 ms.
    threads = 1 if system is not None and system.endswith("-1thread") else THREADS
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(threads)
    env.update(ISA_LIMIT)
    if system is not None and system.endswith("-avx2"):
        env.setdefault(*decode_bench.CT2_AVX2)
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if system is not None and not system.startswith("aiayn"):
        env.update(PEER_MALLOC)
    return env


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_child(
    module: str, args: list[str], quiet_s: float = 0.0, timeout: float = 1800
) -> list[dict[str, Any]]:
    """Run ``python -m benchmarks.<module> args`` and return the results it reported, each
    with ``background_cpus``: the CPUs' worth of work other processes did meanwhile."""
    cmd = [sys.executable, "-m", f"benchmarks.{module}", *args]
    waited = wait_for_quiet(quiet_s) if quiet_s > 0 else 0.0
    print("  $", " ".join(cmd[2:]), file=sys.stderr, flush=True)
    busy0, ours0, start = busy_cpu_seconds(), children_cpu_seconds(), time.perf_counter()
    system = args[args.index("--system") + 1] if "--system" in args else None
    proc = subprocess.run(
        cmd, cwd=ROOT, env=child_env(system), capture_output=True, text=True, timeout=timeout
    )
    wall = time.perf_counter() - start
    others = (busy_cpu_seconds() - busy0) - (children_cpu_seconds() - ours0)
    results = parse_results(proc.stdout)
    if proc.returncode != 0 or not results:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd[2:])} failed ({proc.returncode}):\n" + "\n".join(tail))
    for r in results:
        r["background_cpus"] = max(0.0, others / wall)
        r["waited_s"] = waited
        if "skipped" in r:
            print(f"    skipped {r['system']}: {r['skipped']}", file=sys.stderr)
    return results


def merge_train(runs: list[dict[str, Any]], workload: str) -> dict[str, Any]:
    if any("skipped" in r for r in runs):
        return runs[0]
    times = [t for r in runs for t in r["times_s"]]
    w = WORKLOADS[workload]
    step = median(times)
    return {
        "samples": len(times),
        "median_s": step,
        "tokens_per_s": w.tgt_tokens / step,
        "gflops": w.tgt_tokens * training_flops_per_target_token(w) / step / 1e9,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "build_s": median([r["build_s"] for r in runs]),
        "background_cpus": max(r["background_cpus"] for r in runs),
    }


def merge_decode(runs: list[dict[str, Any]]) -> dict[str, Any]:
    if any("skipped" in r for r in runs):
        return runs[0]
    modes: dict[str, Any] = {}
    for mode in runs[0]["modes"]:  # the first round runs every mode, later ones a subset
        done = [r["modes"][mode] for r in runs if mode in r["modes"]]
        times = [t for d in done for t in d["times_s"]]
        m = median(times)
        entry: dict[str, Any] = {"samples": len(times), "median_s": m}
        # Each round's own median too, for the spread between rounds.
        if mode.endswith("batch"):
            n = done[0]["sentences_per_s"] * done[0]["median_s"]  # sentences per batch
            entry["sentences_per_s"] = n / m
            entry["rounds"] = [n / d["median_s"] for d in done]
        else:
            entry["latency_ms"] = 1000 * m
            entry["rounds"] = [1000 * d["median_s"] for d in done]
        modes[mode] = entry
    merged = {
        "modes": modes,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "build_s": median([r["build_s"] for r in runs]),
        "background_cpus": max(r["background_cpus"] for r in runs),
    }
    for key in ("step_compile_s", "step_load_s"):  # aiayn's compiled decoder step
        values = [r[key] for r in runs if key in r]
        if values:
            merged[key] = median(values)
    return merged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, one round (~3 min)")
    parser.add_argument(
        "--only", nargs="+", choices=["train", "decode"], default=["train", "decode"]
    )
    parser.add_argument(
        "--workloads", nargs="+", choices=sorted(WORKLOADS), default=["small", "base"]
    )
    parser.add_argument("--train-systems", nargs="+", default=TRAIN_SYSTEMS)
    parser.add_argument("--decode-systems", nargs="+", default=DECODE_SYSTEMS)
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3, quick 1)")
    parser.add_argument(
        "--out",
        type=Path,
        help="the Markdown file to write, the JSON beside it (default: "
        "benchmarks/results/bench-<host>.md; with --quick, a new temporary folder)",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        help="before each measurement, wait up to this many seconds for other processes to "
        "go quiet (default 60, quick 0)",
    )
    parser.add_argument(
        "--peer-malloc",
        choices=["as-shipped", "retained"],
        default="as-shipped",
        help="run the peers with glibc's malloc as it comes (default) or with the setting "
        "aiayn applies to itself (aiayn.accel); 'retained' writes bench-<host>-retained.md",
    )
    parser.add_argument(
        "--isa",
        choices=sorted(ISA_LIMITS),
        help="limit every process to these instructions (as on a host without AVX-512); "
        "writes bench-<host>-<isa>.md",
    )
    args = parser.parse_args(argv)
    if args.peer_malloc == "retained":
        PEER_MALLOC.update(RETAINED_MALLOC_ENV)
    if args.isa:
        ISA_LIMIT.update(ISA_LIMITS[args.isa])
    if args.out is None:  # a limited run's results beside the unlimited one's, not over them
        limits = ["retained"] * bool(PEER_MALLOC) + [args.isa] * bool(args.isa)
        folder = Path(tempfile.mkdtemp(prefix="aiayn-bench-")) if args.quick else RESULTS
        args.out = folder / ("-".join(["bench", host_slug(), *limits]) + ".md")
    mode = "quick" if args.quick else "full"
    rounds = args.rounds or (1 if args.quick else 3)
    quiet_s = args.wait_quiet if args.wait_quiet is not None else (0.0 if args.quick else 60.0)
    start = time.perf_counter()
    load_start = load_average()
    results: dict[str, Any] = {"train": {}, "decode": {}}
    ceilings: list[float] = []

    def measure_ceiling() -> None:
        ceilings.extend(r["gflops"] for r in run_child("matmul_bench", [], quiet_s))

    if "train" in args.only:
        for workload in args.workloads:
            warmup, steps = TRAIN_STEPS[mode][workload]
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.train_systems}
            for r in range(rounds):
                print(f"training {workload}, round {r + 1}/{rounds}", file=sys.stderr)
                measure_ceiling()
                for system in rotated(args.train_systems, r):
                    flags = ["--system", system, "--workload", workload]
                    flags += ["--warmup", str(warmup), "--steps", str(steps)]
                    runs[system] += run_child("train_bench", flags, quiet_s)
            results["train"][workload] = {s: merge_train(v, workload) for s, v in runs.items()}

    if "decode" in args.only:
        ct2_root = Path(tempfile.mkdtemp(prefix="aiayn-bench-ct2-"))
        for workload in args.workloads:
            # BASE: aiayn against CTranslate2 float32 only (the figures the goals ask for).
            systems = [
                s for s in args.decode_systems if workload == "small" or s in BASE_DECODE_SYSTEMS
            ]
            if not systems or (workload != "small" and args.quick):
                continue  # a smoke run decodes SMALL only
            ct2_dir = ct2_root / workload
            wanted = ("ctranslate2", "transformers")
            if any(s.startswith("ct2") for s in systems) and all(
                map(importlib.util.find_spec, wanted)
            ):
                convert = ["--convert-only", "--ct2-dir", str(ct2_dir), "--workload", workload]
                run_child("decode_bench", convert)
            step_build: dict[str, Any] = {}
            if "aiayn" in systems:  # its decoder step compiled (or found) before the rounds
                (step_build,) = run_child(
                    "decode_bench",
                    ["--compile-only", "--workload", workload, "--ct2-dir", str(ct2_dir)],
                )
            decode_runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
            for r in range(rounds):
                print(f"decoding {workload}, round {r + 1}", file=sys.stderr)
                measure_ceiling()
                for system in rotated(systems, r):
                    flags = ["--system", system, "--ct2-dir", str(ct2_dir), "--workload", workload]
                    decode_runs[system] += run_child(
                        "decode_bench", flags + DECODE_ARGS[mode], quiet_s
                    )
            merged = {s: merge_decode(v) for s, v in decode_runs.items()}
            if "step_compile_s" in step_build and "modes" in merged.get("aiayn", {}):
                merged["aiayn"]["step_compile_s"] = step_build["step_compile_s"]
            results["decode" if workload == "small" else f"decode_{workload}"] = merged
        shutil.rmtree(ct2_root, ignore_errors=True)

    if not ceilings:
        measure_ceiling()
    results["matmul"] = {"gflops": median(ceilings), "runs_gflops": ceilings}
    results["meta"] = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "mode": f"{mode} ({rounds} interleaved round(s))",
        "machine": machine(),
        "versions": versions(),
        "load_start": load_start,
        "load_end": load_average(),
        "wall_s": time.perf_counter() - start,
        "notes": [
            "These benchmarks measure the CPU; GPU figures are measured apart "
            "(docs/performance.md, 'On a GPU').",
            "aiayn's training processes keep freed memory for reuse (aiayn.accel, as its "
            "Trainer does), its decoding processes freed blocks under 16 MiB (as its Translator "
            "does); the peers' processes ran "
            "with glibc's malloc "
            + (
                "given the same setting (--peer-malloc retained)."
                if PEER_MALLOC
                else "as it comes (--peer-malloc retained gives them the same setting)."
            ),
            *(
                [
                    f"Every process was limited to {args.isa.upper()} instructions ("
                    + ", ".join(f"{k}={v}" for k, v in ISA_LIMIT.items())
                    + "), on this host's cores, caches and memory."
                ]
                if ISA_LIMIT
                else []
            ),
        ],
    }
    text = json_text(results)
    markdown = render(json.loads(text))  # as tests/test_committed_results.py renders it
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown, encoding="utf-8")
    args.out.with_suffix(".json").write_text(text, encoding="utf-8")
    print(markdown)
    print(f"written: {args.out} and {args.out.with_suffix('.json').name}", file=sys.stderr)


if __name__ == "__main__":
    main()
