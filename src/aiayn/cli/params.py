"""``aiayn params``: parameter counts of presets (Table 3), for a given vocabulary size."""

from __future__ import annotations

import argparse

from aiayn.presets import PAPER_PARAMS_M, PRESETS


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "params",
        help="print the parameter count of presets",
        description="Print the parameter count of each named preset (all if none is named), "
        "next to the figure printed in Table 3 of the paper where it has one.",
    )
    parser.add_argument("presets", nargs="*", help=f"preset names (any of: {', '.join(PRESETS)})")
    parser.add_argument("--vocab-size", type=int, default=37000, help="shared vocabulary size")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiayn.config import load_config
    from aiayn.model.families import build_model
    from aiayn.model.transformer import count_parameters

    names = args.presets or list(PRESETS)
    vocab = f"model.vocab_size={args.vocab_size}"
    configs = [load_config(overrides=[f"preset={name}", vocab]) for name in names]  # refusals first
    print(f"{'preset':<16} {'params':>14} {'paper (M)':>10}")
    for name, config in zip(names, configs, strict=True):
        count = count_parameters(build_model(config.model))
        paper = PAPER_PARAMS_M.get(name)
        print(f"{name:<16} {count:>14,} {paper if paper is not None else '-':>10}")
    print(f"(parameters with a shared vocabulary of {args.vocab_size:,}: --vocab-size)")
    return 0
