"""The ``aiayn`` command line: each subcommand parses its arguments, builds a config and calls
one library function. Progress goes to stderr, results to stdout.

Each subcommand lives in its own module with two functions: ``add_parser(subparsers)`` and
``run(args) -> int``. Expected failures (bad input, missing files) raise :class:`CLIError`
or :class:`aiayn.errors.ConfigError` and become a one-line message with exit status 2.

The subcommand modules import the library inside ``run``, not at the top: ``aiayn --help``
and usage errors then answer without the time it takes to import PyTorch.
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import sys
from collections.abc import Sequence

from aiayn.cli import (
    attention,
    average,
    bleu,
    cache,
    classify,
    demo,
    export_ct2,
    export_hf,
    generate,
    import_marian,
    params,
    plot,
    prepare,
    score,
    serve,
    train,
    translate,
)
from aiayn.errors import CLIError, ConfigError, UserError

_COMMANDS = [
    *(demo, params, prepare, train, average, plot, translate, score, bleu, attention),
    *(generate, classify, serve, import_marian, export_ct2, export_hf, cache),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiayn",
        description="The Transformer of 'Attention Is All You Need': raw parallel text to BLEU.",
    )
    from aiayn import __version__

    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in _COMMANDS:
        command.add_parser(subparsers)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parse_args``, except that KEY=VALUE overrides may come after options too
    (``train --config C train.max_steps=5 --no-progress model.dropout=0.2``): argparse
    fills the ``overrides`` positional from the first run of them only."""
    args, extra = parser.parse_known_args(argv)
    overrides = getattr(args, "overrides", None)
    if extra and overrides is not None and all(_is_override(item) for item in extra):
        args.overrides = [*overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _is_override(item: str) -> bool:
    return "=" in item and not item.startswith("-")


def _check_utf8(argv: Sequence[str]) -> None:
    """Every argument is valid UTF-8. Python hands an argument's invalid bytes on as lone
    surrogates, which fail later, far from the argument: in sentencepiece, or when a path is
    written into a manifest. Refused here, once for every command, naming the argument."""
    for number, item in enumerate(argv, start=1):
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raw = os.fsencode(item)
            try:
                raw.decode("utf-8")
                start = 0
            except UnicodeDecodeError as err:
                start = err.start
            shown = raw.decode("utf-8", errors="backslashreplace")
            raise CLIError(
                f"argument {number} ('{shown}') is not valid UTF-8 (byte {start + 1}: "
                f"{raw[start : start + 1]!r}); give text and file names in UTF-8"
            ) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(parser, argv)
    args.argv = argv  # as given: a command that says how to go on repeats it
    try:
        _check_utf8(argv)
        code = int(args.run(args))
        sys.stdout.flush()  # here, where a closed pipe is caught below, not at exit
        return code
    except (CLIError, ConfigError, UserError) as err:
        print(f"aiayn {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"aiayn {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`aiayn params | head -1`): stop quietly, as other tools do.
        silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a process killed by it
    except OSError as err:
        if err.errno not in _WRITE_FAILURES:
            raise
        # A full disk or quota, under stdout (`> /dev/full`) or a file the command writes.
        where = f" {err.filename}" if err.filename is not None else ""
        print(f"aiayn {args.command}: error: cannot write{where}: {err.strerror}", file=sys.stderr)
        return 1


_WRITE_FAILURES = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing what it still holds at exit raises
    nothing (where stdout is a file descriptor at all)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


__all__ = ["CLIError", "build_parser", "main"]
