"""The markdown results table: versions, machine, medians, ratios against each peer, and the
performance goals checked against the figures of the same run."""

from __future__ import annotations

from typing import Any

from benchmarks.common import WORKLOADS, training_flops_per_target_token

# Peak memory is not a race: within this factor of the leanest peer's peak RSS is the goal.
MEMORY_MARGIN = 1.25

TRAIN_NAMES = {
    "aiayn": "aiayn",
    "aiayn-bf16": "aiayn bf16 autocast (opt-in)",
    "torch": "torch.nn.Transformer",
    "hf": "HF MarianMTModel",
}
DECODE_NAMES = {
    "aiayn": "aiayn (fp32)",
    "aiayn-eager": "aiayn fp32, `--no-compiled-step`",
    "aiayn-int8": "aiayn int8 (opt-in)",
    "aiayn-packed": "aiayn fp32, `--pack-weights`",
    "aiayn-bf16": "aiayn bf16 (opt-in)",
    "torch": "torch.nn.Transformer (no cache)",
    "hf": "HF Marian generate",
    "ct2-float32": "CTranslate2 float32",
    "ct2-int8": "CTranslate2 int8",
    "ct2-float32-1thread": "CTranslate2 float32, 1 thread",
    "ct2-float32-avx2": "CTranslate2 float32, oneDNN limited to AVX2",
}
# The decoding goals compare with CTranslate2 float32 at its fastest setting for each figure:
# on some machines its 2-thread mode is slower than one thread, on some its oneDNN is faster
# limited to AVX2 (docs/performance.md).
CT2_FLOAT32 = ("ct2-float32", "ct2-float32-1thread", "ct2-float32-avx2")
CT2_SETTING = {
    "ct2-float32": "2 threads",
    "ct2-float32-1thread": "1 thread",
    "ct2-float32-avx2": "2 threads, oneDNN AVX2",
}
# (mode, field, unit, higher is better)
DECODE_COLUMNS = [
    ("beam-batch", "sentences_per_s", "beam 4, batch 64 (sent/s)", True),
    ("greedy-batch", "sentences_per_s", "greedy, batch 64 (sent/s)", True),
    ("beam-single", "latency_ms", "beam 4, one at a time (ms/sent)", False),
    ("greedy-single", "latency_ms", "greedy, one at a time (ms/sent)", False),
]


def _fmt(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def _ratio(ours: float, theirs: float, higher_better: bool) -> str:
    """How many times better aiayn is (>1 = aiayn ahead)."""
    if not ours or not theirs:
        return "–"
    return f"{(ours / theirs if higher_better else theirs / ours):.2f}×"


def header(meta: dict[str, Any]) -> list[str]:
    m, v = meta["machine"], meta["versions"]
    lines = [
        f"Run: {meta['date']} · {meta['mode']} · wall time {meta['wall_s'] / 60:.1f} min",
        "",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['threads']} threads for "
        f"every system; CUDA available: {m['cuda']}; Python {m['python']}; {m['platform']}",
        "",
        *(
            [f"Instruction sets: {', '.join(m['instructions']) or 'none of those listed'}", ""]
            if "instructions" in m
            else []
        ),
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        "",
        f"Load average at start / end: {meta['load_start']} / {meta['load_end']} "
        "(the CPU is shared: compare ratios within this run only)",
        "",
    ]
    for note in meta.get("notes", []):
        lines += [f"- {note}"]
    if meta.get("notes"):
        lines.append("")
    return lines


OURS_TRAIN = ("aiayn",)
# Ours, opt-in and outside the fp32 workloads: shown, compared, never in the goals.
OPT_IN_TRAIN = ("aiayn-bf16",)


def training_table(train: dict[str, dict[str, dict[str, Any]]], ceiling: float) -> list[str]:
    lines = [
        "### Training (full updates: forward, backward, Adam; fp32)",
        "",
        "The bf16 row is aiayn's opt-in `train.precision=bf16` (bfloat16 autocast, the fused "
        "loss's products in bfloat16), run on CPUs with bfloat16 instructions; it is not part "
        "of the fp32 workloads, has no MFU against the fp32 ceiling, and no goal counts it.",
        "",
        f"Matmul ceiling (fp32 2048×2048, 2 threads, median): **{_fmt(ceiling, 1)} GFLOP/s**. "
        "MFU = tokens/s × training FLOPs per target token ÷ ceiling.",
        "",
        "| workload | system | target tok/s | median update (s) | updates timed | MFU "
        "| peak RSS (MB) | background load |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, results in train.items():
        w = WORKLOADS[key]
        for system, r in results.items():
            name = TRAIN_NAMES.get(system, system)
            if "skipped" in r:
                lines.append(f"| {w.name} | {name} | skipped: {r['skipped']} ||||||")
                continue
            mfu = r["tokens_per_s"] * training_flops_per_target_token(w) / (ceiling * 1e9)
            # bfloat16 products are not measured against the float32 ceiling.
            mfu_cell = "–" if system in OPT_IN_TRAIN else f"{100 * mfu:.0f}%"
            lines.append(
                f"| {w.name} | {name} | {_fmt(r['tokens_per_s'])} | {r['median_s']:.3f} "
                f"| {r['samples']} | {mfu_cell} | {_fmt(r['peak_rss_mb'])} "
                f"| {r.get('background_cpus', 0):.2f} |"
            )
    lines += [
        "",
        "Background load = CPUs' worth of work other processes did during that system's runs "
        "(worst round; 0 = the machine was ours).",
        "",
        "Ratios (tokens/s: ours ÷ peer, above 1 = ours faster; peak RSS: peer ÷ ours, above 1 "
        "= ours leaner):",
        "",
        "| workload | peer | aiayn speed | aiayn RSS | aiayn bf16 (opt-in) speed "
        "| aiayn bf16 RSS |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for key, results in train.items():
        for system, r in results.items():
            if system in OURS_TRAIN + OPT_IN_TRAIN or "skipped" in r:
                continue
            cells = []
            for ours in OURS_TRAIN + OPT_IN_TRAIN:
                mine = results.get(ours, {})
                cells.append(_ratio(mine.get("tokens_per_s", 0), r["tokens_per_s"], True))
                cells.append(_ratio(mine.get("peak_rss_mb", 0), r["peak_rss_mb"], False))
            lines.append(
                f"| {WORKLOADS[key].name} | {TRAIN_NAMES.get(system, system)} | "
                + " | ".join(cells)
                + " |"
            )
    lines.append("")
    return lines


def _spread(figure: dict[str, Any]) -> str:
    """`` (lowest–highest)`` of a figure's per-round values, when it has more than one."""
    rounds = figure.get("rounds", [])
    if len(rounds) < 2:
        return ""
    return f" ({_fmt(min(rounds), 1)}–{_fmt(max(rounds), 1)})"


def decoding_table(decode: dict[str, dict[str, Any]], workload: str = "SMALL") -> list[str]:
    lines = [
        f"### Decoding {workload} (64 sentences × 24 source tokens, exactly 24 decoder steps each)",
        "",
        "| system | "
        + " | ".join(c[2] for c in DECODE_COLUMNS)
        + " | peak RSS (MB) | background load |",
        "|---|" + "---:|" * (len(DECODE_COLUMNS) + 2),
    ]
    for system, r in decode.items():
        name = DECODE_NAMES.get(system, system)
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} |" + "|" * len(DECODE_COLUMNS))
            continue
        cells = []
        for mode, field, _, _ in DECODE_COLUMNS:
            figure = r["modes"].get(mode, {})
            value = figure.get(field)
            cells.append("–" if value is None else _fmt(value, 1) + _spread(figure))
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {_fmt(r['peak_rss_mb'])} | {r.get('background_cpus', 0):.2f} |"
        )
    step = decode.get("aiayn", {})
    if "step_compile_s" in step or "step_load_s" in step:
        made = [
            f"compiled in {step[key]:.0f} s ({what})"
            if key == "step_compile_s"
            else f"loaded in {step[key]:.2f} s ({what})"
            for key, what in (
                ("step_compile_s", "once, in a process of its own before the rounds"),
                ("step_load_s", "in each timed process"),
            )
            if key in step
        ]
        lines += [
            "",
            "aiayn (fp32) decodes up to 16 rows, greedy batches and beam 4 batches through "
            "its decoder step compiled ahead of time (three libraries, tuned for 4 and 64 "
            "rows and for beam 4 over 256): "
            f"{', '.join(made)}; the figures above are after that.",
        ]
    lines += ["", "aiayn (fp32) against each peer (above 1: aiayn faster / leaner):", ""]
    lines += [
        "| peer | " + " | ".join(c[2].split(" (")[0] for c in DECODE_COLUMNS) + " | RSS |",
        "|---|" + "---:|" * (len(DECODE_COLUMNS) + 1),
    ]
    ours = decode.get("aiayn", {})
    for system, r in decode.items():
        if system == "aiayn" or "skipped" in r or "modes" not in ours:
            continue
        base = (
            "aiayn-int8"
            if system == "ct2-int8" and "modes" in decode.get("aiayn-int8", {})
            else "aiayn"
        )
        mine = decode[base]
        cells = []
        for mode, field, _, higher in DECODE_COLUMNS:
            a = mine["modes"].get(mode, {}).get(field, 0)
            b = r["modes"].get(mode, {}).get(field, 0)
            cells.append(_ratio(a, b, higher))
        rss = _ratio(mine["peak_rss_mb"], r["peak_rss_mb"], False)
        label = DECODE_NAMES.get(system, system) + (" (vs aiayn int8)" if base != "aiayn" else "")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {rss} |")
    lines.append("")
    return lines


def goals(
    train: dict[str, dict[str, dict[str, Any]]],
    decode: dict[str, dict[str, Any]],
    ceiling: float,
    decode_base: dict[str, dict[str, Any]] | None = None,
) -> list[str]:
    """The performance goals, each checked against this run's figures."""
    lines = ["### The goals, checked on this run", ""]

    def mark(ok: bool) -> str:
        return "met" if ok else "**not met**"

    for key, results in train.items():
        w = WORKLOADS[key]
        peers = {
            s: r
            for s, r in results.items()
            if s not in OURS_TRAIN + OPT_IN_TRAIN and "tokens_per_s" in r
        }
        if not peers:
            continue
        best = max(peers, key=lambda s: peers[s]["tokens_per_s"])
        lean = min(r["peak_rss_mb"] for r in peers.values())
        for system in OURS_TRAIN:
            ours = results.get(system, {})
            if "tokens_per_s" not in ours:
                continue
            label = f"{w.name}, {TRAIN_NAMES[system]}"
            ratio = ours["tokens_per_s"] / peers[best]["tokens_per_s"]
            lines.append(
                f"- Training {label}: ≥ 1.2× the fastest peer ({TRAIN_NAMES[best]}): "
                f"{ratio:.2f}× — {mark(ratio >= 1.2)}"
            )
            lines.append(
                f"- Training {label}, memory: peak RSS ≤ {MEMORY_MARGIN}× the leanest peer's "
                f"({_fmt(lean)} MB): {_fmt(ours['peak_rss_mb'])} MB "
                f"({ours['peak_rss_mb'] / lean:.2f}×) — "
                f"{mark(ours['peak_rss_mb'] <= MEMORY_MARGIN * lean)}"
            )
            if key == "base":
                mfu = ours["tokens_per_s"] * training_flops_per_target_token(w) / (ceiling * 1e9)
                lines.append(
                    f"- Training {label}: MFU ≥ 80%: {100 * mfu:.0f}% — {mark(mfu >= 0.8)}"
                )
    lines += decoding_goals(decode, "")
    if decode_base:
        lines += decoding_goals(decode_base, "BASE ")
    lines.append("")
    return lines


def decoding_goals(decode: dict[str, dict[str, Any]], workload: str) -> list[str]:
    """The decoding goals against CTranslate2 float32 at its best thread count per figure;
    ``workload``: "" (SMALL) or "BASE " as the lines name it."""

    def mark(ok: bool) -> str:
        return "met" if ok else "**not met**"

    lines: list[str] = []
    ct2 = {s: decode[s] for s in CT2_FLOAT32 if "modes" in decode.get(s, {})}
    modes = ("beam-batch", "greedy-batch", "beam-single", "greedy-single")
    ct2 = {s: r for s, r in ct2.items() if all(m in r["modes"] for m in modes)}

    def best_ct2(mode: str, field: str, higher: bool) -> tuple[float, str]:
        """CTranslate2 float32's best figure for ``mode`` and at how many threads."""
        pick = max if higher else min
        system = pick(ct2, key=lambda s: ct2[s]["modes"][mode][field])
        return ct2[system]["modes"][mode][field], CT2_SETTING[system]

    for system in ("aiayn", "aiayn-packed"):
        ours = decode.get(system, {})
        if "modes" not in ours or not ct2:
            continue
        who = "" if system == "aiayn" else ", `--pack-weights`"
        for mode in ("beam-batch", "greedy-batch"):
            if mode not in ours["modes"]:
                continue
            a = ours["modes"][mode]["sentences_per_s"]
            b, threads = best_ct2(mode, "sentences_per_s", True)
            lines.append(
                f"- Decoding {workload}{mode}{who}: ≥ CTranslate2 float32 ({_fmt(b, 1)} sent/s at "
                f"{threads}): {_fmt(a, 1)} sent/s ({a / b:.2f}×) — {mark(a >= b)}"
            )
        for mode, what in (("beam-single", "beam 4"), ("greedy-single", "greedy")):
            if mode not in ours["modes"]:
                continue
            a = ours["modes"][mode]["latency_ms"]
            b, threads = best_ct2(mode, "latency_ms", False)
            lines.append(
                f"- Decoding {workload}{what} one at a time{who}: ≤ 1.5× CTranslate2's latency "
                f"({_fmt(b, 1)} ms at {threads}): {_fmt(a, 1)} ms ({a / b:.2f}×) — "
                f"{mark(a <= 1.5 * b)}"
            )
    ours = decode.get("aiayn", {})
    if "peak_rss_mb" in ours:
        peers = [
            r["peak_rss_mb"]
            for s, r in decode.items()
            if not s.startswith("aiayn") and "peak_rss_mb" in r and not s.endswith("int8")
        ]
        for system in ("aiayn", "aiayn-packed"):
            mine = decode.get(system, {})
            if peers and "peak_rss_mb" in mine:
                who = "" if system == "aiayn" else ", `--pack-weights`"
                lean = min(peers)
                lines.append(
                    f"- Decoding {workload}memory{who}: peak RSS ≤ {MEMORY_MARGIN}× the leanest "
                    f"float32 peer's ({_fmt(lean)} MB): {_fmt(mine['peak_rss_mb'])} MB "
                    f"({mine['peak_rss_mb'] / lean:.2f}×) — "
                    f"{mark(mine['peak_rss_mb'] <= MEMORY_MARGIN * lean)}"
                )
    return lines


def render(results: dict[str, Any]) -> str:
    meta = results["meta"]
    ceiling = results.get("matmul", {}).get("gflops", float("nan"))
    lines = ["## Benchmark results", "", *header(meta)]
    if results.get("train"):
        lines += training_table(results["train"], ceiling)
    if results.get("decode"):
        lines += decoding_table(results["decode"])
    if results.get("decode_base"):
        lines += decoding_table(results["decode_base"], "BASE")
    lines += goals(
        results.get("train", {}), results.get("decode", {}), ceiling, results.get("decode_base")
    )
    return "\n".join(lines).rstrip() + "\n"
