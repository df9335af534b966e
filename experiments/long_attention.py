"""One layer's forward and backward against the sequence length, for every attention pattern,
and activation checkpointing at BASE size: time and peak memory on this CPU.

    .venv/bin/python -m experiments.long_attention [--lengths 256 ... 16384] [--patterns ...]
        [--repeats 3] [--timeout 300] [--wait-quiet 60] [--skip-checkpointing] [--out DIR]
        [--quick]

Each measurement runs in a fresh subprocess (``worker``): it builds one encoder layer of the
BASE shape (d_model 512, 8 heads, FFN 2,048, no dropout) whose self-attention has the pattern
(``model.encoder_attention``; ``--causal``: a decoder-only layer with
``model.decoder_attention``), a batch of one sequence of ``n`` random vectors, and times
forward + backward (median of ``--repeats`` after one untimed call). Peak memory is the
growth of the process's peak resident set (``VmHWM``) from before the first call, which
includes every activation kept for the backward pass and the attention's temporaries. A
pattern whose run fails (out of memory) or passes ``--timeout`` is not run at greater
lengths.

The checkpointing part trains the BASE Transformer (6 + 6 layers) for a few updates on a batch
of 16 × 256 tokens with and without ``train.activation_checkpointing`` and reports time per
update and peak memory.

Writes ``experiments/results/long-attention.{json,md}`` and ``docs/images/long-attention.png``
(log-log time and memory against n, with the fitted slopes), or the three into ``--out``.
``--quick``: n of 256 and 512 for the full and local patterns, one call each, no
checkpointing and no waiting, into a temporary folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    against_length,
    emit,
    json_text,
    load_average,
    log_log_slope,
    median,
    peak_rss_mb,
    run_header,
    spawn_worker,
    sweep_lengths,
    time_calls,
    wait_for_quiet,
)

from experiments import add_output_options, output_folders  # noqa: E402

LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384]
QUICK_LENGTHS, QUICK_PATTERNS = [256, 512], ["full", "local"]
BASE = {"d_model": 512, "n_heads": 8, "d_ff": 2048}
# The pattern settings measured (the config defaults).
SETTINGS = {"attention_window": 128, "attention_global": 1, "attention_block": 64}


def layer_worker(pattern: str, n: int, causal: bool, repeats: int) -> None:
    """Time one layer's forward + backward at length ``n``; emits one result."""
    import torch

    from aiayn.config import ModelConfig
    from aiayn.model.layers import DecoderLayer, EncoderLayer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    key = "decoder_attention" if causal else "encoder_attention"
    config = ModelConfig(
        **BASE, **SETTINGS, dropout=0.0, max_positions=max(n, 1024), **{key: pattern}
    )
    layer: torch.nn.Module = (
        DecoderLayer(config, cross_attention=False) if causal else EncoderLayer(config)
    )
    x = torch.randn(1, n, BASE["d_model"], requires_grad=True)

    def call() -> None:
        out = layer(x, None, None) if causal else layer(x, None)
        out.sum().backward()

    baseline = peak_rss_mb()  # the layer and its input are there
    times = time_calls(call, warmup=1, repeats=repeats)
    emit(
        {
            "pattern": pattern,
            "n": n,
            "causal": causal,
            "ms": round(1000 * median(times), 2),
            "ms_rounds": [round(1000 * t, 2) for t in times],
            "peak_mb": round(peak_rss_mb() - baseline, 1),
        }
    )


def checkpointing_worker(on: bool, updates: int) -> None:
    """Train the BASE Transformer on 16 × 256 tokens; time per update and peak memory."""
    import torch

    from aiayn.config import ModelConfig
    from aiayn.model.transformer import Transformer, set_activation_checkpointing

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=8000, max_positions=512)).train()
    set_activation_checkpointing(model, on)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    src = torch.randint(4, 8000, (16, 256))
    tgt = torch.randint(4, 8000, (16, 256))
    baseline = peak_rss_mb()  # the model; Adam's moments come with the first update

    def update() -> None:
        logits = model(src, None, tgt)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    times = time_calls(update, warmup=1, repeats=updates)
    emit(
        {
            "checkpointing": on,
            "s_per_update": round(median(times), 3),
            "s_rounds": [round(t, 3) for t in times],
            "peak_mb": round(peak_rss_mb() - baseline, 1),
        }
    )


def crossover(rows: list[dict[str, Any]], pattern: str, key: str) -> int | None:
    """The smallest n from which ``pattern`` is below full attention at every measured n."""
    full = {r["n"]: r[key] for r in rows if r["pattern"] == "full"}
    mine = {r["n"]: r[key] for r in rows if r["pattern"] == pattern}
    shared = sorted(set(full) & set(mine))
    below = [n for n in shared if mine[n] < full[n]]
    for i, n in enumerate(shared):
        if all(m in below for m in shared[i:]):
            return n
    return None


def plot(rows: list[dict[str, Any]], path: Path, cpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for pattern in dict.fromkeys(r["pattern"] for r in rows):
        mine = sorted((r for r in rows if r["pattern"] == pattern), key=lambda r: r["n"])
        for ax, key in zip(axes, ("ms", "peak_mb"), strict=True):
            points = [(r["n"], r[key]) for r in mine]
            fitted = log_log_slope([p for p in points if p[0] >= 1024])
            label = pattern + (f" (slope {fitted:.2f})" if fitted is not None else "")
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    for ax, title in zip(
        axes, ("forward + backward time (ms)", "peak memory growth (MB)"), strict=True
    ):
        against_length(ax, title)
    fig.suptitle("one BASE encoder layer (d_model 512, 8 heads) on " + cpu, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def report(result: dict[str, Any]) -> str:
    rows = result["layer"]
    lines = [
        f"# One layer against the sequence length ({result['date']}, {result['cpu']})",
        "",
        "Forward + backward of one BASE encoder layer, batch 1, fp32, 2 threads; median of "
        f"{result['repeats']} calls; peak = growth of the process's peak RSS.",
        "",
    ]
    lengths = sorted({r["n"] for r in rows})
    patterns = list(dict.fromkeys(r["pattern"] for r in rows))
    for key, title in (("ms", "time (ms)"), ("peak_mb", "peak memory (MB)")):
        lines += [f"## {title}", "", "| pattern | " + " | ".join(map(str, lengths)) + " | slope |"]
        lines.append("|---|" + "---:|" * (len(lengths) + 1))
        for pattern in patterns:
            mine = {r["n"]: r for r in rows if r["pattern"] == pattern}
            cells = [f"{mine[n][key]:,}" if n in mine else "—" for n in lengths]
            fitted = log_log_slope([(n, mine[n][key]) for n in mine if n >= 1024])
            lines.append(
                f"| {pattern} | "
                + " | ".join(cells)
                + f" | {'—' if fitted is None else f'{fitted:.2f}'} |"
            )
        lines.append("")
    lines += ["## Where each pattern beats full attention", "", "| pattern | time | memory |"]
    lines.append("|---|---:|---:|")
    for pattern in patterns:
        if pattern != "full":
            t, m = crossover(rows, pattern, "ms"), crossover(rows, pattern, "peak_mb")
            lines.append(f"| {pattern} | {t or 'never'} | {m or 'never'} |")
    if result["failures"]:
        lines += ["", "Not measured: " + "; ".join(result["failures"]) + "."]
    if result.get("checkpointing"):
        lines += ["", "## Activation checkpointing, BASE Transformer, 16 × 256 tokens", ""]
        lines += ["| checkpointing | s per update | peak memory (MB) |", "|---|---:|---:|"]
        for r in result["checkpointing"]:
            lines.append(f"| {'on' if r['checkpointing'] else 'off'} | {r['s_per_update']} | "
                         f"{r['peak_mb']:,} |")  # fmt: skip
    lines += ["", f"Load average before {result['load_before']}, after {result['load_after']}.", ""]
    return "\n".join(lines)


def main() -> None:
    from aiayn.model.patterns import PATTERNS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument(
        "--patterns", nargs="+", choices=PATTERNS, default=None, help="default: all"
    )
    parser.add_argument("--causal", action="store_true", help="decoder-only layers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--wait-quiet", type=float, default=60.0)
    parser.add_argument("--skip-checkpointing", action="store_true")
    add_output_options(
        parser,
        f"--lengths {' '.join(map(str, QUICK_LENGTHS))} --patterns {' '.join(QUICK_PATTERNS)} "
        "--repeats 1 --skip-checkpointing",
    )
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.patterns, args.repeats = QUICK_LENGTHS, QUICK_PATTERNS, 1
        args.skip_checkpointing, args.wait_quiet = True, 0.0
    if min(args.lengths) < 1 or args.repeats < 1:
        parser.error("--lengths and --repeats must be at least 1")
    if args.worker is not None:
        kind, *rest = args.worker
        if kind == "layer":
            layer_worker(rest[0], int(rest[1]), rest[2] == "causal", int(rest[3]))
        else:
            checkpointing_worker(rest[0] == "on", int(rest[1]))
        return
    patterns = args.patterns or list(PATTERNS)
    results, images = output_folders(args)
    waited = wait_for_quiet(args.wait_quiet)
    result: dict[str, Any] = {
        **run_header(waited),
        "repeats": args.repeats,
        "causal": args.causal,
        "settings": SETTINGS,
        "layer": [],
        "failures": [],
    }
    mode = "causal" if args.causal else "full"
    for pattern in patterns:
        rows, failure = sweep_lengths(
            "experiments.long_attention",
            pattern,
            args.lengths,
            lambda n, pattern=pattern: ["layer", pattern, str(n), mode, str(args.repeats)],
            args.timeout,
            ROOT,
        )
        result["layer"] += rows
        if failure:
            result["failures"].append(failure)
    if not args.skip_checkpointing:
        result["checkpointing"] = []
        for on in ("off", "on"):
            got = spawn_worker(
                "experiments.long_attention", ["checkpointing", on, "3"], args.timeout * 2, ROOT
            )
            if isinstance(got, str):
                result["failures"].append(f"checkpointing {on}: {got}")
            else:
                result["checkpointing"].append(got)
    result["load_after"] = load_average()
    name = "long-attention-causal" if args.causal else "long-attention"
    (results / f"{name}.json").write_text(json_text(result))
    (results / f"{name}.md").write_text(report(result))
    plot(result["layer"], images / f"{name}.png", result["cpu"])
    print(report(result))


if __name__ == "__main__":
    main()
