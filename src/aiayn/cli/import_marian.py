"""``aiayn import-marian``: a Hugging Face Marian / OPUS-MT model as an aiayn checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "import-marian",
        help="import a Hugging Face Marian (OPUS-MT) model directory",
        description="Convert a local Hugging Face MarianMTModel directory (config.json, "
        "model.safetensors or pytorch_model.bin, source.spm, target.spm, vocab.json) into an "
        "aiayn checkpoint with its tokenizer, which `aiayn translate` and `serve` use like any "
        "other (`aiayn bleu` then scores the translations). Download the directory first, "
        "e.g. with `huggingface-cli download Helsinki-NLP/opus-mt-en-de --local-dir DIR`.",
    )
    parser.add_argument("directory", type=Path, metavar="DIR", help="Marian model directory")
    parser.add_argument("--out", type=Path, required=True, metavar="FILE", help="checkpoint")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiayn.cli.paths import check_output_file
    from aiayn.interop.marian import import_marian, write_checkpoint
    from aiayn.model.transformer import count_parameters

    check_output_file(args.out, "--out")
    model, config, tokenizer = import_marian(args.directory)
    path = write_checkpoint(model, config, tokenizer, args.out)
    vocab = (
        f"shared vocabulary {tokenizer.vocab_size:,}"
        if tokenizer.shared
        else f"vocabularies {tokenizer.vocab_size:,} / {tokenizer.target_vocab_size:,}"
    )
    print(
        f"{path}: {count_parameters(model):,} parameters, {config.model.n_layers}+"
        f"{config.model.n_layers} layers, d_model {config.model.d_model}, "
        f"{config.model.activation}, {vocab}"
    )
    return 0
