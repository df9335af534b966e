"""``aiayn plot``: the loss and BLEU curves of a run as a PNG."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="plot a run's loss and BLEU curves",
        description="Draw the training and validation loss and the validation BLEU of a run "
        "(from RUN_DIR/metrics.jsonl) into a PNG.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="run directory")
    parser.add_argument(
        "--out", type=Path, metavar="FILE", help="output image (default: RUN_DIR/curves.png)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiayn.cli.paths import check_output_file
    from aiayn.training.plot import plot_run

    if args.out is not None:
        check_output_file(args.out, "--out")
    print(plot_run(args.run_dir, args.out))
    return 0
