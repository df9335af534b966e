"""``aiayn average``: the mean of the last N checkpoints of a run (§6.1)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "average",
        help="average the parameters of a run's last N checkpoints",
        description="Average, in fp32, the parameters of the last N readable checkpoints of "
        "RUN_DIR (the paper: 5 for base models, 20 for big ones). They must share parameter "
        "names and shapes. The result is a model checkpoint that `aiayn translate` reads.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="run directory")
    parser.add_argument("--last", type=int, default=5, metavar="N", help="how many (default 5)")
    parser.add_argument(
        "--out", type=Path, help="output file (default: RUN_DIR/averaged.pt)", metavar="FILE"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiayn.cli.paths import check_output_file
    from aiayn.training.averaging import average_run

    if args.out is not None:
        check_output_file(args.out, "--out")
    path = average_run(args.run_dir, args.last, args.out)
    print(path)
    return 0
