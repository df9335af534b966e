"""aiayn's PyTorch engine against its own model exported to CTranslate2, on a trained model and
real text: the share of lines whose output tokens are identical, the BLEU of each (``aiayn
bleu``), and decoding speed in sentences/s at 1 and 2 threads, in interleaved rounds.

    .venv/bin/python -m experiments.ct2_export --checkpoint CKPT --source val.en \\
        --reference val.de [--rounds 3] [--threads 1 2] [--wait-quiet 60]

Each run is a subprocess (``worker``) that loads its engine, translates the first 32 lines to
warm up, then times ``translate_nbest`` over the whole file (the model's decode settings,
batches of ``decode.batch_tokens``); loading and exporting are not timed. The export is made
once, beforehand, beside a link to the checkpoint in a scratch directory, and timed on its
own. Writes ``experiments/results/ct2-export-<host>.json`` and ``.md`` (``<host>``:
:func:`benchmarks.common.host_slug`; or into ``--out``). ``--quick``: the first 10 lines, one
round at one thread, no waiting, into a temporary folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    cpu_model,
    emit,
    host_slug,
    json_text,
    load_average,
    median,
    parse_results,
    versions,
    wait_for_quiet,
)

from experiments import add_output_options, bleu, head, open_engine, output_folders, worker_env  # noqa: E402

WARMUP_LINES = 32
QUICK_LINES = 10

# name: (engine, quantize); the engines and weights compared.
SYSTEMS = {
    "aiayn torch fp32": ("torch", None),
    "CTranslate2 float32": ("ctranslate2", None),
    "CTranslate2 int8": ("ctranslate2", "int8"),
}
# name: (beam size, beam rule, systems); CTranslate2 has no paper rule.
MODES = {
    "greedy": (1, "fairseq", list(SYSTEMS)),
    "beam 4, fairseq rule": (4, "fairseq", list(SYSTEMS)),
    "beam 4, paper rule": (4, "paper", ["aiayn torch fp32"]),
}
REFERENCE_SYSTEM = "aiayn torch fp32"


# -- the worker (one engine, one setting, one process) ------------------------------------------


def worker(args: argparse.Namespace) -> None:
    from aiayn.inference.textio import read_lines

    lines = read_lines(args.source)
    overrides = {"beam_size": args.beam, "beam_rule": args.rule}
    translator = open_engine(args.checkpoint, args.engine, args.quantize, args.threads, overrides)
    translator.translate_nbest(lines[:WARMUP_LINES])
    start = time.perf_counter()
    results = translator.translate_nbest(lines)
    seconds = time.perf_counter() - start
    Path(args.out).write_text(
        "\n".join(hyps[0].text if hyps else "" for hyps in results) + "\n", encoding="utf-8"
    )
    tokens = [hyps[0].tokens if hyps else [] for hyps in results]
    Path(args.out).with_suffix(".ids.json").write_text(json.dumps(tokens), encoding="utf-8")
    emit({"seconds": seconds, "sentences": len(lines)})


# -- the parent -----------------------------------------------------------------------------------


def cpu_flags() -> list[str]:
    """The CPU's AVX-512 and AMX flags (from /proc/cpuinfo)."""
    from aiayn.accel.cpu import cpu_flags as all_flags

    return sorted(f for f in all_flags() if f.startswith(("avx512", "amx")))


def run_worker(
    checkpoint: Path, source: Path, out: Path, engine: str, quantize: str | None, beam: int,
    rule: str, threads: int,
) -> dict[str, Any]:  # fmt: skip
    argv = [
        sys.executable, "-m", "experiments.ct2_export", "worker", "--checkpoint", str(checkpoint),
        "--source", str(source), "--out", str(out), "--engine", engine, "--beam", str(beam),
        "--rule", rule, "--threads", str(threads),
    ]  # fmt: skip
    if quantize:
        argv += ["--quantize", quantize]
    done = subprocess.run(argv, capture_output=True, text=True, env=worker_env(threads), cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr}")
    [result] = parse_results(done.stdout)
    return result


def export_seconds(checkpoint: Path, scratch: Path, quantize: str | None) -> float:
    out = scratch / f"timed-export-{quantize or 'float32'}"
    argv = [sys.executable, "-m", "aiayn", "export-ct2", str(checkpoint), "--out", str(out)]
    if quantize:
        argv += ["--quantization", quantize]
    start = time.perf_counter()
    subprocess.run(argv, capture_output=True, env=worker_env(2), check=True, cwd=ROOT)
    return time.perf_counter() - start


def identical_share(ours: list[list[int]], theirs: list[list[int]]) -> float:
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="aiayn-ct2-bench-"))
    checkpoint = scratch / args.checkpoint.name  # the export cache goes beside this link
    checkpoint.symlink_to(args.checkpoint.resolve())
    load_start = load_average()
    waited = wait_for_quiet(args.wait_quiet)
    exports = {q or "float32": export_seconds(checkpoint, scratch, q) for q in (None, "int8")}
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for mode, (beam, rule, systems) in MODES.items():
            for system in systems:
                engine, quantize = SYSTEMS[system]
                for threads in args.threads:
                    print(f"round {round_ + 1}: {mode}, {system}, {threads} thread(s)", flush=True)
                    slug = re.sub(r"\W+", "-", f"{mode}-{system}-{threads}-{round_}").lower()
                    out = scratch / f"{slug}.txt"
                    result = run_worker(
                        checkpoint, args.source, out, engine, quantize, beam, rule, threads
                    )
                    ids = json.loads(out.with_suffix(".ids.json").read_text(encoding="utf-8"))
                    runs.append(
                        {"round": round_, "mode": mode, "system": system, "threads": threads,
                         "out": out, "ids": ids, **result}
                    )  # fmt: skip
    rows = []
    for mode, (_, _, systems) in MODES.items():
        for system in systems:
            mine = [r for r in runs if r["mode"] == mode and r["system"] == system]
            first = mine[0]
            speeds = {
                t: median([r["sentences"] / r["seconds"] for r in mine if r["threads"] == t])
                for t in args.threads
            }
            best = max(speeds, key=lambda t: speeds[t])
            row: dict[str, Any] = {
                "mode": mode,
                "system": system,
                "sentences_per_s": {str(t): s for t, s in speeds.items()},
                "best_threads": best,
                "stable": all(r["ids"] == first["ids"] for r in mine),
            }
            row["bleu"], row["chrf"] = bleu(first["out"], args.reference)
            for ref_mode in (mode, "beam 4, paper rule") if mode.startswith("beam") else (mode,):
                reference = next(
                    r for r in runs
                    if r["mode"] == ref_mode and r["system"] == REFERENCE_SYSTEM
                    and r["threads"] == first["threads"] and r["round"] == 0
                )  # fmt: skip
                key = re.sub(r"\W+", "_", ref_mode)
                row["identical_to_" + key] = identical_share(reference["ids"], first["ids"])
                row["differing_lines_" + key] = [
                    n + 1
                    for n, (a, b) in enumerate(zip(reference["ids"], first["ids"], strict=True))
                    if a != b
                ]
            rows.append(row)
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "checkpoint": str(args.checkpoint),
        "source": str(args.source),
        "reference": str(args.reference),
        "sentences": runs[0]["sentences"],
        "rounds": args.rounds,
        "threads": args.threads,
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "logical_cpus": os.cpu_count(),
        "versions": versions(),
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "waited_for_quiet_s": round(waited, 1),
        "export_seconds": exports,
        "rows": rows,
        "runs": [
            {k: r[k] for k in ("round", "mode", "system", "threads", "seconds", "sentences")}
            for r in runs
        ],
    }


def markdown(report: dict[str, Any]) -> str:
    threads = report["threads"]
    lines = [
        "## aiayn's PyTorch engine and its CTranslate2 export",
        "",
        f"Run: {report['date']} · {report['rounds']} interleaved rounds · "
        f"{report['sentences']:,} sentences of `{Path(report['source']).name}` · checkpoint "
        f"`{Path(report['checkpoint']).name}`",
        "",
        f"CPU: {report['cpu']}, {report['logical_cpus']} logical CPUs; flags "
        f"{' '.join(report['cpu_flags']) or 'none'}",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        "",
        f"Load average at start / end: {report['load_average_start']} / "
        f"{report['load_average_end']}",
        "",
        "Export (`aiayn export-ct2`, once): "
        + ", ".join(f"{q} {s:.1f} s" for q, s in report["export_seconds"].items()),
        "",
        "| decoding | system | identical to aiayn (same rule) | identical to aiayn "
        "(paper rule) | BLEU | chrF | "
        + " | ".join(f"sent/s, {t} thread{'s' * (t > 1)}" for t in threads)
        + " |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * len(threads),
    ]
    for row in report["rows"]:
        same = row.get("identical_to_" + re.sub(r"\W+", "_", row["mode"]))
        paper = row.get("identical_to_beam_4_paper_rule")
        speeds = [
            f"**{row['sentences_per_s'][str(t)]:.1f}**"
            if t == row["best_threads"]
            else f"{row['sentences_per_s'][str(t)]:.1f}"
            for t in threads
        ]
        lines.append(
            f"| {row['mode']} | {row['system']} | {100 * same:.1f}% | "
            + (
                f"{100 * paper:.1f}% | "
                if paper is not None and "fairseq" in row["mode"]
                else "– | "
            )
            + f"{row['bleu']:.2f} | {row['chrf']:.2f} | "
            + " | ".join(speeds)
            + " |"
        )
    unstable = [f"{r['system']} ({r['mode']})" for r in report["rows"] if not r["stable"]]
    lines += [
        "",
        "Identical: the output tokens of the best hypothesis, line by line, against aiayn's "
        "PyTorch engine at the same thread count. Speeds: medians over the rounds, bold at the "
        "faster thread count. Outputs "
        + ("differ between rounds or thread counts for " + ", ".join(unstable) if unstable
           else "were the same in every round and at every thread count")
        + ".",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("worker")
    run.add_argument("--checkpoint", required=True)
    run.add_argument("--source", required=True)
    run.add_argument("--out", required=True)
    run.add_argument("--engine", choices=["torch", "ctranslate2"], required=True)
    run.add_argument("--quantize", choices=["int8"])
    run.add_argument("--beam", type=int, required=True)
    run.add_argument("--rule", choices=["paper", "fairseq"], required=True)
    run.add_argument("--threads", type=int, required=True)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--source", type=Path)
    parser.add_argument("--reference", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--wait-quiet", type=float, default=60.0, help="seconds at most")
    parser.add_argument("--name", help="results file name (default: ct2-export-<host>)")
    add_output_options(parser, f"the first {QUICK_LINES} lines, 1 round, 1 thread, no waiting")
    args = parser.parse_args()
    if args.command == "worker":
        worker(args)
        return
    if args.checkpoint is None or args.source is None or args.reference is None:
        parser.error("--checkpoint, --source and --reference are required")
    folder, _ = output_folders(args)
    if args.quick:
        args.rounds, args.threads, args.wait_quiet = 1, [1], 0.0
        args.source = head(args.source, folder / f"quick{args.source.suffix}", QUICK_LINES)
        args.reference = head(args.reference, folder / f"quick{args.reference.suffix}", QUICK_LINES)
    name = args.name or f"ct2-export-{host_slug()}"
    report = measure(args)
    (folder / f"{name}.json").write_text(json_text(report))
    text = markdown(report)
    (folder / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
