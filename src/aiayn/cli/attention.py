"""``aiayn attention``: heat maps of every attention head for one translated sentence."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aiayn.errors import CLIError
from aiayn.progress import counted


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "attention",
        help="draw the attention heads for one sentence",
        description="Translate SENTENCE and write PNG heat maps of encoder self-attention, "
        "decoder self-attention and encoder-decoder attention, one file per layer with one "
        "panel per head, to --out. Prints the translation, then the files written.",
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN", help="checkpoint or run dir")
    parser.add_argument("sentence", metavar="SENTENCE", help="a source sentence")
    parser.add_argument("--out", default="attention", help="output folder (default: attention)")
    parser.add_argument("--beam", type=int, help="beam size (default: the run's, paper: 4)")
    parser.add_argument("--alpha", type=float, help="length penalty (default: the run's)")
    parser.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: `aiayn --help` stays fast (aiayn.cli).
    from aiayn.cli.paths import check_output_dir
    from aiayn.devices import pick_device
    from aiayn.inference.attention_maps import token_labeler, write_attention_pictures
    from aiayn.inference.translator import Translator

    check_output_dir(Path(args.out), "--out")
    device = pick_device(args.device or "auto")
    overrides = {"beam_size": args.beam, "alpha": args.alpha}
    try:
        translator, _ = Translator.from_checkpoint(
            args.checkpoint,
            device=device,
            decode_overrides={k: v for k, v in overrides.items() if v is not None},
        )
    except ValueError as err:
        raise CLIError(str(err)) from None
    src = translator.encode_source(args.sentence)
    if not src:
        raise CLIError("the sentence is empty")
    [hyps] = translator.search_ids([src])
    output = hyps[0].tokens
    label = token_labeler(translator.tokenizer)
    source_label = token_labeler(translator.tokenizer, source=True)
    paths = write_attention_pictures(translator.model, src, output, label, args.out, source_label)
    print(translator.tokenizer.decode(output))
    for path in paths:
        print(path)
    print(f"wrote {counted(len(paths), 'picture')} to {args.out}", file=sys.stderr)
    return 0
