"""BLEU versus training minutes of a finished run, from its step checkpoints.

For every checkpoint kept in RUN_DIR/checkpoints (or every ``--every``-th), translates the
source file with the run's decode settings (beam 4, α = 0.6 by default) and scores it with
sacreBLEU against the reference; with ``--average N`` also the average of that checkpoint and
the N - 1 before it (what ``aiayn average --last N`` would have given at that point). Writes a
markdown table to stdout; the minutes come from the checkpoints' saved progress.

    python scripts/bleu_curve.py runs/multi30k ../shared/data/multi30k/val.en \
        ../shared/data/multi30k/val.de --average 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from aiayn.evaluation.bleu import sacrebleu_bleu
from aiayn.inference import loading
from aiayn.inference.textio import read_lines
from aiayn.inference.translator import Translator
from aiayn.training import averaging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("source", type=Path)
    parser.add_argument("reference", type=Path)
    parser.add_argument("--every", type=int, default=1, help="score every N-th checkpoint")
    parser.add_argument("--average", type=int, default=0, help="also the average of the last N")
    parser.add_argument("--beam", type=int, default=None, help="default: the run's")
    args = parser.parse_args(argv)

    sources = read_lines(args.source)
    references = read_lines(args.reference)
    paths = loading.list_step_checkpoints(args.run_dir)
    if not paths:
        print(f"no checkpoints in {args.run_dir}", file=sys.stderr)
        return 2
    overrides = {"beam_size": args.beam} if args.beam else {}
    translator, _ = Translator.from_checkpoint(paths[-1], decode_overrides=overrides)
    header = "| update | minutes | BLEU (checkpoint) |"
    rule = "|---:|---:|---:|"
    if args.average > 1:
        header += f" BLEU (average of last {args.average}) |"
        rule += "---:|"
    print(header)
    print(rule)
    chosen = list(range(len(paths) - 1, -1, -args.every))[::-1]
    for i in chosen:
        state = loading.load_checkpoint(paths[i])
        minutes = float(state["progress"]["minutes"])
        step = int(state["step"])
        start = time.monotonic()
        translator.model.load_state_dict(state["model"])
        bleu = sacrebleu_bleu(translator.translate(sources), [references]).score
        row = f"| {step} | {minutes:.1f} | {bleu:.2f} |"
        if args.average > 1:
            window = paths[max(0, i - args.average + 1) : i + 1]
            translator.model.load_state_dict(averaging.average_checkpoints(window))
            bleu = sacrebleu_bleu(translator.translate(sources), [references]).score
            row += f" {bleu:.2f} ({len(window)}) |"
        print(row, flush=True)
        print(f"  update {step}: {time.monotonic() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
