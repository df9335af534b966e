"""``aiayn prepare``: raw parallel text, monolingual or labelled text (or a named corpus) to a
binarised DATA_DIR."""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiayn.config import DataConfig
from aiayn.errors import CLIError
from aiayn.progress import Report, counted, stderr_report

_CORPORA = ("bible", "multi30k", "wmt14")
_TASKS = ("translation", "lm", "classify")
_DEFAULT_VOCAB_SIZE = 8000


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "prepare",
        help="train the vocabulary and binarise a corpus (parallel, monolingual or labelled)",
        description="Read PREFIX.SRC / PREFIX.TGT text files (UTF-8, one sentence a line), train "
        "one joint sentencepiece vocabulary on the training text, and write memory-mapped token "
        "ids, the kept text and manifest.json to DATA_DIR. Re-running with the same inputs and "
        "options reuses DATA_DIR. With --corpus, the files come from a named corpus instead: "
        "'bible' (English-Spanish, from the SWORD modules installed by scripts/setup_env.sh), "
        "'multi30k' or 'wmt14' (downloaded into --cache-dir). With --task lm (one document or "
        "sentence a line, for language models and masked-LM pre-training) or --task classify "
        "(LABEL<TAB>TEXT lines), --train/--valid/--test name whole files of one language; "
        "--corpus bible gives its --lang text (lm: held-out books; classify: each verse's "
        "--label, genre or book).",
    )
    parser.add_argument(
        "--task",
        choices=_TASKS,
        default="translation",
        help="translation (parallel text, the default), lm or classify (text of one language)",
    )
    inputs = parser.add_argument_group("input files")
    inputs.add_argument(
        "--train",
        metavar="PREFIX|FILE",
        help="training text: PREFIX.SRC, PREFIX.TGT (translation) or FILE (lm, classify)",
    )
    inputs.add_argument("--valid", metavar="PREFIX|FILE", help="validation text")
    inputs.add_argument("--test", metavar="PREFIX|FILE", help="test text (optional)")
    inputs.add_argument(
        "--src", metavar="LANG", help="translation: source language suffix, e.g. en"
    )
    inputs.add_argument(
        "--tgt", metavar="LANG", help="translation: target language suffix, e.g. de"
    )
    inputs.add_argument(
        "--tokenizer",
        metavar="SPM_MODEL_OR_CHECKPOINT",
        help="use this tokenizer instead of training one, to go on training a model on new text "
        "(train.init_from): a checkpoint or run directory (its tokenizer, e.g. the Marian "
        "vocabularies of a model from aiayn import-marian), a DATA_DIR, or a sentencepiece "
        "model (lm, classify: with <mask> at id 4)",
    )
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
    named.add_argument(
        "--lang", choices=("en", "es"), help="bible with --task lm or classify: the text (en)"
    )
    named.add_argument(
        "--label",
        choices=("genre", "book"),
        help="bible with --task classify: what a verse is labelled with (genre)",
    )
    parser.add_argument("--out", metavar="DATA_DIR", required=True, help="output directory")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"vocabulary size (default {_DEFAULT_VOCAB_SIZE:,})",
    )
    parser.add_argument(
        "--model-type", choices=("bpe", "unigram"), default="bpe", help="sentencepiece model"
    )
    parser.add_argument(
        "--max-len",
        type=int,
        default=None,
        help=f"translation: drop training pairs with more tokens on a side "
        f"(default {DataConfig.max_len})",
    )
    parser.add_argument(
        "--max-len-ratio",
        type=float,
        default=None,
        help="translation: drop training pairs whose longer side exceeds this many times the "
        f"shorter (0 = off; default {DataConfig.max_len_ratio})",
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
        help="sentences sampled to train the vocabulary (default 2,000,000; 0: every one)",
    )
    parser.add_argument(
        "--character-coverage", type=float, default=None, help="sentencepiece character coverage"
    )
    parser.add_argument("--force", action="store_true", help="redo everything, reuse nothing")
    parser.set_defaults(run=run)


def _log() -> Report:
    return stderr_report("aiayn prepare: ")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    existed = out.exists()
    try:
        return _run(args)
    except BaseException:
        # A failed first prepare leaves no empty DATA_DIR behind (one that held files stays;
        # the library takes its own lock file away).
        if not existed and out.is_dir() and not any(out.iterdir()):
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


def _run(args: argparse.Namespace) -> int:
    if args.vocab_size is not None and args.vocab_size < 5:
        raise CLIError(f"--vocab-size must be at least 5, got {args.vocab_size}")
    if args.max_len is not None and args.max_len < 1:
        raise CLIError(f"--max-len must be at least 1, got {args.max_len}")
    ratio = args.max_len_ratio
    if ratio is not None and not (ratio == 0 or 1 <= ratio < math.inf):
        raise CLIError(f"--max-len-ratio must be 0 (off) or a finite 1 or more, got {ratio:g}")
    if args.input_sentence_size is not None:
        from aiayn.data.tokenizer import MIN_INPUT_SENTENCE_SIZE as least

        if not (args.input_sentence_size == 0 or args.input_sentence_size >= least):
            raise CLIError(
                f"--input-sentence-size must be 0 (every sentence) or at least {least}, got "
                f"{args.input_sentence_size}"
            )
    coverage = args.character_coverage
    if coverage is not None and not 0 < coverage <= 1:
        raise CLIError(f"--character-coverage must be above 0 and at most 1, got {coverage:g}")
    options: dict[str, Any] = {
        "model_type": args.model_type,
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
    elif args.sword_path or args.download:
        raise CLIError("--sword-path and --download go with --corpus bible")
    with contextlib.ExitStack() as cleanup:
        # Made only where a checkpoint's tokenizer is written out: a killed run leaves no
        # folder behind otherwise.
        def staging() -> Path:
            return Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="aiayn-")))

        prepare = _prepare_translation if args.task == "translation" else _prepare_text
        manifest = prepare(args, options, staging)
    print(summary(manifest, args.out))
    return 0


def _prepare_translation(
    args: argparse.Namespace, options: dict[str, Any], staging: Callable[[], Path]
) -> dict[str, Any]:
    # Imported here: `aiayn --help` stays fast (aiayn.cli).
    from aiayn.data.prepare import prepare_corpus, prepare_data

    text_only = [f"--{n}" for n in ("lang", "label") if getattr(args, n)]
    if text_only:
        raise CLIError(f"{', '.join(text_only)}: only with --task lm or --task classify")
    if args.tokenizer:
        _no_vocabulary_options(args)
        options["tokenizer"], options["tokenizer_source"] = _tokenizer_file(args.tokenizer, staging)
    options["max_len"] = DataConfig.max_len if args.max_len is None else args.max_len
    options["max_len_ratio"] = (
        DataConfig.max_len_ratio if args.max_len_ratio is None else args.max_len_ratio
    )
    vocab_size = args.vocab_size or _DEFAULT_VOCAB_SIZE
    if args.corpus:
        return prepare_corpus(
            args.corpus,
            args.out,
            vocab_size=vocab_size,
            src=args.src,
            tgt=args.tgt,
            cache_dir=args.cache_dir,
            sword_path=args.sword_path,
            download=args.download,
            log=_log(),
            **options,
        )
    missing = [f"--{n}" for n in ("train", "valid", "src", "tgt") if not getattr(args, n)]
    if missing:
        raise CLIError(f"missing {', '.join(missing)} (or name a --corpus)")
    return prepare_data(
        args.train,
        args.valid,
        args.test,
        args.src,
        args.tgt,
        vocab_size,
        args.out,
        log=_log(),
        **options,
    )


def _no_vocabulary_options(args: argparse.Namespace) -> None:
    given = [
        f"--{name.replace('_', '-')}"
        for name in ("vocab_size", "input_sentence_size", "character_coverage")
        if getattr(args, name) is not None
    ]
    if args.model_type != "bpe":
        given.append("--model-type")
    if given:
        raise CLIError(f"--tokenizer brings its own vocabulary; drop {', '.join(given)}")


def _tokenizer_file(given: str, staging: Callable[[], Path]) -> tuple[Path, str]:
    """The tokenizer file that ``--tokenizer`` names (the file itself, a data directory's
    spm.model, or the tokenizer of a checkpoint or run directory written to a folder that
    ``staging`` makes) and
    the file it came from, for the manifest."""
    from aiayn.data.corpus import tokenizer_path
    from aiayn.inference.loading import CheckpointError, resolve_and_load, tensor_to_bytes

    path = Path(given)
    if path.is_dir() and tokenizer_path(path).is_file():
        return tokenizer_path(path), str(tokenizer_path(path).resolve())
    if path.is_file() and not path.name.endswith((".pt", ".pth")):
        return path, str(path.resolve())
    try:
        found, state = resolve_and_load(path)
    except CheckpointError as err:
        raise CLIError(f"--tokenizer {given}: {err}") from None
    if state.get("tokenizer") is None or state["tokenizer"].numel() == 0:
        raise CLIError(f"--tokenizer {given}: {found} carries no tokenizer")
    out = staging() / "spm.model"
    out.write_bytes(tensor_to_bytes(state["tokenizer"]))
    return out, str(Path(found).resolve())


def _prepare_text(
    args: argparse.Namespace, options: dict[str, Any], staging: Callable[[], Path]
) -> dict[str, Any]:
    from aiayn.data.text import prepare_bible_text, prepare_text

    task = args.task
    translation_only = [
        f"--{n.replace('_', '-')}"
        for n in ("src", "tgt", "max_len", "max_len_ratio")
        if getattr(args, n) is not None
    ]
    if translation_only:
        raise CLIError(
            f"{', '.join(translation_only)}: only for translation; --task {task} reads whole "
            "files of one language and keeps every line (long ones are cut when batched)"
        )
    if args.label and task != "classify":
        raise CLIError("--label goes with --task classify")
    if args.tokenizer:
        _no_vocabulary_options(args)
        options["tokenizer"], options["tokenizer_source"] = _tokenizer_file(args.tokenizer, staging)
    vocab_size = args.vocab_size or _DEFAULT_VOCAB_SIZE
    if args.corpus:
        if args.corpus != "bible":
            raise CLIError(
                f"--task {task} has no --corpus {args.corpus}: only bible (its --lang text), "
                "or --train FILE --valid FILE"
            )
        return prepare_bible_text(
            args.out,
            task,
            lang=args.lang or "en",
            label=args.label or "genre",
            vocab_size=vocab_size,
            sword_path=args.sword_path,
            download=args.download,
            cache_dir=args.cache_dir,
            log=_log(),
            **options,
        )
    if args.lang or args.label:
        raise CLIError("--lang and --label go with --corpus bible")
    missing = [f"--{n}" for n in ("train", "valid") if not getattr(args, n)]
    if missing:
        raise CLIError(f"missing {', '.join(missing)} (or --corpus bible)")
    return prepare_text(
        task, args.train, args.valid, args.test, args.out, vocab_size, log=_log(), **options
    )


def summary(manifest: dict[str, Any], out: str) -> str:
    """A few lines on what DATA_DIR now holds."""
    from aiayn.data.corpus import data_kind

    if data_kind(manifest) == "text":
        return _text_summary(manifest, out)
    src, tgt = manifest["src"], manifest["tgt"]
    options = manifest["tokenizer_options"]
    origin = f"from {options['from']}" if "from" in options else options["model_type"]
    sizes = f"joint vocabulary {manifest['vocab_size']:,}"
    if "tgt_vocab_size" in manifest:
        sizes = (
            f"vocabularies {manifest['vocab_size']:,} {src}, {manifest['tgt_vocab_size']:,} {tgt}"
        )
    lines = [f"{out}: {src}-{tgt}, {sizes} ({origin})"]
    for split, info in manifest["splits"].items():
        lines.append(
            f"  {split:<5} {info['pairs']:>10,} pairs  {info['tokens'][src]:>12,} {src} tokens  "
            f"{info['tokens'][tgt]:>12,} {tgt} tokens" + _dropped(info)
        )
    return "\n".join(lines)


def _text_summary(manifest: dict[str, Any], out: str) -> str:
    options = manifest["tokenizer_options"]
    origin = f"from {options['from']}" if "from" in options else options["model_type"]
    lines = [
        f"{out}: text for the {manifest['task']} task, vocabulary {manifest['vocab_size']:,} "
        f"({origin})"
    ]
    splits = manifest["splits"]
    for split, info in splits.items():
        lines.append(
            f"  {split:<5} {info['lines']:>10,} lines  {info['tokens']:>12,} tokens  "
            f"longest {info['longest']:,}" + _dropped(info)
        )
    if names := manifest.get("labels"):
        width = max(len(name) for name in names) + 2
        lines.append(
            f"  {len(names)} classes".ljust(width + 2) + "".join(f"{s:>10}" for s in splits)
        )
        for name in names:
            counts = "".join(f"{info['label_counts'][name]:>10,}" for info in splits.values())
            lines.append(f"    {name:<{width}}{counts}")
    return "\n".join(lines)


def _dropped(info: dict[str, Any]) -> str:
    """What a split lost or had mended: dropped lines by reason, lines whose invalid UTF-8
    was replaced (``--encoding-errors replace``)."""
    notes = [f"dropped: {', '.join(f'{n:,} {why}' for why, n in info['dropped'].items() if n)}"]
    if not any(info["dropped"].values()):
        notes = []
    replaced = info.get("utf8_replaced_lines", 0)
    if isinstance(replaced, dict):  # parallel data: per language
        replaced = sum(replaced.values())
    if replaced:
        notes.append(f"{counted(replaced, 'line')} with invalid UTF-8 replaced")
    return f"  ({'; '.join(notes)})" if notes else ""
