"""int8 against float32 on a trained model and real text: ``aiayn translate --quantize int8``
(CTranslate2's int8 weights, ``int8_float32``) beside float32, both in CTranslate2 and in
aiayn's default PyTorch engine: BLEU and chrF (``aiayn bleu``), the share of lines identical
to each float32 engine, decoding speed at beam 4 in batches of 64 sentences and one sentence
at a time, and peak RSS, in interleaved rounds.

    .venv/bin/python -m experiments.int8 --checkpoint CKPT --source val.en \\
        --reference val.de [--rounds 3] [--threads 1] [--single 200] [--wait-quiet 60]

Each measurement is a subprocess (``worker``) that loads its engine as ``aiayn translate``
would, warms up on the first 32 lines, translates the whole source in batches of 64 lines
(one decoding batch each; its output is scored) and then the first ``--single`` lines one at
a time; loading and exporting are not timed. Every engine decodes with the checkpoint's
decode settings at beam 4; CTranslate2's beam search is the ``fairseq`` rule, the PyTorch
engine's the run's rule (``paper`` by default), as ``aiayn translate`` decodes with each.
Writes ``experiments/results/int8-<host>.json`` and ``.md`` (``<host>``:
:func:`benchmarks.common.host_slug`; or into ``--out``). ``--quick``: the first 64 lines, 16
of them one at a time, one round, no waiting, into a temporary folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
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
    peak_rss_mb,
    versions,
    wait_for_quiet,
)

from experiments import add_output_options, bleu, head, open_engine, output_folders, worker_env  # noqa: E402

WARMUP_LINES = 32
BATCH = 64
BEAM = 4
QUICK_LINES = 64
QUICK_SINGLE = 16

# name: (engine, quantize), as ``aiayn translate`` spells them; the first is the default.
SYSTEMS = {
    "float32, PyTorch": ("torch", None),
    "float32, CTranslate2": ("ctranslate2", None),
    "int8, CTranslate2": ("ctranslate2", "int8"),
}
FLOAT32 = ["float32, PyTorch", "float32, CTranslate2"]


# -- the worker (one engine in one process) -------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    from aiayn.inference.textio import read_lines

    lines = read_lines(args.source)
    # Batches of BATCH lines are made here: the token budget never splits one.
    overrides = {"beam_size": BEAM, "batch_tokens": 1 << 20}
    translator = open_engine(
        args.checkpoint, args.engine, args.quantize, args.threads, overrides, process_settings=True
    )
    details: dict[str, Any] = {}
    if args.engine == "torch":
        assert translator.acceleration is not None
        details["levers"] = list(translator.acceleration.levers)
    else:
        details["compute_type"] = translator.compute_type
    details["beam_rule"] = translator.decode.beam_rule
    translator.translate(lines[:WARMUP_LINES])
    outputs: list[str] = []
    start = time.perf_counter()
    for first in range(0, len(lines), BATCH):
        outputs += translator.translate(lines[first : first + BATCH])
    batched = time.perf_counter() - start
    single = lines[: args.single]
    start = time.perf_counter()
    for line in single:
        translator.translate([line])
    one_at_a_time = time.perf_counter() - start
    Path(args.out).write_text("\n".join(outputs) + "\n", encoding="utf-8")
    emit(
        {
            "sentences": len(lines),
            "batch_s": batched,
            "single_sentences": len(single),
            "single_s": one_at_a_time,
            "peak_rss_mb": peak_rss_mb(),
            **details,
        }
    )


# -- the parent -----------------------------------------------------------------------------------


def run_worker(args: argparse.Namespace, system: str, threads: int, out: Path) -> dict[str, Any]:
    engine, quantize = SYSTEMS[system]
    argv = [
        sys.executable, "-m", "experiments.int8", "worker", "--checkpoint", str(args.checkpoint),
        "--source", str(args.source), "--out", str(out), "--engine", engine,
        "--threads", str(threads), "--single", str(args.single),
    ]  # fmt: skip
    if quantize:
        argv += ["--quantize", quantize]
    done = subprocess.run(argv, capture_output=True, text=True, env=worker_env(threads), cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr}")
    [result] = parse_results(done.stdout)
    return result


def identical_share(ours: list[str], theirs: list[str]) -> float:
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from aiayn.interop.ct2 import cached_export

    scratch = Path(tempfile.mkdtemp(prefix="aiayn-int8-"))
    # The exports are cached beside this link, made before the timed rounds.
    link = scratch / args.checkpoint.name
    link.symlink_to(args.checkpoint.resolve())
    args.checkpoint = link
    load_start = load_average()
    waited = wait_for_quiet(args.wait_quiet)
    for quantize in (None, "int8"):
        cached_export(link, quantize)
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for threads in args.threads:
            for system in SYSTEMS:
                print(f"round {round_ + 1}: {system}, {threads} thread(s)", flush=True)
                slug = re.sub(r"\W+", "-", f"{system}-{threads}-{round_}").lower()
                out = scratch / f"{slug}.txt"
                result = run_worker(args, system, threads, out)
                lines = out.read_text(encoding="utf-8").splitlines()
                runs.append(
                    {"round": round_, "system": system, "threads": threads, "out": out,
                     "lines": lines, **result}
                )  # fmt: skip
    first = {r["system"]: r for r in runs if r["round"] == 0 and r["threads"] == args.threads[0]}
    rows = []
    for system in SYSTEMS:
        mine = [r for r in runs if r["system"] == system]
        row: dict[str, Any] = {
            "system": system,
            "engine": SYSTEMS[system][0],
            "quantize": SYSTEMS[system][1],
            "beam_rule": mine[0]["beam_rule"],
            "compute_type": mine[0].get("compute_type"),
            "levers": mine[0].get("levers"),
            "batch_sentences_per_s": {
                str(t): median([r["sentences"] / r["batch_s"] for r in mine if r["threads"] == t])
                for t in args.threads
            },
            "single_ms": {
                str(t): median(
                    [1e3 * r["single_s"] / r["single_sentences"] for r in mine if r["threads"] == t]
                )
                for t in args.threads
            },
            "peak_rss_mb": median([r["peak_rss_mb"] for r in mine]),
            "stable": all(r["lines"] == mine[0]["lines"] for r in mine),
        }
        row["bleu"], row["chrf"] = bleu(first[system]["out"], args.reference)
        for reference in FLOAT32:
            key = "identical_to_" + re.sub(r"\W+", "_", reference).lower()
            row[key] = identical_share(first[reference]["lines"], first[system]["lines"])
        rows.append(row)
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "checkpoint": str(args.checkpoint_given),
        "source": str(args.source_given),
        "reference": str(args.reference_given),
        "sentences": runs[0]["sentences"],
        "single_sentences": runs[0]["single_sentences"],
        "beam": BEAM,
        "batch": BATCH,
        "rounds": args.rounds,
        "threads": args.threads,
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "versions": versions(),
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "waited_for_quiet_s": round(waited, 1),
        "rows": rows,
        "runs": [
            {k: r[k] for k in ("round", "system", "threads", "batch_s", "single_s", "peak_rss_mb")}
            for r in runs
        ],
    }


def markdown(report: dict[str, Any]) -> str:
    threads = report["threads"]
    per = [f", {t} thread{'s' * (t > 1)}" if len(threads) > 1 else "" for t in threads]
    lines = [
        "## int8 (`--quantize int8`, CTranslate2) against float32",
        "",
        f"Run: {report['date']} · {report['rounds']} interleaved rounds · "
        f"{report['sentences']:,} sentences of `{Path(report['source']).name}` · checkpoint "
        f"`{Path(report['checkpoint']).name}` · beam {report['beam']}",
        "",
        f"CPU: {report['cpu']}, {report['logical_cpus']} logical CPUs; "
        + ", ".join(f"{t} decoding thread{'s' * (t > 1)}" for t in threads),
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        "",
        f"Load average at start / end: {report['load_average_start']} / "
        f"{report['load_average_end']}",
        "",
        "| weights, engine | beam rule | BLEU | chrF | lines identical to float32 PyTorch "
        "| to float32 CTranslate2 | "
        + " | ".join(f"sent/s, batches of {report['batch']}{p}" for p in per)
        + " | "
        + " | ".join(f"ms per sentence, one at a time{p}" for p in per)
        + " | peak RSS (MB) |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * (2 * len(threads)) + "---:|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['system']} | {row['beam_rule']} | {row['bleu']:.2f} | {row['chrf']:.2f} | "
            f"{100 * row['identical_to_float32_pytorch']:.1f}% | "
            f"{100 * row['identical_to_float32_ctranslate2']:.1f}% | "
            + " | ".join(f"{row['batch_sentences_per_s'][str(t)]:.1f}" for t in threads)
            + " | "
            + " | ".join(f"{row['single_ms'][str(t)]:.1f}" for t in threads)
            + f" | {row['peak_rss_mb']:.0f} |"
        )
    unstable = [r["system"] for r in report["rows"] if not r["stable"]]
    torch_row = next(r for r in report["rows"] if r["engine"] == "torch")
    lines += [
        "",
        f"Speeds: medians over the rounds; sent/s: the {report['sentences']:,} sentences "
        f"translated {report['batch']} at a time (one decoding batch each); ms per sentence: "
        f"the first {report['single_sentences']} translated one at a time. BLEU and chrF: "
        "sacreBLEU (`aiayn bleu`) of the first round's output. The PyTorch engine's levers: "
        + (", ".join(torch_row["levers"]) or "none")
        + ". Outputs "
        + ("differ between rounds for " + ", ".join(unstable) if unstable
           else "were the same in every round")
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
    run.add_argument("--threads", type=int, required=True)
    run.add_argument("--single", type=int, required=True)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--source", type=Path)
    parser.add_argument("--reference", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--single", type=int, default=200, help="lines translated one at a time (200)"
    )
    parser.add_argument("--wait-quiet", type=float, default=60.0, help="seconds at most")
    parser.add_argument("--name", help="results file name (default: int8-<host>)")
    add_output_options(
        parser, f"the first {QUICK_LINES} lines ({QUICK_SINGLE} one at a time), 1 round"
    )
    args = parser.parse_args()
    if args.command == "worker":
        worker(args)
        return
    if args.checkpoint is None or args.source is None or args.reference is None:
        parser.error("--checkpoint, --source and --reference are required")
    folder, _ = output_folders(args)
    args.checkpoint_given, args.source_given, args.reference_given = (
        args.checkpoint, args.source, args.reference,
    )  # fmt: skip
    if args.quick:
        args.rounds, args.wait_quiet, args.single = 1, 0.0, QUICK_SINGLE
        args.source = head(args.source, folder / f"quick{args.source.suffix}", QUICK_LINES)
        args.reference = head(args.reference, folder / f"quick{args.reference.suffix}", QUICK_LINES)
    name = args.name or f"int8-{host_slug()}"
    report = measure(args)
    (folder / f"{name}.json").write_text(json_text(report))
    text = markdown(report)
    (folder / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
