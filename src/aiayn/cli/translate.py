"""``aiayn translate``: raw source text in, detokenised translations out, one line per line."""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import os
import shlex
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from aiayn.cli.engines import add_engine_arguments, check_engine_options, open_translator
from aiayn.cli.paths import add_checkpoint_argument
from aiayn.cli.process import PROCESS_SETTINGS
from aiayn.errors import CLIError, UserError
from aiayn.progress import counted, stderr_report

if TYPE_CHECKING:
    from aiayn.inference.steering import Steering
    from aiayn.inference.translator import TextTranslator, Translation

# Lines are translated a window at a time, in input order, and each window's translations are
# written as it finishes: an interrupted run keeps them. A window holds about this many batches
# of source tokens (decode.batch_tokens): length-sorted batches within a window pad a little
# more than over the whole file, and an interrupt loses at most one window's work.
WINDOW_BATCHES = 8


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "translate",
        help="translate raw text with a checkpoint",
        description="Translate raw text, one sentence a line, from --input or stdin; write one "
        "detokenised translation a line to stdout (with --nbest K: K lines per input line, "
        "'rank<TAB>score<TAB>text'; with --word-scores each line also ends in "
        "'<TAB>LOG_PROB<TAB>MEAN<TAB>WORD_SCORES', as aiayn score prints them). "
        "With a terminal on stdin it translates line by line. "
        "Empty lines give empty lines; lines longer than the model's positions are cut to fit "
        "with a warning on stderr. Defaults come from the run's [decode] settings. "
        "--engine ctranslate2 decodes with CTranslate2 instead of PyTorch (docs/interop.md), "
        "as --quantize int8 does with int8 weights (docs/translation.md).",
        epilog=PROCESS_SETTINGS,
    )
    add_checkpoint_argument(parser)
    parser.add_argument("--input", "-i", metavar="FILE", help="source text (default, or -: stdin)")
    parser.add_argument("--beam", type=int, help="beam size; 1 is greedy search (paper: 4)")
    parser.add_argument("--alpha", type=float, help="length penalty ((5+|Y|)/6)^alpha (paper: 0.6)")
    parser.add_argument(
        "--beam-rule",
        choices=["paper", "fairseq"],
        help="when beam search stops: 'paper' (tensor2tensor's rule: finished hypotheses from "
        "the best 2K candidates, stop on the score bound or the length limit) or 'fairseq' "
        "(stop once K hypotheses have finished); default: the run's decode.beam_rule (paper)",
    )
    parser.add_argument(
        "--nbest", type=int, default=1, help="hypotheses per sentence, at most the beam size"
    )
    parser.add_argument(
        "--max-len-a", type=float, help="output limit a * source tokens + b: a (paper: 1)"
    )
    parser.add_argument("--max-len-b", type=int, help="output limit: b (paper: 50)")
    parser.add_argument(
        "--batch-tokens", type=int, help="padded source tokens per batch (default: run's setting)"
    )
    parser.add_argument(
        "--constraints",
        metavar="FILE",
        help="terminology: line i holds the phrases (tab-separated target text; an empty "
        "line: none) that the translation of input line i must contain, each whole "
        "(beam search with dynamic beam allocation; --engine torch)",
    )
    parser.add_argument(
        "--target-prefix",
        metavar="FILE",
        help="line i holds the text the translation of input line i starts with (an empty "
        "line: none); the search continues from it, and its tokens are scored",
    )
    parser.add_argument(
        "--word-scores",
        action="store_true",
        help="end each output line with the translation's log-probability, its mean per "
        "token (EOS included) and each token's log-probability (EOS last, space-separated), "
        "tab-separated, as aiayn score prints them: the emitted tokens scored teacher-forced "
        "(one more pass of the decoder; docs/translation.md, 'Scores')",
    )
    add_engine_arguments(parser)
    parser.set_defaults(run=run)


def _decode_overrides(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "beam_size": args.beam,
        "alpha": args.alpha,
        "beam_rule": args.beam_rule,
        "max_len_a": args.max_len_a,
        "max_len_b": args.max_len_b,
        "batch_tokens": args.batch_tokens,
    }
    return {key: value for key, value in given.items() if value is not None}


def format_translations(
    results: Sequence[list[Translation]], nbest: int, word_scores: bool = False
) -> list[str]:
    """Output lines: the best text per input; with ``nbest`` > 1, exactly ``nbest`` lines per
    input, 'rank<TAB>score<TAB>text' (an empty input gives empty texts with score 0, a missing
    hypothesis an empty text with score -inf). With ``word_scores`` each line ends in
    '<TAB>LOG_PROB<TAB>MEAN<TAB>WORD_SCORES' (``aiayn score --word-scores``'s fields; those
    of an empty input or a missing hypothesis: 0, 0 and none)."""
    from aiayn.cli.score import score_fields

    lines = []
    for hyps in results:
        for rank in range(1, nbest + 1):
            hyp = hyps[rank - 1] if rank <= len(hyps) else None
            if nbest == 1:
                line = hyp.text if hyp is not None else ""
            elif hyp is not None:
                line = f"{rank}\t{hyp.score:.4f}\t{hyp.text}"
            else:
                line = f"{rank}\t{0.0 if not hyps else float('-inf'):.4f}\t"
            if word_scores:
                scores = hyp.token_log_probs if hyp is not None else None
                log_prob = hyp.log_prob if hyp is not None else 0.0
                line += "\t" + score_fields(log_prob, scores or [], True)
            lines.append(line)
    return lines


def _write(out: TextIO, lines: Sequence[str]) -> None:
    if lines:
        out.write("\n".join(lines) + "\n")
    out.flush()


def _interactive(translator: TextTranslator, nbest: int, word_scores: bool = False) -> None:
    """Line by line from a terminal, with line editing and history (the arrow keys) where
    Python has readline."""
    try:
        import readline  # noqa: F401  (input() edits lines once it is imported)
    except ImportError:  # pragma: no cover - Windows without pyreadline
        pass
    if isinstance(sys.stdin, io.TextIOWrapper):  # invalid bytes arrive as lone surrogates
        sys.stdin.reconfigure(errors="surrogateescape")
    print("Type a sentence and press Enter; Ctrl-D ends.", file=sys.stderr, flush=True)
    number = 0
    while True:
        try:
            line = input()
        except EOFError:
            break
        number += 1
        if any("\udc80" <= ch <= "\udcff" for ch in line):
            # Say so and go on, with an empty output to keep lines in step.
            print(f"error: stdin: line {number} is not valid UTF-8", file=sys.stderr, flush=True)
            line = ""
        results = translator.translate_nbest([line], number)
        if word_scores:  # the source's ids again, as translate_nbest cut them (no warning)
            ids = translator.tokenizer.encode(line) if line.strip() else []
            results = translator.with_word_scores([ids[: translator.max_positions - 1]], results)
        _write(sys.stdout, format_translations(results, nbest, word_scores))


class _Stop(Exception):
    """SIGINT or SIGTERM while a file is translated (:class:`_Signals`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """SIGINT and SIGTERM end the translation of a file with :class:`_Stop`, but not in the
    middle of writing a window: a signal that comes then ends it right after the write, so
    that the output holds whole windows and the count of lines written is exact."""

    def __init__(self) -> None:
        self.writing = False
        self.received: int | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        if not self.writing:
            raise _Stop(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._handle) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def write_section(self) -> Iterator[None]:
        self.writing = True
        try:
            yield
        finally:
            self.writing = False
        if self.received is not None:
            raise _Stop(self.received)


@dataclass(frozen=True)
class SteeringFiles:
    """The lines of ``--constraints`` (each line's phrases) and ``--target-prefix``, one per
    input line, or None where the option is not given."""

    constraints: list[list[str]] | None = None
    prefixes: list[str] | None = None
    constraints_file: str = ""

    def __bool__(self) -> bool:
        return self.constraints is not None or self.prefixes is not None


def _line_file(path: str, option: str, count: int) -> list[str]:
    """The lines of ``path``, one per input line (UserError naming the file and line)."""
    from aiayn.inference.textio import read_lines

    lines = read_lines(path)
    if len(lines) != count:
        where = f"line {len(lines) + 1} is missing" if len(lines) < count else "it is longer"
        raise UserError(
            f"{path}: {where}: {option} needs one line per input line ({count:,}), "
            f"it has {len(lines):,}"
        )
    return lines


def read_steering(args: argparse.Namespace, count: int) -> SteeringFiles:
    """``--constraints`` and ``--target-prefix`` for ``count`` input lines: phrases split
    at tabs, each stripped; a tab-separated field that is empty is a UserError naming the
    file and line."""
    constraints = prefixes = None
    if args.constraints is not None:
        constraints = []
        for number, line in enumerate(_line_file(args.constraints, "--constraints", count), 1):
            phrases = [p.strip() for p in line.split("\t")] if line.strip() else []
            if any(not p for p in phrases):
                raise UserError(
                    f"{args.constraints}: line {number}: an empty phrase (phrases are "
                    "separated by one tab)"
                )
            constraints.append(phrases)
    if args.target_prefix is not None:
        prefixes = _line_file(args.target_prefix, "--target-prefix", count)
    return SteeringFiles(constraints, prefixes, args.constraints or "")


def _windows(
    translator: TextTranslator, lines: Sequence[str], steer: SteeringFiles | None = None
) -> Iterator[tuple[int, list[list[int]], list[Steering] | None]]:
    """Consecutive windows of ``lines`` as ``(first index, token ids of each line, their
    steering or None)``, each of about :data:`WINDOW_BATCHES` batches of source tokens (EOS
    included)."""
    budget = WINDOW_BATCHES * translator.decode.batch_tokens
    start = 0
    while start < len(lines):
        sources: list[list[int]] = []
        steering: list[Steering] | None = [] if steer else None
        size = 0
        while start + len(sources) < len(lines) and (not sources or size < budget):
            number = start + len(sources) + 1
            source = translator.encode_source(lines[number - 1], number)
            sources.append(source)
            if steer and steering is not None:
                try:
                    steering.append(
                        translator.encode_steering(
                            source,
                            steer.constraints[number - 1] if steer.constraints else (),
                            steer.prefixes[number - 1] if steer.prefixes else "",
                            number,
                        )
                    )
                except ValueError as err:  # a phrase that the tokenizer makes nothing of
                    raise UserError(f"{steer.constraints_file}: {err}") from None
            size += len(sources[-1]) + 1
        yield start, sources, steering
        start += len(sources)


def _translate_file(
    translator: TextTranslator,
    lines: Sequence[str],
    nbest: int,
    written: list[int],
    steer: SteeringFiles | None = None,
    *,
    word_scores: bool = False,
) -> tuple[int, int]:
    """Translate ``lines`` window by window, writing each window's translations to stdout in
    input order as it finishes; ``written[0]`` counts the input lines written. Returns the
    counts of non-empty input lines and of those whose (best) translation is empty."""
    signals = _Signals()
    asked = empty = 0
    with signals.installed():
        for start, sources, steering in _windows(translator, lines, steer):
            found = (
                translator.search_ids(sources)
                if steering is None
                else translator.search_ids(sources, steering)
            )
            results = translator.translations(found)
            if word_scores:
                results = translator.with_word_scores(sources, results)
            with signals.write_section():
                _write(sys.stdout, format_translations(results, nbest, word_scores))
                written[0] = start + len(sources)
            for source, hyps in zip(sources, results, strict=True):
                if source:
                    asked += 1
                    empty += not (hyps and hyps[0].text.strip())
    return asked, empty


_FULL = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


def _stdout_file() -> Path | None:
    """The regular file stdout writes to, where the system says (Linux's /proc)."""
    try:
        fd = sys.stdout.fileno()
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None
    return path if path.is_file() else None


def _cut_to_lines(path: Path, count: int) -> bool:
    """Cut the file ``path`` after its first ``count`` lines; whether that could be done."""
    try:
        with path.open("rb") as handle:
            end = 0
            for _ in range(count):
                line = handle.readline()
                if not line.endswith(b"\n"):
                    return False
                end += len(line)
        os.truncate(path, end)
    except OSError:
        return False
    return True


def _rest_command(args: argparse.Namespace, written: int) -> str:
    """The command that translates the input lines after the first ``written`` and appends
    their translations: the same options, the lines from ``tail``."""
    argv = list(getattr(args, "argv", None) or ["translate", args.checkpoint])
    rest = f"tail -n +{written + 1}"
    kept: list[str] = []  # shell words
    skip = False
    line_files = ("--constraints", "--target-prefix")  # their lines go with the input's
    for n, item in enumerate(argv):
        if skip:
            skip = False
        elif item in ("--input", "-i"):
            skip = True
        elif item in line_files and n + 1 < len(argv):
            kept += [item, f"<({rest} {shlex.quote(argv[n + 1])})"]
            skip = True
        elif item.startswith(tuple(f"{flag}=" for flag in line_files)):
            flag, value = item.split("=", 1)
            kept += [flag, f"<({rest} {shlex.quote(value)})"]
        elif not item.startswith(("--input=", "-i")) or item == "-i":
            kept.append(shlex.quote(item))
    source = "INPUT" if args.input in (None, "-") else shlex.quote(args.input)
    return f"{rest} {source} | aiayn {' '.join(kept)} >> OUTPUT"


def run(args: argparse.Namespace) -> int:
    # Imported here: `aiayn --help` stays fast (aiayn.cli).
    from aiayn.inference.textio import empty_translation_advice, read_input

    check_engine_options(args)  # before anything is read or exported
    steered = args.constraints is not None or args.target_prefix is not None
    if steered and args.input in (None, "-") and sys.stdin.isatty():
        raise CLIError(
            "--constraints and --target-prefix go line by line with a file: give --input "
            "FILE (or pipe the text in)"
        )
    try:
        translator, where = open_translator(args, _decode_overrides(args), args.nbest)
    except ValueError as err:
        raise CLIError(str(err)) from None
    if args.input in (None, "-") and sys.stdin.isatty():
        _interactive(translator, args.nbest, args.word_scores)
        return 0
    lines = read_input(args.input)
    steer = read_steering(args, len(lines))
    report = stderr_report()
    meter = report.meter("translating", len(lines))
    translator.on_batch = meter.advance
    written = [0]
    try:
        asked, empty = _translate_file(
            translator, lines, args.nbest, written, steer, word_scores=args.word_scores
        )
    except _Stop as stop:
        name = "interrupted" if stop.signum == signal.SIGINT else "stopped by SIGTERM"
        report.write(
            f"aiayn translate: {name}: the translations of the first {written[0]:,} of "
            f"{counted(len(lines), 'line')} are written, in order; to translate the rest: "
            f"{_rest_command(args, written[0])}"
        )
        return 128 + stop.signum
    except OSError as err:
        if err.errno not in _FULL:
            raise
        # Part of the window that failed may be written: a file is cut back to the lines said.
        from aiayn.cli import silence_stdout

        target = _stdout_file()
        kept = target is not None and _cut_to_lines(target, written[0] * args.nbest)
        silence_stdout()  # what stdout still buffers cannot be written: dropped at exit
        output = f"stdout ({target})" if target is not None else "stdout"
        extra = "" if kept else " (and perhaps part of the next: keep the first lines only)"
        raise UserError(
            f"no space left on the device of {output}: the translations of the first "
            f"{written[0]:,} of {counted(len(lines), 'line')} are written{extra}; free some "
            f"space, then translate the rest: {_rest_command(args, written[0])}"
        ) from None
    seconds = meter.seconds
    meter.finish(
        f"translated {counted(len(lines), 'line')} in {seconds:.1f} s "
        f"({len(lines) / max(seconds, 1e-9):,.1f} lines/s) with {translator.checkpoint} on {where}"
    )
    advice = empty_translation_advice(asked, empty, translator.decode.beam_size)
    if advice is not None:
        report.write(f"warning: {advice}")
    return 0
