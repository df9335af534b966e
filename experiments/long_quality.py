"""What each attention pattern costs in quality: the decoder-only language model of
``configs/bible_lm.toml`` trained on contexts of 1,024 tokens of the English Bible for the same
minutes with each causal pattern, and its validation perplexity on the held-out books.

    .venv/bin/python -m experiments.long_quality --work /tmp/long-quality [--minutes 8]
        [--patterns full local longformer bigbird lsh] [--context 1024] [--warmup 100]
    .venv/bin/python -m experiments.long_quality --quick   # a smoke run: see --help

Each run is ``aiayn train --config bible_lm`` with ``model.decoder_attention`` set, the
context raised to ``--context`` (``data.block_size``, ``model.max_positions``) and two windows
per update; the figures are those of the averaged last checkpoints. Writes
``experiments/results/long-quality.{json,md}`` (or into ``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    cpu_model,
    json_text,
    load_average,
    versions,
    wait_for_quiet,
)

from experiments import add_output_options, output_folders  # noqa: E402

QUICK_PATTERNS = ["full", "local"]


def _aiayn(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "aiayn", *args], check=True, capture_output=True)


def train(
    data: Path, out: Path, pattern: str, minutes: float, context: int, warmup: int, lr_scale: float
) -> dict[str, Any]:
    _aiayn(
        "train", "--config", "bible_lm", "--data", str(data), "--out", str(out), "--no-progress",
        "train.log_interval=10",
        f"model.decoder_attention={pattern}", f"model.max_positions={context}",
        f"data.block_size={context}", f"data.max_tokens={2 * context + 2}",
        "train.update_tokens=2000", f"train.max_minutes={minutes}", "train.valid_interval=100000",
        f"train.warmup_steps={warmup}", f"train.lr_scale={lr_scale}",
    )  # fmt: skip
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["kind"] == "train"]
    [averaged] = [r for r in records if r["kind"] == "averaged"]
    return {
        "pattern": pattern,
        "updates": averaged["step"],
        "minutes": round(averaged["minutes"], 2),
        "tokens_per_s": round(sum(r["tgt_tokens_per_s"] for r in trained) / max(len(trained), 1)),
        "valid_loss": round(averaged["loss"], 4),
        "valid_nll": round(averaged["nll"], 4),
        "valid_ppl": round(averaged["ppl"], 2),
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        f"# Language model at a context of {result['context']} tokens "
        f"({result['date']}, {result['cpu']})",
        "",
        f"`configs/bible_lm.toml`, {result['minutes']} minutes per pattern, 2 threads, "
        f"warmup {result['warmup']} updates, lr scale {result['lr_scale']}; "
        "validation on the held-out books, averaged last checkpoints.",
        "",
        "| pattern | updates | target tokens/s | valid NLL | valid perplexity |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['pattern']} | {r['updates']:,} | {r['tokens_per_s']:,} | {r['valid_nll']} | "
            f"{r['valid_ppl']} |"
        )
    lines += ["", f"Load average before {result['load_before']}, after {result['load_after']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="scratch folder (needed but with --quick)")
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--context", type=int, default=1024)
    # A run of a few minutes makes ~200 updates: the recipe's warmup of 300 would end after
    # it. 100 updates to the recipe's peak (0.3 · 256^-0.5 · 100^-0.5 ≈ 1.9e-3).
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--lr-scale", type=float, default=0.3)
    parser.add_argument(
        "--patterns", nargs="+", default=["full", "local", "longformer", "bigbird", "lsh"]
    )
    parser.add_argument("--wait-quiet", type=float, default=60.0)
    add_output_options(
        parser, "0.1 minutes each of full and local attention, a context of 256, no waiting"
    )
    args = parser.parse_args()
    folder, _ = output_folders(args)
    if args.quick:
        args.minutes, args.context, args.patterns, args.wait_quiet = 0.1, 256, QUICK_PATTERNS, 0
        args.work = args.work or folder / "work"
    if args.work is None:
        parser.error("--work is needed (or --quick)")
    data = args.work / "data"
    _aiayn("prepare", "--corpus", "bible", "--task", "lm", "--lang", "en", "--out", str(data))
    wait_for_quiet(args.wait_quiet)
    result: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "cpu": cpu_model(),
        "versions": versions(),
        "minutes": args.minutes,
        "context": args.context,
        "warmup": args.warmup,
        "lr_scale": args.lr_scale,
        "load_before": load_average(),
        "runs": [],
    }
    for pattern in args.patterns:
        out = args.work / "runs" / pattern
        got = train(data, out, pattern, args.minutes, args.context, args.warmup, args.lr_scale)
        print(json.dumps(got), file=sys.stderr, flush=True)
        result["runs"].append(got)
    result["load_after"] = load_average()
    (folder / "long-quality.json").write_text(json_text(result))
    (folder / "long-quality.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
