"""The ``aiayn`` command line: each subcommand parses its arguments, builds a config and calls
one library function. Progress goes to stderr, results to stdout.

Each subcommand lives in its own module with two functions: ``add_parser(subparsers)`` and
``run(args) -> int``. Expected failures (bad input, missing files) raise :class:`CLIError`
or :class:`aiayn.config.ConfigError` and become a one-line message with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from aiayn.cli import attention, average, bleu, demo, params, plot, prepare, train, translate
from aiayn.config import ConfigError
from aiayn.errors import CLIError, UserError

_COMMANDS = [demo, params, prepare, train, average, plot, translate, bleu, attention]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiayn",
        description="The Transformer of 'Attention Is All You Need': raw parallel text to BLEU.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in _COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except (CLIError, ConfigError, UserError) as err:
        print(f"aiayn {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"aiayn {args.command}: interrupted", file=sys.stderr)
        return 130


__all__ = ["CLIError", "build_parser", "main"]
