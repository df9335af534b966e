"""``aiayn translate``: raw source text in, detokenised translations out, one line per line."""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from aiayn.cli.engines import add_engine_arguments, check_engine_options, ct2_device
from aiayn.cli.paths import add_checkpoint_argument
from aiayn.cli.process import PROCESS_SETTINGS
from aiayn.errors import CLIError
from aiayn.progress import counted, stderr_report

if TYPE_CHECKING:
    from aiayn.inference.translator import TextTranslator, Translation

# Lines translated (and written) at a time: bounds memory, keeps output flowing.
CHUNK_LINES = 10000


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "translate",
        help="translate raw text with a checkpoint",
        description="Translate raw text, one sentence a line, from --input or stdin; write one "
        "detokenised translation a line to stdout (with --nbest K: K lines per input line, "
        "'rank<TAB>score<TAB>text'). With a terminal on stdin it translates line by line. "
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


def format_translations(results: Sequence[list[Translation]], nbest: int) -> list[str]:
    """Output lines: the best text per input; with ``nbest`` > 1, exactly ``nbest`` lines per
    input, 'rank<TAB>score<TAB>text' (an empty input gives empty texts with score 0, a missing
    hypothesis an empty text with score -inf)."""
    if nbest == 1:
        return [hyps[0].text if hyps else "" for hyps in results]
    lines = []
    for hyps in results:
        for rank in range(1, nbest + 1):
            if rank <= len(hyps):
                lines.append(f"{rank}\t{hyps[rank - 1].score:.4f}\t{hyps[rank - 1].text}")
            else:
                lines.append(f"{rank}\t{0.0 if not hyps else float('-inf'):.4f}\t")
    return lines


def _write(out: TextIO, lines: Sequence[str]) -> None:
    if lines:
        out.write("\n".join(lines) + "\n")
    out.flush()


def _interactive(translator: TextTranslator, nbest: int) -> None:
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
        _write(sys.stdout, format_translations(translator.translate_nbest([line], number), nbest))


def _torch_translator(args: argparse.Namespace) -> tuple[TextTranslator, str]:
    """The PyTorch engine's translator and the device it runs on."""
    from aiayn.devices import pick_device
    from aiayn.inference.translator import Translator

    device = pick_device(args.device or "auto")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    translator, _ = Translator.from_checkpoint(
        args.checkpoint,
        device=device,
        decode_overrides=_decode_overrides(args),
        nbest=args.nbest,
        pack_weights=args.pack_weights,
        precision=args.precision,
        compiled_step=args.compiled_step,
        mmap=args.mmap is not False,
        process_settings=True,
    )
    return translator, str(device)


def _ct2_translator(args: argparse.Namespace) -> tuple[TextTranslator, str]:
    """The CTranslate2 engine's translator (through the export cached beside the checkpoint)
    and the device it runs on."""
    from aiayn.interop.ct2_translator import Ct2Translator

    device = ct2_device(args.device)
    log = stderr_report()
    translator, _ = Ct2Translator.from_checkpoint(
        args.checkpoint,
        device=device,
        decode_overrides=_decode_overrides(args),
        nbest=args.nbest,
        quantize=args.quantize,
        precision=args.precision,
        threads=args.threads or 0,
        log=log,
    )
    return translator, f"{device} (CTranslate2, {translator.compute_type})"


def run(args: argparse.Namespace) -> int:
    # Imported here: `aiayn --help` stays fast (aiayn.cli).
    from aiayn.inference.textio import read_input

    check_engine_options(args)  # before anything is read or exported
    try:
        if args.engine == "ctranslate2":
            translator, where = _ct2_translator(args)
        else:
            translator, where = _torch_translator(args)
    except ValueError as err:
        raise CLIError(str(err)) from None
    if args.input in (None, "-") and sys.stdin.isatty():
        _interactive(translator, args.nbest)
        return 0
    lines = read_input(args.input)
    meter = stderr_report().meter("translating", len(lines))
    translator.on_batch = meter.advance
    for first in range(0, len(lines), CHUNK_LINES):
        chunk = lines[first : first + CHUNK_LINES]
        results = translator.translate_nbest(chunk, first_line=first + 1)
        _write(sys.stdout, format_translations(results, args.nbest))
    seconds = meter.seconds
    meter.finish(
        f"translated {counted(len(lines), 'line')} in {seconds:.1f} s "
        f"({len(lines) / max(seconds, 1e-9):,.1f} lines/s) with {translator.checkpoint} on {where}"
    )
    return 0
