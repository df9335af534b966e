"""``aiayn prepare``: raw parallel text (or a named corpus) to a binarised DATA_DIR."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from aiayn.config import DataConfig
from aiayn.errors import CLIError

_CORPORA = ("bible", "multi30k", "wmt14")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "prepare",
        help="train the joint vocabulary and binarise a parallel corpus",
        description="Read PREFIX.SRC / PREFIX.TGT text files (UTF-8, one sentence a line), train "
        "one joint sentencepiece vocabulary on the training text, and write memory-mapped token "
        "ids, the kept text and manifest.json to DATA_DIR. Re-running with the same inputs and "
        "options reuses DATA_DIR. With --corpus, the files come from a named corpus instead: "
        "'bible' (English-Spanish, from the SWORD modules installed by scripts/setup_env.sh), "
        "'multi30k' or 'wmt14' (downloaded into --cache-dir).",
    )
    inputs = parser.add_argument_group("input files")
    inputs.add_argument("--train", metavar="PREFIX", help="training text: PREFIX.SRC, PREFIX.TGT")
    inputs.add_argument("--valid", metavar="PREFIX", help="validation text")
    inputs.add_argument("--test", metavar="PREFIX", help="test text (optional)")
    inputs.add_argument("--src", metavar="LANG", help="source language suffix, e.g. en")
    inputs.add_argument("--tgt", metavar="LANG", help="target language suffix, e.g. de")
    named = parser.add_argument_group("named corpus (instead of --train/--valid/--test)")
    named.add_argument(
        "--corpus", choices=_CORPORA, help="bible (embedded en-es), multi30k or wmt14 (en-de)"
    )
    named.add_argument(
        "--cache-dir", metavar="DIR", help="downloads and extracted text (default ~/.cache/aiayn)"
    )
    named.add_argument(
        "--sword-path",
        metavar="PATH",
        action="append",
        help="bible: SWORD directory, module zip or directory of zips (repeatable); "
        "default /usr/share/sword and ~/.sword",
    )
    named.add_argument(
        "--download",
        action="store_true",
        help="bible: fetch CrossWire's module zips when no modules are installed",
    )
    parser.add_argument("--out", metavar="DATA_DIR", required=True, help="output directory")
    parser.add_argument("--vocab-size", type=int, default=8000, help="joint vocabulary size")
    parser.add_argument(
        "--model-type", choices=("bpe", "unigram"), default="bpe", help="sentencepiece model"
    )
    parser.add_argument(
        "--max-len",
        type=int,
        default=DataConfig.max_len,
        help="drop training pairs with more tokens on a side (default %(default)s)",
    )
    parser.add_argument(
        "--max-len-ratio",
        type=float,
        default=DataConfig.max_len_ratio,
        help="drop training pairs whose longer side exceeds this many times the shorter "
        "(0 = off; default %(default)s)",
    )
    parser.add_argument(
        "--encoding-errors",
        choices=("strict", "replace"),
        default="strict",
        help="invalid UTF-8: stop with the file and line (strict) or replace and count it",
    )
    parser.add_argument(
        "--input-sentence-size",
        type=int,
        default=None,
        help="sentences sampled to train the vocabulary (default 2,000,000)",
    )
    parser.add_argument(
        "--character-coverage", type=float, default=None, help="sentencepiece character coverage"
    )
    parser.add_argument("--force", action="store_true", help="redo everything, reuse nothing")
    parser.set_defaults(run=run)


def _log(message: str) -> None:
    print(f"aiayn prepare: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    # Imported here: `aiayn --help` stays fast (aiayn.cli).
    from aiayn.data.prepare import prepare_corpus, prepare_data

    if args.vocab_size < 5:
        raise CLIError(f"--vocab-size must be at least 5, got {args.vocab_size}")
    options: dict[str, Any] = {
        "model_type": args.model_type,
        "max_len": args.max_len,
        "max_len_ratio": args.max_len_ratio,
        "encoding_errors": args.encoding_errors,
        "force": args.force,
    }
    if args.input_sentence_size is not None:
        options["input_sentence_size"] = args.input_sentence_size
    if args.character_coverage is not None:
        options["character_coverage"] = args.character_coverage
    if args.corpus:
        given = [f"--{n}" for n in ("train", "valid", "test") if getattr(args, n)]
        if given:
            raise CLIError(f"--corpus {args.corpus} reads its own files; drop {', '.join(given)}")
        manifest = prepare_corpus(
            args.corpus,
            args.out,
            vocab_size=args.vocab_size,
            src=args.src,
            tgt=args.tgt,
            cache_dir=args.cache_dir,
            sword_path=args.sword_path,
            download=args.download,
            log=_log,
            **options,
        )
    else:
        missing = [f"--{n}" for n in ("train", "valid", "src", "tgt") if not getattr(args, n)]
        if missing:
            raise CLIError(f"missing {', '.join(missing)} (or name a --corpus)")
        if args.sword_path or args.download:
            raise CLIError("--sword-path and --download go with --corpus bible")
        manifest = prepare_data(
            args.train,
            args.valid,
            args.test,
            args.src,
            args.tgt,
            args.vocab_size,
            args.out,
            log=_log,
            **options,
        )
    print(summary(manifest, args.out))
    return 0


def summary(manifest: dict[str, Any], out: str) -> str:
    """A few lines on what DATA_DIR now holds."""
    src, tgt = manifest["src"], manifest["tgt"]
    lines = [
        f"{out}: {src}-{tgt}, joint vocabulary {manifest['vocab_size']:,} "
        f"({manifest['tokenizer_options']['model_type']})"
    ]
    for split, info in manifest["splits"].items():
        dropped = ", ".join(f"{n:,} {why}" for why, n in info["dropped"].items() if n)
        lines.append(
            f"  {split:<5} {info['pairs']:>10,} pairs  {info['tokens'][src]:>12,} {src} tokens  "
            f"{info['tokens'][tgt]:>12,} {tgt} tokens"
            + (f"  (dropped: {dropped})" if dropped else "")
        )
    return "\n".join(lines)
