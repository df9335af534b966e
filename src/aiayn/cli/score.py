"""``aiayn score``: the model's log-probability of given translations, pair by pair."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aiayn.cli.engines import add_engine_arguments, check_engine_options, open_translator
from aiayn.cli.paths import add_checkpoint_argument
from aiayn.cli.process import PROCESS_SETTINGS
from aiayn.errors import CLIError
from aiayn.progress import counted, stderr_report

if TYPE_CHECKING:
    from aiayn.inference.scoring import Score


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "score",
        help="score given translations with a checkpoint",
        description="The model's log-probability of each target line of --tgt given the same "
        "line of --src, teacher-forced: one line per pair, 'LOG_PROB<TAB>MEAN', the natural "
        "log of the probability of the target's tokens and its end of sentence (EOS), and "
        "that divided by their number. --word-scores adds a third field: the log-probability "
        "of each of those tokens, separated by spaces, the EOS's last. Every line of both "
        "files must hold text; a source longer than the model's positions is cut to fit with "
        "a warning, as translate cuts it. Pairs are scored in length-sorted batches of at most "
        "--batch-tokens padded tokens (docs/translation.md, 'Scores').",
        epilog=PROCESS_SETTINGS,
    )
    add_checkpoint_argument(parser)
    parser.add_argument("--src", required=True, metavar="FILE", help="source text, one a line")
    parser.add_argument(
        "--tgt", required=True, metavar="FILE", help="target text, one a line (as many lines)"
    )
    parser.add_argument(
        "--word-scores",
        action="store_true",
        help="add each token's log-probability (EOS last), space-separated, as a third field",
    )
    parser.add_argument(
        "--batch-tokens", type=int, help="padded tokens per batch (default: run's setting)"
    )
    add_engine_arguments(parser)
    parser.set_defaults(run=run)


def format_scores(scores: Sequence[Score], word_scores: bool) -> list[str]:
    """'LOG_PROB<TAB>MEAN' per score, with ``word_scores`` '<TAB>' and each token's
    log-probability, space-separated (4 decimals each)."""
    return [score_fields(s.log_prob, s.token_log_probs, word_scores) for s in scores]


def score_fields(log_prob: float, token_log_probs: Sequence[float], word_scores: bool) -> str:
    """The fields that ``aiayn score`` prints for one target (also ``translate
    --word-scores``'s last three): its log-probability, the mean per token (EOS included)
    and, with ``word_scores``, each token's."""
    mean = log_prob / len(token_log_probs) if token_log_probs else 0.0
    line = f"{log_prob:.4f}\t{mean:.4f}"
    if word_scores:
        line += "\t" + " ".join(f"{value:.4f}" for value in token_log_probs)
    return line


def check_pairs(sources: Sequence[str], targets: Sequence[str], src: str, tgt: str) -> None:
    """One line of each file per pair, none empty: a CLIError naming the file and line."""
    for name, lines in ((src, sources), (tgt, targets)):
        for number, line in enumerate(lines, 1):
            if not line.strip():
                raise CLIError(f"{name}: line {number} is empty (each pair needs both sides)")
    if len(sources) != len(targets):
        short, long_ = (tgt, src) if len(targets) < len(sources) else (src, tgt)
        have = min(len(sources), len(targets))
        raise CLIError(
            f"{short}: line {have + 1} is missing: {short} has {counted(have, 'line')}, "
            f"{long_} {max(len(sources), len(targets)):,} (one target per source line)"
        )


def run(args: argparse.Namespace) -> int:
    # Imported here: `aiayn --help` stays fast (aiayn.cli).
    from aiayn.inference.textio import read_lines

    check_engine_options(args)  # before anything is read or exported
    sources, targets = read_lines(args.src), read_lines(args.tgt)
    check_pairs(sources, targets, args.src, args.tgt)
    try:
        overrides = {} if args.batch_tokens is None else {"batch_tokens": args.batch_tokens}
        translator, where = open_translator(args, overrides)
    except ValueError as err:
        raise CLIError(str(err)) from None
    report = stderr_report()
    meter = report.meter("scoring", len(sources), unit="pairs")
    translator.on_batch = meter.advance
    try:
        scores = translator.score_pairs(sources, targets)
    except ValueError as err:  # a target longer than the model's positions
        raise CLIError(f"{args.tgt}: {err}") from None
    lines = format_scores(scores, args.word_scores)
    if lines:
        print("\n".join(lines), flush=True)
    seconds = meter.seconds
    meter.finish(
        f"scored {counted(len(sources), 'pair')} in {seconds:.1f} s "
        f"({len(sources) / max(seconds, 1e-9):,.1f} pairs/s) with {translator.checkpoint} "
        f"on {where}"
    )
    return 0
