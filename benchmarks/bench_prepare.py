"""``aiayn prepare`` time and peak memory on Multi30k and on a synthetic corpus of 1M pairs.

Each run happens in a fresh subprocess, so its peak resident set size (``VmHWM``) is its
own: that includes importing aiayn (and torch, which ``import aiayn`` pulls in), reported
separately as the baseline. Phase times come from the progress messages of ``prepare_data``.
A second run with the same inputs measures the reuse path. Results go to
``benchmarks/results/prepare.md`` (``--out FILE`` elsewhere).

    .venv/bin/python benchmarks/bench_prepare.py                 # Multi30k + 1M synthetic
    .venv/bin/python benchmarks/bench_prepare.py --pairs 100000  # a smaller synthetic corpus
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
RESULTS = ROOT / "benchmarks" / "results" / "prepare.md"
MARKER = "PREPARE-BENCH "


# -- the synthetic corpus ---------------------------------------------------------------------


def _pseudo_words(rng: np.random.Generator, n: int, syllables: list[str]) -> np.ndarray:
    counts = rng.integers(1, 4, size=n)
    picks = rng.integers(0, len(syllables), size=int(counts.sum()))
    words, start = [], 0
    for c in counts.tolist():
        words.append("".join(syllables[p] for p in picks[start : start + c]))
        start += c
    return np.array(words, dtype=object)


def write_synthetic(prefix: Path, pairs: int, seed: int = 0) -> None:
    """Zipf-distributed pseudo-words; the target maps each word to its own target word, with
    local reordering, so the two sides have WMT-like lengths (mean about 24 words)."""
    stamp = Path(f"{prefix}.stamp")
    if stamp.is_file() and stamp.read_text() == f"{pairs} {seed}":
        return
    rng = np.random.default_rng(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    src_syl = [c + v for c in consonants for v in vowels]
    tgt_syl = [v + c for c in consonants for v in vowels] + [
        c + v + "n" for c in "ktsr" for v in vowels
    ]
    n_words = 30_000
    src_words = _pseudo_words(rng, n_words, src_syl)
    tgt_words = _pseudo_words(rng, n_words, tgt_syl)
    lengths = np.clip(rng.lognormal(3.0, 0.55, size=pairs).astype(np.int64), 1, 150)
    ranks = np.minimum(rng.zipf(1.15, size=int(lengths.sum())) - 1, n_words - 1)
    src_out = Path(f"{prefix}.src").open("w", encoding="utf-8")
    tgt_out = Path(f"{prefix}.tgt").open("w", encoding="utf-8")
    with src_out, tgt_out:
        start = 0
        for length in lengths.tolist():
            ids = ranks[start : start + length]
            start += length
            src_out.write(" ".join(src_words[ids]) + "\n")
            tgt_ids = ids.copy()
            swap = rng.integers(0, max(1, length - 1))
            if length > 1:
                tgt_ids[[swap, swap + 1]] = tgt_ids[[swap + 1, swap]]
            tgt_out.write(" ".join(tgt_words[tgt_ids]) + "\n")
    stamp.write_text(f"{pairs} {seed}")


# -- one measured run (child process) ---------------------------------------------------------


def child(spec: dict[str, Any]) -> None:
    started = time.perf_counter()
    from aiayn.data.prepare import prepare_data
    from benchmarks.common import peak_rss_mb

    baseline_mb = peak_rss_mb()
    events: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    manifest = prepare_data(
        spec["train"],
        spec["valid"],
        None,
        spec["src"],
        spec["tgt"],
        spec["vocab_size"],
        spec["out"],
        input_sentence_size=spec["input_sentence_size"],
        log=lambda message: events.append((time.perf_counter() - t0, message)),
    )
    total = time.perf_counter() - t0
    extra: dict[str, float] = {}
    if spec.get("sampler"):
        from aiayn.data.batching import TokenBatchSampler
        from aiayn.data.corpus import Corpus

        t1 = time.perf_counter()
        corpus = Corpus.open(spec["out"], "train")
        extra["open_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        sampler = TokenBatchSampler(corpus.src_lengths, corpus.tgt_lengths, 25_000)
        extra["batches"] = len(sampler)
        extra["sampler_epoch_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        for indices in list(sampler)[:200]:
            corpus.batch(indices)
        extra["collate_200_s"] = time.perf_counter() - t1
    result = {
        "total_s": total,
        "startup_s": t0 - started,
        "events": events,
        "baseline_rss_mb": baseline_mb,
        "peak_rss_mb": peak_rss_mb(),
        "pairs": {s: v["pairs"] for s, v in manifest["splits"].items()},
        "tokens": manifest["splits"]["train"]["tokens"],
        "dropped": manifest["dropped"],
        "disk_mb": sum(manifest["files"].values()) / 2**20,
        **extra,
    }
    print(MARKER + json.dumps(result), flush=True)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])},
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"benchmark run failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len(MARKER) :])


def phases(events: list[tuple[float, str]], total: float) -> dict[str, float]:
    """Seconds in reading, vocabulary training and encoding, from the progress messages."""
    out = {"read": 0.0, "vocab": 0.0, "encode": 0.0}
    marks = [*events, (total, "end")]
    for (t, message), (t_next, _) in pairwise(marks):
        key = (
            "read"
            if message.startswith("reading")
            else "vocab"
            if message.startswith(("training", "reusing"))
            else "encode"
            if message.startswith("encoding")
            else None
        )
        if key:
            out[key] += t_next - t
    return out


# -- report -----------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import sentencepiece

    return (
        f"{cpu}, {os.cpu_count()} CPUs (shared), {mem:.0f} GiB RAM; Python "
        f"{platform.python_version()}, sentencepiece {sentencepiece.__version__}, "
        f"numpy {np.__version__}"
    )


def row(name: str, spec: dict[str, Any], first: dict[str, Any], again: dict[str, Any]) -> str:
    p = phases(first["events"], first["total_s"])
    pairs = first["pairs"]["train"]
    return (
        f"| {name} | {pairs:,} | {spec['vocab_size']:,} | {spec['input_sentence_size']:,} | "
        f"{first['total_s']:.1f} | {p['read']:.1f} | {p['vocab']:.1f} | {p['encode']:.1f} | "
        f"{pairs / first['total_s']:,.0f} | {first['peak_rss_mb']:,.0f} | "
        f"{first['baseline_rss_mb']:,.0f} | {first['disk_mb']:,.0f} | {again['total_s']:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1_000_000, help="synthetic corpus size")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument(
        "--input-sentence-size",
        type=int,
        nargs="+",
        default=[2_000_000],
        help="sentences sampled for the vocabulary on the synthetic corpus, one run each "
        "(default: prepare's default, 2,000,000)",
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/aiayn-bench-prepare"))
    parser.add_argument("--skip-synthetic", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the report (Markdown)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    cases: list[tuple[str, dict[str, Any]]] = []
    if (MULTI30K / "train.en").is_file():
        cases.append(
            (
                "Multi30k en-de (train + val)",
                {
                    "train": str(MULTI30K / "train"),
                    "valid": str(MULTI30K / "val"),
                    "src": "en",
                    "tgt": "de",
                    "vocab_size": args.vocab_size,
                    "input_sentence_size": 2_000_000,
                    "out": str(work / "multi30k"),
                },
            )
        )
    else:
        print(f"{MULTI30K} not found: skipping Multi30k", file=sys.stderr)
    if not args.skip_synthetic:
        t = time.perf_counter()
        write_synthetic(work / "synthetic", args.pairs)
        write_synthetic(work / "synthetic-valid", 3000, seed=1)
        print(f"synthetic corpus ready in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        for sample in args.input_sentence_size:
            cases.append(
                (
                    f"synthetic, {args.pairs:,} pairs",
                    {
                        "train": str(work / "synthetic"),
                        "valid": str(work / "synthetic-valid"),
                        "src": "src",
                        "tgt": "tgt",
                        "vocab_size": args.vocab_size,
                        "input_sentence_size": sample,
                        "out": str(work / f"synthetic-data-{sample}"),
                        "sampler": sample == args.input_sentence_size[0],
                    },
                )
            )

    rows, notes = [], []
    for name, spec in cases:
        shutil.rmtree(spec["out"], ignore_errors=True)
        print(f"running: {name}", file=sys.stderr)
        first = measure(spec)
        again = measure(spec)
        rows.append(row(name, spec, first, again))
        if spec["out"].startswith(str(work / "synthetic-data")):
            shutil.rmtree(spec["out"], ignore_errors=True)  # 330 MB each
        print(json.dumps(first, indent=1), file=sys.stderr)
        if "batches" in first:
            notes.append(
                f"- {name}: opening the train split takes {first['open_s'] * 1000:.0f} ms "
                f"(memory maps); one epoch of `TokenBatchSampler` at 25,000 tokens per side is "
                f"{first['batches']:,} batches, built in {first['sampler_epoch_s']:.2f} s; "
                f"`Corpus.batch` of 200 of them takes {first['collate_200_s']:.2f} s."
            )
        tokens = first["tokens"]
        if spec["input_sentence_size"] != args.input_sentence_size[0]:
            continue
        notes.append(
            f"- {name}: {sum(tokens.values()):,} training tokens; dropped "
            + ", ".join(f"{k} {v:,}" for k, v in first["dropped"].items())
            + "."
        )

    header = (
        "| corpus | train pairs | vocab | spm sample | total s | read s | vocab s | encode s | "
        "pairs/s | peak RSS MB | of which import MB | disk MB | rerun s |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    command = " ".join(["benchmarks/bench_prepare.py", *sys.argv[1:]])
    text = f"""# `aiayn prepare`: time and peak memory

Written by `{command}` on {time.strftime("%Y-%m-%d")}.
Machine: {machine()}.
Timings on a shared machine are noisy; each figure is one run.

{header}
{chr(10).join(rows)}

- *total*: `prepare_data` from text files to a complete DATA_DIR (vocabulary included), one
  fresh process each. *read*: UTF-8 check, empty-line filter, staging copy. *vocab*:
  sentencepiece BPE training on at most *spm sample* sentences (sampled from both sides;
  `--input-sentence-size`, default 2,000,000).
  *encode*: sentencepiece encoding, length filters, writing ids, offsets and kept text.
- *peak RSS*: the peak resident set (`VmHWM`) of that process; *of which import*: the peak
  after `import aiayn` (torch is imported with it) before any data is touched. Reading and
  encoding stream the text in chunks of 20,000 lines, so the peak comes from sentencepiece's
  training sample (compare the two synthetic rows), not from the size of the corpus.
- *rerun*: the same command again: inputs and options unchanged, so DATA_DIR is reused.
{chr(10).join(notes)}
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
