"""The paper's Table 1 measured: one layer of each type against the sequence length n, at
d = 512, on this CPU, beside the paper's complexity, sequential operations and maximum path
length.

    .venv/bin/python -m experiments.table1 [--lengths 16 ... 4096] [--repeats 5]
        [--window 64] [--kernel 3] [--timeout 300] [--wait-quiet 60] [--out DIR] [--quick]

The layers (batch of one sequence, fp32, 2 threads, no dropout):

- ``self-attention``: aiayn's multi-head self-attention sub-layer (8 heads of 64: the QKV and
  output projections and scaled dot-product attention);
- ``restricted``: the same sub-layer with the ``local`` pattern, a neighbourhood of r positions
  on each side (``--window``);
- ``recurrent``: ``nn.LSTM(d, d)``, one layer (oneDNN's kernel);
- ``convolutional``: ``nn.Conv1d(d, d, k)``, kernel k (``--kernel``, odd), length kept by padding;
- ``separable``: a depthwise ``Conv1d(d, d, k, groups=d)`` then a pointwise ``Conv1d(d, d, 1)``.

Time: forward + backward (gradients of the input and the weights), median of ``--repeats``
calls after one untimed call, each (layer, n) in a fresh process. Memory: growth of that
process's peak resident set over the calls (activations kept for the backward pass and every
temporary). The slopes are least-squares fits of log(time) against log(n) over n ≥ 512 and
over n ≥ 1,024.

Sequential operations are counted: the longest chain of dependent operators (ATen, as
PyTorch's dispatcher runs them) in one forward pass of the layer (d = 8, float64), each
operator recorded with the tensors it reads (``sequential_operations``); the LSTM's chain
holds its cell steps, one after another, and grows with n. The maximum path length is
counted: copies of the layer (d = 8, non-negative weights) are stacked on an input that is
non-zero only at position 0, until the output at position n − 1 is non-zero
(``path_length``); for the recurrent layer it is the number of cell applications between the
two positions, n − 1. Dilated convolutions (dilation k^l at layer l, the paper's O(log_k(n))
case) are counted beside the contiguous ones.

Writes ``experiments/results/table1.{json,md}`` and ``docs/images/table1.png``, or the three
into ``--out``; ``--quick``: n of 64, 512 and 1,024, one call each, no waiting, into a
temporary folder. ``--recount``: count again the sequential operations and path lengths of
the result already in the output folder (its lengths, r and k), without timing anything, and
rewrite its JSON and Markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor, nn

    Layer = Callable[[Tensor], Tensor]

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
    sweep_lengths,
    time_calls,
    wait_for_quiet,
)

from experiments import add_output_options, output_folders  # noqa: E402

LENGTHS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
QUICK_LENGTHS = [64, 512, 1024]
LAYERS = ["self-attention", "restricted", "recurrent", "convolutional", "separable"]
D_MODEL, N_HEADS = 512, 8
# The paper's Table 1, and the power of n in each complexity (the slope a log-log fit of
# time against n should approach).
PAPER = {
    "self-attention": ("O(n²·d)", "O(1)", "O(1)", 2),
    "restricted": ("O(r·n·d)", "O(1)", "O(n/r)", 1),
    "recurrent": ("O(n·d²)", "O(n)", "O(n)", 1),
    "convolutional": ("O(k·n·d²)", "O(1)", "O(log_k(n)) dilated, O(n/k) contiguous", 1),
    "separable": ("O(k·n·d + n·d²)", "O(1)", "as convolutional", 1),
}


def build(kind: str, d: int, heads: int, window: int, kernel: int) -> tuple[Layer, nn.Module]:
    """One layer of ``kind`` as a function of x (batch, n, d) -> (batch, n, d), and the module
    that holds its parameters."""
    from torch import nn

    from aiayn.model.attention import MultiHeadAttention
    from aiayn.model.patterns import make_pattern

    if kind in ("self-attention", "restricted"):
        pattern = None
        if kind == "restricted":
            pattern = make_pattern("local", window=window, n_global=0, block=window, n_random=0)
        attention = MultiHeadAttention(
            d, heads, d // heads, d // heads, self_attention=True, pattern=pattern
        )
        return (lambda x: attention(x)), attention
    if kind == "recurrent":
        lstm = nn.LSTM(d, d, batch_first=True)
        return (lambda x: lstm(x)[0]), lstm
    if kind == "convolutional":
        conv = nn.Conv1d(d, d, kernel, padding=kernel // 2)
        return (lambda x: conv(x.transpose(1, 2)).transpose(1, 2)), conv
    if kind == "separable":
        both = nn.Sequential(
            nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d), nn.Conv1d(d, d, 1)
        )
        return (lambda x: both(x.transpose(1, 2)).transpose(1, 2)), both
    raise ValueError(f"unknown layer {kind!r}")


def time_worker(kind: str, n: int, repeats: int, window: int, kernel: int) -> None:
    """Time one layer's forward + backward at length ``n``; emits one result."""
    import torch

    torch.set_num_threads(2)
    torch.manual_seed(0)
    layer, _ = build(kind, D_MODEL, N_HEADS, window, kernel)
    x = torch.randn(1, n, D_MODEL, requires_grad=True)

    def call() -> None:
        layer(x).sum().backward()

    baseline = peak_rss_mb()
    times = time_calls(call, warmup=1, repeats=repeats)
    emit(
        {
            "layer": kind,
            "n": n,
            "ms": round(1000 * median(times), 3),
            "ms_rounds": [round(1000 * t, 3) for t in times],
            "peak_mb": round(peak_rss_mb() - baseline, 1),
        }
    )


def path_length(kind: str, n: int, window: int, kernel: int, dilated: bool = False) -> int:
    """Layers of ``kind`` stacked until the output at position n − 1 depends on the input at
    position 0. The layer's weights are made non-negative and its biases zero, the input is
    one at position 0 and zero elsewhere, and after each layer the output is replaced by the
    indicator of its non-zero entries: with no negative term to cancel a contribution, an
    entry is non-zero exactly when the computation reads position 0 (and the indicator keeps
    the count free of underflow however deep the stack). ``dilated``: convolutions whose
    dilation is k^l at layer l, causally padded (WaveNet, ByteNet), the paper's O(log_k(n))
    case. The recurrent layer's count is its cell applications between the two positions."""
    import torch
    from torch import nn

    if n < 2:
        return 0
    if kind == "recurrent":
        # One layer connects them, through the cell applied at positions 1 … n − 1.
        return n - 1

    def positive(module: nn.Module) -> nn.Module:
        module.double()
        for name, parameter in module.named_parameters():
            parameter.data = parameter.data.abs() if "weight" in name else 0 * parameter.data
        return module

    torch.manual_seed(0)
    layer, module = build("convolutional" if dilated else kind, 8, 1, window, kernel)
    positive(module)
    x = torch.zeros(1, n, 8, dtype=torch.float64)
    x[0, 0] = 1.0
    layers = 0
    with torch.no_grad():
        while not bool(x[0, -1].any()):
            if layers > 2 * n:
                raise RuntimeError(f"{kind}: position {n - 1} never reached from 0")
            if dilated:
                conv = positive(nn.Conv1d(8, 8, kernel, dilation=kernel**layers))
                pad = (kernel - 1) * kernel**layers
                # Causal padding (on the left): layer l reaches k^l positions further back.
                x = conv(nn.functional.pad(x.transpose(1, 2), (pad, 0))).transpose(1, 2)
            else:
                x = layer(x)
            x = (x != 0).double()
            layers += 1
    return layers


def sequential_operations(kind: str, n: int, window: int, kernel: int) -> int:
    """Operations of one layer over n positions that must run one after another, counted: the
    longest chain of dependent tensor operations (ATen operators, as PyTorch's dispatcher runs
    them) in one forward pass of the layer (d = 8, float64) from its input to its output.
    Every operator is recorded with the tensors it reads and writes; an operator's depth is
    one more than the deepest tensor it reads (a view, which computes nothing, keeps its
    input's depth), and the count is the output's depth. In float64 ``nn.LSTM`` runs its cell
    position by position as separate operators (in float32 oneDNN runs the same recurrence
    inside one call), so its chain holds every cell step; the other layers are a few batched
    operators over all positions, however long the sequence."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.weak import WeakIdKeyDictionary

    class Chain(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.depth: WeakIdKeyDictionary = WeakIdKeyDictionary()

        def __torch_dispatch__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            kwargs = kwargs or {}
            read = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            depth = max((self.depth.get(t, 0) for t in read), default=0)
            depth += 0 if func.is_view else 1
            out = func(*args, **kwargs)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.depth[t] = depth
            return out

    torch.manual_seed(0)
    layer, module = build(kind, 8, 1, window, kernel)
    module.double()
    x = torch.randn(1, n, 8, dtype=torch.float64)
    with torch.no_grad(), Chain() as chain:
        out = layer(x)
    return int(chain.depth.get(out, 0))


def counts(lengths: list[int], window: int, kernel: int) -> dict[str, dict[str, Any]]:
    """The counted columns of every layer at every length: {layer: {str(n): {"sequential",
    "path", and "path_dilated" for the convolution}}}."""
    out: dict[str, dict[str, Any]] = {}
    for kind in LAYERS:
        out[kind] = {}
        for n in lengths:
            row = {
                "sequential": sequential_operations(kind, n, window, kernel),
                "path": path_length(kind, n, window, kernel),
            }
            if kind == "convolutional":
                row["path_dilated"] = path_length(kind, n, window, kernel, dilated=True)
            out[kind][str(n)] = row
    return out


def fits(rows: list[dict[str, Any]], kind: str, key: str, low: int) -> float | None:
    return log_log_slope([(r["n"], r[key]) for r in rows if r["layer"] == kind and r["n"] >= low])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), constrained_layout=True)
    for i, kind in enumerate(LAYERS):
        mine = sorted((r for r in rows if r["layer"] == kind), key=lambda r: r["n"])
        if not mine:
            continue
        colour = f"C{i}"
        for ax, key in zip(axes, ("ms", "peak_mb"), strict=True):
            points = [(r["n"], max(r[key], 0.05)) for r in mine]
            fitted = fits(rows, kind, key, 1024)
            label = f"{result['labels'][kind]}" + (
                f", slope {fitted:.2f}" if fitted is not None else ""
            )
            ax.plot(*zip(*points, strict=True), marker="o", color=colour, label=label)
            if key == "ms":
                # The paper's asymptote through the last point (n² or n), drawn where the
                # layers are past their fixed overheads.
                power, (n_last, t_last) = PAPER[kind][3], points[-1]
                ns = [p[0] for p in points if p[0] >= 256]
                ax.plot(
                    ns,
                    [t_last * (m / n_last) ** power for m in ns],
                    linestyle=":",
                    color=colour,
                    alpha=0.6,
                )
    against_length(axes[0], "forward + backward time (ms); dotted: the paper's power of n")
    against_length(axes[1], "peak memory growth (MB)")
    fig.suptitle(f"one layer, d = {D_MODEL}, batch 1, fp32, on {result['cpu']}", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def report(result: dict[str, Any]) -> str:
    rows, labels = result["rows"], result["labels"]
    lengths = sorted({r["n"] for r in rows})
    top = max(lengths)
    lines = [
        f"# Table 1 measured ({result['date']}, {result['cpu']})",
        "",
        f"One layer, d = {D_MODEL}, batch 1, fp32, 2 threads; forward + backward, median of "
        f"{result['repeats']} calls; r = {result['window']}, k = {result['kernel']}.",
        "",
        "| layer | paper: complexity | paper: sequential | paper: max path | "
        f"sequential ops (n = {top:,}) | max path (n = {top:,}) | "
        "time slope n ≥ 512 | n ≥ 1,024 |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for kind in LAYERS:
        paper = PAPER[kind]
        counts = result["counts"][kind][str(top)]
        path = f"{counts['path']:,}"
        if "path_dilated" in counts:
            path += f" (dilated: {counts['path_dilated']})"
        s512, s1024 = fits(rows, kind, "ms", 512), fits(rows, kind, "ms", 1024)
        lines.append(
            f"| {labels[kind]} | {paper[0]} | {paper[1]} | {paper[2]} | "
            f"{counts['sequential']:,} | {path} | "
            f"{'—' if s512 is None else f'{s512:.2f}'} | "
            f"{'—' if s1024 is None else f'{s1024:.2f}'} |"
        )
    for key, title in (("ms", "Time (ms)"), ("peak_mb", "Peak memory growth (MB)")):
        lines += [
            "",
            f"## {title}",
            "",
            "| layer | " + " | ".join(f"{n:,}" for n in lengths) + " |",
        ]
        lines.append("|---|" + "---:|" * len(lengths))
        for kind in LAYERS:
            mine = {r["n"]: r for r in rows if r["layer"] == kind}
            cells = [f"{mine[n][key]:,}" if n in mine else "—" for n in lengths]
            lines.append(f"| {labels[kind]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Sequential operations, counted (the longest chain of dependent operators)",
        "",
    ]
    lines += ["| layer | " + " | ".join(f"{n:,}" for n in lengths) + " |"]
    lines.append("|---|" + "---:|" * len(lengths))
    for kind in LAYERS:
        cells = [f"{result['counts'][kind][str(n)]['sequential']:,}" for n in lengths]
        lines.append(f"| {labels[kind]} | " + " | ".join(cells) + " |")
    lines += ["", "## Maximum path length, counted", ""]
    lines += ["| layer | " + " | ".join(f"{n:,}" for n in lengths) + " |"]
    lines.append("|---|" + "---:|" * len(lengths))
    for kind in LAYERS:
        cells = [str(result["counts"][kind][str(n)]["path"]) for n in lengths]
        lines.append(f"| {labels[kind]} | " + " | ".join(cells) + " |")
    cells = [str(result["counts"]["convolutional"][str(n)]["path_dilated"]) for n in lengths]
    lines.append(f"| {labels['convolutional']}, dilated k^l | " + " | ".join(cells) + " |")
    if result["failures"]:
        lines += ["", "Not measured: " + "; ".join(result["failures"]) + "."]
    lines += ["", f"Load average before {result['load_before']}, after {result['load_after']}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--layers", nargs="+", default=LAYERS, choices=LAYERS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window", type=int, default=64, help="r of restricted attention")
    parser.add_argument("--kernel", type=int, default=3, help="k of the convolutions")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--wait-quiet", type=float, default=60.0)
    parser.add_argument(
        "--recount", action="store_true", help="count the existing result again, no timing"
    )
    add_output_options(parser, f"--lengths {' '.join(map(str, QUICK_LENGTHS))} --repeats 1")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.repeats, args.wait_quiet = QUICK_LENGTHS, 1, 0.0
    # Refused before any timing: a window of 0 or a kernel of 1 connects no two positions,
    # and an even kernel's padding of k // 2 would not keep the length.
    if args.window < 1:
        parser.error(f"--window must be at least 1, got {args.window}")
    if args.kernel < 3 or args.kernel % 2 == 0:
        parser.error(f"--kernel must be odd and at least 3, got {args.kernel}")
    if min(args.lengths) < 2 or args.repeats < 1:
        parser.error("--lengths must be at least 2 and --repeats at least 1")
    if args.worker is not None:
        kind, n, repeats = args.worker[0], int(args.worker[1]), int(args.worker[2])
        time_worker(kind, n, repeats, args.window, args.kernel)
        return
    results, images = output_folders(args)
    if args.recount:
        result = json.loads((results / "table1.json").read_text(encoding="utf-8"))
        lengths = sorted({int(n) for n in result["counts"]["self-attention"]})
        result["counts"] = counts(lengths, result["window"], result["kernel"])
        (results / "table1.json").write_text(json_text(result))
        (results / "table1.md").write_text(report(result))
        print(report(result))
        return
    waited = wait_for_quiet(args.wait_quiet)
    labels = {
        "self-attention": "self-attention",
        "restricted": f"restricted self-attention (r = {args.window})",
        "recurrent": "recurrent (LSTM)",
        "convolutional": f"convolutional (k = {args.kernel})",
        "separable": f"separable convolution (k = {args.kernel})",
    }
    result: dict[str, Any] = {
        **run_header(waited),
        "repeats": args.repeats,
        "window": args.window,
        "kernel": args.kernel,
        "labels": labels,
        "rows": [],
        "counts": {},
        "failures": [],
    }
    shape = ["--window", str(args.window), "--kernel", str(args.kernel)]
    for kind in args.layers:
        rows, failure = sweep_lengths(
            "experiments.table1",
            kind,
            args.lengths,
            lambda n, kind=kind: [kind, str(n), str(args.repeats), *shape],
            args.timeout,
            ROOT,
        )
        result["rows"] += rows
        if failure:
            result["failures"].append(failure)
    result["counts"] = counts(sorted(args.lengths), args.window, args.kernel)
    result["load_after"] = load_average()
    (results / "table1.json").write_text(json_text(result))
    (results / "table1.md").write_text(report(result))
    plot(result, images / "table1.png")
    print(report(result))


if __name__ == "__main__":
    main()
