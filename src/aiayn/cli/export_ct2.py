"""``aiayn export-ct2``: a translation model as a CTranslate2 model directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from aiayn.cli.paths import add_checkpoint_argument
from aiayn.interop import QUANTIZATIONS


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "export-ct2",
        help="export a translation model to CTranslate2",
        description="Write a CTranslate2 model directory for a translation model: model.bin, "
        "config.json and the vocabulary (through CTranslate2's own model specification), the "
        "sentencepiece model, a README that shows how to translate with ctranslate2.Translator, "
        "and aiayn.json (what was exported). Needs CTranslate2: pip install 'aiayn[interop]'. "
        "`aiayn translate --engine ctranslate2` exports by itself and caches the export "
        "beside the checkpoint.",
    )
    add_checkpoint_argument(parser)
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="the directory")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="the weights' type (default float32); int8 and int16 quantize the linear layers "
        "and the embeddings per row",
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiayn.interop.ct2 import export_ct2

    # A model that never exports is refused before CTranslate2 is looked for (the checkpoint
    # is mapped; its records' checksums read it once).
    out = export_ct2(args.checkpoint, args.out, args.quantization, force=args.force)
    print(out)
    return 0
