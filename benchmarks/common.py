"""What every benchmark shares: the fixed workloads, their random data, FLOP counts, timing
and the JSON line a benchmark subprocess reports back to ``run_all.py``.

The workloads are fixed, so that results stay comparable across runs:
random weights, random token ids, fp32, 2 threads, shared vocabulary with tied embeddings,
dropout 0.1, label smoothing 0.1, Adam.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import random
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

THREADS = 2
RESULT_MARKER = "BENCH-RESULT "

# Special ids (aiayn's: PAD 0, UNK 1, BOS 2, EOS 3); random tokens avoid 0..3 and the last id,
# which the Marian peer uses as its padding / decoder-start token.
PAD_ID, BOS_ID, EOS_ID = 0, 2, 3
FIRST_WORD_ID = 4


@dataclass(frozen=True)
class Workload:
    """One training workload: model sizes and the shape of one batch."""

    name: str
    d_model: int
    d_ff: int
    n_heads: int
    n_layers: int
    vocab_size: int
    batch: int
    src_len: int
    tgt_len: int
    dropout: float = 0.1
    label_smoothing: float = 0.1

    def model_config(self) -> Any:
        """aiayn's ``ModelConfig`` of these sizes (the paper's defaults otherwise)."""
        from aiayn.config import ModelConfig

        return ModelConfig(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            d_ff=self.d_ff,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            dropout=self.dropout,
        )

    @property
    def tgt_tokens(self) -> int:
        return self.batch * self.tgt_len


SMALL = Workload("SMALL", 256, 1024, 4, 3, 8000, batch=64, src_len=24, tgt_len=24)
BASE = Workload("BASE", 512, 2048, 8, 6, 37000, batch=32, src_len=24, tgt_len=24)
WORKLOADS: dict[str, Workload] = {"small": SMALL, "base": BASE}


@dataclass(frozen=True)
class DecodeWorkload:
    """Decoding on a model: ``n_sentences`` sources of ``src_len`` tokens, exactly ``steps``
    decoder steps each (end-of-sentence suppressed), beam ``beam_size`` or greedy."""

    model: Workload
    n_sentences: int = 64
    src_len: int = 24
    steps: int = 24
    beam_size: int = 4


DECODE = DecodeWorkload(SMALL)
DECODE_WORKLOADS: dict[str, DecodeWorkload] = {"small": DECODE, "base": DecodeWorkload(BASE)}


def set_threads(n: int = THREADS) -> None:
    """The same intra-op thread count for every system (inter-op 1: one stream of work)."""
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass


def random_tokens(rows: int, cols: int, vocab_size: int, generator: torch.Generator) -> Tensor:
    """Uniform random word ids in ``[FIRST_WORD_ID, vocab_size - 1)``: no special token."""
    return torch.randint(FIRST_WORD_ID, vocab_size - 1, (rows, cols), generator=generator)


@dataclass
class TrainBatch:
    """One training batch without padding: ``tgt_in`` = BOS + y, ``tgt_out`` = y + EOS."""

    src_ids: Tensor  # (B, S)
    src_pad: Tensor  # (B, S) bool, all False
    tgt_in: Tensor  # (B, T)
    tgt_out: Tensor  # (B, T)


def training_batch(workload: Workload, seed: int = 0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    src = random_tokens(workload.batch, workload.src_len, workload.vocab_size, gen)
    words = random_tokens(workload.batch, workload.tgt_len - 1, workload.vocab_size, gen)
    bos = torch.full((workload.batch, 1), BOS_ID, dtype=torch.long)
    eos = torch.full((workload.batch, 1), EOS_ID, dtype=torch.long)
    return TrainBatch(
        src_ids=src,
        src_pad=torch.zeros_like(src, dtype=torch.bool),
        tgt_in=torch.cat([bos, words], dim=1),
        tgt_out=torch.cat([words, eos], dim=1),
    )


def training_batches(workload: Workload, n: int, seed: int = 0) -> list[TrainBatch]:
    """``n`` batches of about the workload's target tokens whose lengths vary around its
    own (half to one and a half times), as the batches of a real training run do: every
    product then meets row counts it has not met before."""
    rng = random.Random(seed)
    tokens = workload.batch * workload.tgt_len
    batches = []
    for i in range(n):
        tgt_len = rng.randint(max(2, workload.tgt_len // 2), workload.tgt_len * 3 // 2)
        src_len = rng.randint(max(2, workload.src_len // 2), workload.src_len * 3 // 2)
        shape = replace(workload, batch=max(1, tokens // tgt_len), src_len=src_len, tgt_len=tgt_len)
        batches.append(training_batch(shape, seed=seed + i))
    return batches


def decode_sources(workload: DecodeWorkload, seed: int = 1) -> Tensor:
    """The (n_sentences, src_len) source ids every system decodes."""
    gen = torch.Generator().manual_seed(seed)
    return random_tokens(workload.n_sentences, workload.src_len, workload.model.vocab_size, gen)


def matmul_macs_per_target_token(w: Workload) -> float:
    """Multiply-accumulates of one forward pass per target token, with S = src_len source
    tokens per target token of the pair.

    Per encoder layer and source token: Q, K, V, O projections 4·d², FFN 2·d·d_ff, scores and
    weighted values 2·S·d. Per decoder layer and target token: self-attention 4·d² + 2·T·d,
    cross-attention Q and O 2·d², K and V of the memory 2·d² (per source token), 2·S·d for
    scores and values, FFN 2·d·d_ff. Plus the pre-softmax projection d·V. The full attention
    matrix is counted, causal or not (the usual convention for model-FLOP utilisation).
    """
    d, f, s, t = w.d_model, w.d_ff, w.src_len, w.tgt_len
    ratio = s / t  # source tokens per target token
    encoder = w.n_layers * ratio * (4 * d * d + 2 * d * f + 2 * s * d)
    decoder = w.n_layers * (
        4 * d * d + 2 * t * d + 2 * d * d + ratio * 2 * d * d + 2 * s * d + 2 * d * f
    )
    return encoder + decoder + d * w.vocab_size


def training_flops_per_target_token(w: Workload) -> float:
    """Forward 2 FLOPs per multiply-accumulate; forward + backward = 3 × forward."""
    return 3 * 2 * matmul_macs_per_target_token(w)


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB: ``VmHWM`` where Linux gives it.

    Not ``ru_maxrss``: Linux carries it from a parent into a child it starts (fork copies the
    parent's high-water mark, exec keeps it), so a benchmark process started by one that had
    built models reported at least that parent's peak. ``ru_maxrss`` (kilobytes on Linux) is
    the fallback where ``/proc`` has no ``VmHWM``."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        status = ""
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rotated(items: list[str], shift: int) -> list[str]:
    """``items`` rotated left by ``shift`` (modulo their number): the order of a round."""
    shift %= len(items)
    return items[shift:] + items[:shift]


def time_calls(fn: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def emit(result: dict[str, Any]) -> None:
    """Report one result to the parent process (one JSON line on stdout)."""
    print(RESULT_MARKER + json.dumps(result), flush=True)


def skip(system: str, reason: str) -> None:
    emit({"system": system, "skipped": reason})


def parse_results(stdout: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[len(RESULT_MARKER) :])
        for line in stdout.splitlines()
        if line.startswith(RESULT_MARKER)
    ]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# The instruction sets that decide which kernels PyTorch, oneDNN, MKL and CTranslate2 run.
INSTRUCTION_SETS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
    "amx_int8",
)  # fmt: skip


def cpu_instructions() -> list[str]:
    """Which of :data:`INSTRUCTION_SETS` this CPU reports (Linux ``/proc/cpuinfo``; empty
    where that cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [name for name in INSTRUCTION_SETS if name in flags]
    except OSError:
        pass
    return []


def _cpuinfo_field(name: str) -> str:
    """The first ``name`` field of Linux's ``/proc/cpuinfo`` ('' where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


# AMD's CPU families (``cpu family`` of /proc/cpuinfo) by the core they name; family 25 is
# Zen 3 and Zen 4, told apart by AVX-512, which only Zen 4 has.
AMD_FAMILIES = {23: "zen2", 26: "zen5"}


def host_slug(
    vendor: str | None = None,
    model: str | None = None,
    instructions: list[str] | None = None,
    family: int | None = None,
) -> str:
    """A short name of this CPU for result files: ``xeon`` (Intel Xeon), ``epyc-zen3`` (AMD
    EPYC without AVX-512), ``epyc-zen4`` (with AVX-512), else a slug of the model name. The
    arguments stand in for what ``/proc/cpuinfo`` says (for tests)."""
    vendor = _cpuinfo_field("vendor_id") if vendor is None else vendor
    model = cpu_model() if model is None else model
    instructions = cpu_instructions() if instructions is None else instructions
    if family is None:
        raw = _cpuinfo_field("cpu family")
        family = int(raw) if raw.isdigit() else 0
    if vendor == "GenuineIntel" and "xeon" in model.lower():
        return "xeon"
    if vendor == "AuthenticAMD" and "epyc" in model.lower():
        core = AMD_FAMILIES.get(family) or ("zen4" if "avx512f" in instructions else "zen3")
        return f"epyc-{core}"
    words = re.sub(r"\((r|tm)\)|\bcpu\b|\bprocessor\b", " ", model.lower())
    return re.sub(r"[^a-z0-9]+", "-", words).strip("-")[:40] or "unknown"


def json_text(value: Any, width: int = 120) -> str:
    """``value`` as JSON that stays short: a list or object on one line where it fits in
    ``width`` characters, else one item a line; always on one line a list of numbers or
    strings (a benchmark's many timings) and an object whose values are those or such lists
    (one measurement); floats to 6 significant digits (timings on a shared CPU vary in the
    second or third, and no report prints more)."""

    def rounded(item: Any) -> Any:
        if isinstance(item, float) and math.isfinite(item):
            return float(f"{item:.6g}")
        if isinstance(item, dict):
            return {k: rounded(v) for k, v in item.items()}
        if isinstance(item, list | tuple):
            return [rounded(v) for v in item]
        return item

    def scalars(item: Any) -> bool:
        return isinstance(item, list) and not any(isinstance(v, dict | list) for v in item)

    def flat_record(item: dict[Any, Any] | list[Any]) -> bool:
        if isinstance(item, list):
            return scalars(item)
        return all(not isinstance(v, dict | list) or scalars(v) for v in item.values())

    def render(item: Any, level: int, column: int) -> str:
        flat = json.dumps(item)
        if column + len(flat) <= width or not isinstance(item, dict | list) or flat_record(item):
            return flat
        pad = " " * (level + 1)
        if isinstance(item, dict):
            keys = {k: json.dumps({k: 0})[1:-4] for k in item}
            parts = [
                f"{pad}{keys[k]}: {render(v, level + 1, len(pad) + len(keys[k]) + 2)}"
                for k, v in item.items()
            ]
            return "{\n" + ",\n".join(parts) + "\n" + " " * level + "}"
        parts = [pad + render(v, level + 1, len(pad)) for v in item]
        return "[\n" + ",\n".join(parts) + "\n" + " " * level + "]"

    return render(rounded(value), 0, 0) + "\n"


def machine() -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "instructions": cpu_instructions(),
        "logical_cpus": os.cpu_count(),
        "threads": THREADS,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
    }


def versions() -> dict[str, str]:
    """Versions of the systems benchmarked (absent packages marked so)."""
    import importlib.metadata as md

    out = {}
    for name in ("aiayn", "torch", "transformers", "ctranslate2", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def workload_dict(w: Workload) -> dict[str, Any]:
    return asdict(w)


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def busy_cpu_seconds() -> float:
    """CPU seconds spent busy by the whole machine since boot (from /proc/stat)."""
    try:
        with open("/proc/stat", encoding="utf-8") as stat:
            fields = [float(x) for x in stat.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(limit_s: float, threshold: float = 0.15) -> float:
    """Wait (up to ``limit_s``) until other processes use less than ``threshold`` of one CPU
    over a second; returns the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        before = busy_cpu_seconds()
        time.sleep(1.0)
        if busy_cpu_seconds() - before < threshold:
            break
    return time.perf_counter() - start


def run_header(waited_s: float) -> dict[str, Any]:
    """The first keys of a benchmark's result: date, CPU, versions, load average, and the
    seconds spent waiting for a quiet machine (:func:`wait_for_quiet`)."""
    return {
        "date": dt.date.today().isoformat(),
        "cpu": cpu_model(),
        "versions": versions(),
        "load_before": load_average(),
        "waited_for_quiet_s": round(waited_s, 1),
    }


def spawn_worker(module: str, args: list[str], timeout: float, cwd: Path) -> dict[str, Any] | str:
    """Run ``python -m module --worker ARGS`` and return the one result it emits, or a line
    saying why there is none (over ``timeout`` seconds, or failed, with its last error line)."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", module, "--worker", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"over {timeout:.0f} s"
    results = parse_results(done.stdout)
    if done.returncode != 0 or not results:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"failed (exit {done.returncode}): {tail[:200]}"
    return results[0]


def sweep_lengths(
    module: str,
    label: str,
    lengths: list[int],
    worker_args: Callable[[int], list[str]],
    timeout: float,
    cwd: Path,
) -> tuple[list[dict[str, Any]], str | None]:
    """One worker process per length, shortest first (``worker_args(n)`` its arguments): the
    results, and why the sweep stopped early, if it did. The first length that fails or runs
    over ``timeout`` ends the sweep, since longer ones would too."""
    rows = []
    for n in sorted(lengths):
        got = spawn_worker(module, worker_args(n), timeout, cwd)
        if isinstance(got, str):
            print(f"{label} n={n}: {got}", file=sys.stderr, flush=True)
            return rows, f"{label} at n = {n}: {got}"
        rows.append(got)
        print(f"{label} n={n}: {got['ms']} ms, {got['peak_mb']} MB", file=sys.stderr)
    return rows, None


def log_log_slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(value) against log(n)."""
    if len(points) < 2:
        return None
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(max(v, 1e-9)) for _, v in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def against_length(ax: Any, title: str) -> None:
    """A matplotlib axis of values against the sequence length n, both on log scales."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length n")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def token_rate(run: Path) -> tuple[float, list[float]]:
    """The median training target tokens/s over every log interval of ``run`` and their range."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tgt_tokens_per_s"] for r in records if r["kind"] == "train"]
    return (statistics.median(rates), [min(rates), max(rates)]) if rates else (0.0, [])


def finished_run(run: Path) -> dict[str, Any]:
    """The figures of a finished run from its metrics.jsonl (``minutes``: its training time,
    rounded)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"][-5:]
    averaged = [r for r in records if r["kind"] == "averaged"]
    return {
        "minutes": round(max((r["minutes"] for r in records), default=0)),
        "updates": max((r["step"] for r in records), default=0),
        "tokens_per_s": sum(r["tgt_tokens_per_s"] for r in train) / max(len(train), 1),
        "valid": [r for r in records if r["kind"] == "valid"][-1:],
        "averaged": averaged[-1] if averaged else None,
    }
