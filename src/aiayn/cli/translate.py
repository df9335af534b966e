"""``aiayn translate``: raw source text in, detokenised translations out, one line per line."""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from aiayn.errors import CLIError
from aiayn.progress import stderr_report

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
        "--engine ctranslate2 decodes with CTranslate2 instead of PyTorch (docs/interop.md).",
    )
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_OR_RUN",
        help="a checkpoint file, or a run directory (averaged.pt, else the newest checkpoint)",
    )
    parser.add_argument("--input", "-i", metavar="FILE", help="source text (default: stdin)")
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
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument(
        "--engine",
        choices=["torch", "ctranslate2"],
        default="torch",
        help="what decodes: 'torch' (the model in PyTorch, the default) or 'ctranslate2' "
        "(the checkpoint exported to CTranslate2 once, cached beside it as NAME.ct2-float32 "
        "or NAME.ct2-int8, and decoded with aiayn's tokenisation, batching, output limit and "
        "length penalty; beam search by the fairseq rule, which is CTranslate2's; needs "
        "pip install 'aiayn[interop]')",
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads of the decoding (default: PyTorch's or CTranslate2's own default)",
    )
    parser.add_argument(
        "--quantize",
        choices=["int8"],
        help="dynamic int8 quantization of the linear layers (CPU only; changes outputs a "
        "little); with --engine ctranslate2, CTranslate2's int8 weights",
    )
    parser.add_argument(
        "--pack-weights",
        action="store_true",
        help="pre-pack the float32 weights for MKL (CPU): faster for one to 32 sentences at a "
        "time (interactive use), no gain for large batches; 1.25-1.8x the weights' size "
        "more memory",
    )
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="weights and products in this dtype (default fp32): bf16 on a CPU with bfloat16 "
        "instructions (AVX512-BF16 or AMX) or a GPU, fp16 on a GPU; faster batches, slower "
        "one-sentence steps on the CPU; log-probabilities and beam scores stay float32; "
        "with --engine ctranslate2, CTranslate2's compute type (float32, bfloat16, float16)",
    )
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
            print(f"error: stdin line {number} is not valid UTF-8", file=sys.stderr, flush=True)
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
        quantize=args.quantize,
        pack_weights=args.pack_weights,
        precision=args.precision,
    )
    return translator, str(device)


def _ct2_device(requested: str | None) -> str:
    """cpu, cuda or cuda:N for CTranslate2 ("auto": CUDA where CTranslate2 sees a GPU)."""
    from aiayn.interop.ct2 import import_ctranslate2

    ct2 = import_ctranslate2()
    if requested in (None, "auto"):
        return "cuda" if ct2.get_cuda_device_count() > 0 else "cpu"
    kind, _, index = requested.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise CLIError(f"unknown device {requested!r} for CTranslate2 (cpu, cuda, cuda:N)")
    return requested


def _ct2_translator(args: argparse.Namespace) -> tuple[TextTranslator, str]:
    """The CTranslate2 engine's translator (through the export cached beside the checkpoint)
    and the device it runs on."""
    if args.pack_weights:
        raise CLIError("--pack-weights is an option of --engine torch")
    if args.beam_rule == "paper" and args.beam != 1:  # refused before anything is exported
        raise CLIError(
            "CTranslate2's beam search stops as the fairseq rule does (beam rule 'paper' has "
            "no CTranslate2 equivalent): use --beam-rule fairseq, or --engine torch"
        )
    from aiayn.interop.ct2_translator import Ct2Translator

    device = _ct2_device(args.device)
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
    from aiayn.inference.textio import read_lines, split_lines

    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads must be at least 1, got {args.threads}")
    try:
        if args.engine == "ctranslate2":
            translator, where = _ct2_translator(args)
        else:
            translator, where = _torch_translator(args)
    except ValueError as err:
        raise CLIError(str(err)) from None
    if args.input is None and sys.stdin.isatty():
        _interactive(translator, args.nbest)
        return 0
    lines = read_lines(args.input) if args.input else split_lines(sys.stdin.buffer.read(), "stdin")
    meter = stderr_report().meter("translating", len(lines))
    translator.on_batch = meter.advance
    for first in range(0, len(lines), CHUNK_LINES):
        chunk = lines[first : first + CHUNK_LINES]
        results = translator.translate_nbest(chunk, first_line=first + 1)
        _write(sys.stdout, format_translations(results, args.nbest))
    seconds = meter.seconds
    meter.finish(
        f"translated {len(lines):,} lines in {seconds:.1f} s "
        f"({len(lines) / max(seconds, 1e-9):,.1f} lines/s) with {translator.checkpoint} on {where}"
    )
    return 0
