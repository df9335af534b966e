"""``aiayn export-hf``: a translation model as a Hugging Face Marian model directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from aiayn.cli.paths import add_checkpoint_argument


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "export-hf",
        help="export a translation model to Hugging Face transformers (MarianMTModel)",
        description="Write a Hugging Face model directory for a translation model: "
        "config.json, generation_config.json and model.safetensors, which "
        "MarianMTModel.from_pretrained loads; vocab.json, source.spm, target.spm and "
        "tokenizer_config.json, which MarianTokenizer.from_pretrained loads; and a model card "
        "(README.md) written from the run. transformers then translates as `aiayn translate` "
        "does (docs/interop.md). Nothing is uploaded: `hf upload NAME DIR .` "
        "(huggingface_hub's CLI) publishes the directory.",
    )
    add_checkpoint_argument(parser)
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="the directory")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument(
        "--evaluate",
        nargs=2,
        action="append",
        default=[],
        type=Path,
        metavar=("SOURCE", "REFERENCE"),
        help="translate SOURCE with the model (the run's decode settings) and put its "
        "sacreBLEU BLEU and chrF against REFERENCE, with their signatures, in the model card; "
        "may be given more than once",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiayn.interop.hf import export_hf

    out = export_hf(args.checkpoint, args.out, force=args.force, evaluate_on=args.evaluate)
    print(out)
    return 0
