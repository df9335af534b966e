"""``aiayn prepare`` as a library function: raw parallel text in, a binarised DATA_DIR out.

Three passes, none of which holds the corpus as Python objects:

1. read every split line by line (strict UTF-8 unless told otherwise), drop pairs with an empty
   side, write the kept text to a staging directory;
2. train one joint sentencepiece model on the kept training text (or reuse the existing one
   when the training text and vocabulary options are unchanged);
3. encode each split in chunks, drop training pairs beyond the length limits, and append the ids
   to flat ``.bin`` files with ``int64`` offsets and ``int32`` lengths beside them.

Everything is written under ``DATA_DIR/.prepare-*`` first and moved into place at the end; the
manifest is removed before and written after the move, so an interrupted run never leaves a
directory that :func:`aiayn.data.corpus.load_manifest` accepts with half-written data
(:mod:`aiayn.data.staging`, which the text tasks' :mod:`aiayn.data.text.prepare` shares, as it
shares the reading of :mod:`aiayn.data.raw_text` and the id files of :mod:`aiayn.data.binarise`).
"""

from __future__ import annotations

import contextlib
import datetime
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aiayn import __version__
from aiayn.config import DataConfig
from aiayn.data.binarise import line_chunks, write_ids, write_offsets
from aiayn.data.corpus import (
    MANIFEST_FORMAT_VERSION,
    TOKENIZER_NAME,
    ids_dtype,
    ids_paths,
    text_path,
)
from aiayn.data.raw_text import LINE_BREAKS, EncodingErrors, count_lines, decode_line, open_input
from aiayn.data.sources import bible, multi30k, wmt14
from aiayn.data.sources.download import default_cache_dir
from aiayn.data.staging import (
    commit,
    content_digest,
    digest,
    file_stamp,
    refuse_overwriting,
    reusable_tokenizer,
    reuse_or_write,
    staged_tokenizer,
    staging_dir,
)
from aiayn.data.tokenizer import (
    DEFAULT_CHARACTER_COVERAGE,
    DEFAULT_INPUT_SENTENCE_SIZE,
    Tokenizer,
    train_tokenizer,
)
from aiayn.errors import UserError
from aiayn.progress import Log, Meter, Report, as_report, counted


@dataclass
class _SplitStats:
    lines: int = 0
    pairs: int = 0
    dropped: dict[str, int] = field(
        default_factory=lambda: {"empty": 0, "too_long": 0, "length_ratio": 0}
    )
    replaced: dict[str, int] = field(default_factory=lambda: {"src": 0, "tgt": 0})
    same: int = 0  # kept pairs whose two sides are the same text
    tokens: dict[str, int] = field(default_factory=lambda: {"src": 0, "tgt": 0})
    longest: dict[str, int] = field(default_factory=lambda: {"src": 0, "tgt": 0})


def input_paths(prefix: str | Path, src: str, tgt: str) -> tuple[Path, Path]:
    """``PREFIX.src`` and ``PREFIX.tgt``."""
    prefix = str(prefix)
    return Path(f"{prefix}.{src}"), Path(f"{prefix}.{tgt}")


def prepare_data(
    train_prefix: str | Path,
    valid_prefix: str | Path,
    test_prefix: str | Path | None,
    src: str,
    tgt: str,
    vocab_size: int,
    out_dir: str | Path,
    *,
    model_type: str = "bpe",
    max_len: int = DataConfig.max_len,
    max_len_ratio: float = DataConfig.max_len_ratio,
    encoding_errors: EncodingErrors = "strict",
    character_coverage: float = DEFAULT_CHARACTER_COVERAGE,
    input_sentence_size: int = DEFAULT_INPUT_SENTENCE_SIZE,
    tokenizer: str | Path | None = None,
    tokenizer_source: str | None = None,
    force: bool = False,
    log: Log | Report | None = None,
) -> dict[str, Any]:
    """Prepare DATA_DIR from ``PREFIX.{src,tgt}`` text files; returns the manifest.

    Training pairs with more than ``max_len`` tokens on a side, or whose longer side has more
    than ``max_len_ratio`` times the tokens of the shorter (``<= 0`` turns the check off), are
    dropped and counted; valid and test are kept whole so that BLEU uses the full references.
    With the same inputs (path, size, modification time) and options the existing directory
    is reused as it is, unless ``force``.

    ``tokenizer``: an existing tokenizer file (the ``spm.model`` of a data directory, or the
    tokenizer of a checkpoint written out, e.g. of a model imported from Marian with its own
    source and target vocabularies) to encode with instead of training one, so that a model
    trained on that tokenizer can go on training on this text; ``vocab_size`` and the
    vocabulary options are then ignored. ``tokenizer_source`` names where it came from in the
    manifest (default: the file).
    """
    say = as_report(log)
    if src == tgt:
        raise UserError(f"source and target language are both {src!r}")
    for lang in (src, tgt):
        if not lang or "/" in lang or lang.startswith("."):
            raise UserError(f"{lang!r} is not usable as a language suffix")
    if max_len < 1:
        raise UserError(f"max_len must be at least 1, got {max_len}")
    if encoding_errors not in ("strict", "replace"):
        raise UserError(f"encoding_errors must be 'strict' or 'replace', got {encoding_errors!r}")
    prefixes = {"train": train_prefix, "valid": valid_prefix}
    if test_prefix is not None:
        prefixes["test"] = test_prefix
    inputs = {split: input_paths(prefix, src, tgt) for split, prefix in prefixes.items()}

    for split, (src_path, _) in inputs.items():
        prefix = str(prefixes[split])
        if not src_path.exists() and prefix.endswith((f".{src}", f".{tgt}")):
            stem = prefix.rsplit(".", 1)[0]
            raise UserError(
                f"{src_path}: file not found; the prefix names the files without their language "
                f"suffix: --{split} {stem} (for {stem}.{src} and {stem}.{tgt})"
            )
    # Every input is checked before any work: a bad test file should not cost a BPE training.
    line_counts: dict[str, int] = {}
    for split, (src_path, tgt_path) in inputs.items():
        n_src, n_tgt = count_lines(src_path), count_lines(tgt_path)
        if n_src != n_tgt:
            raise UserError(
                f"{src_path} has {counted(n_src, 'line')} but {tgt_path} has {n_tgt:,}: the two "
                f"sides of "
                f"the {split} split must have one sentence per line, line for line"
            )
        line_counts[split] = n_src

    given = None if tokenizer is None else Path(tokenizer)
    options = {
        "src": src,
        "tgt": tgt,
        "vocab_size": vocab_size,
        "model_type": model_type,
        "character_coverage": character_coverage,
        "input_sentence_size": input_sentence_size,
        "max_len": max_len,
        "max_len_ratio": max_len_ratio,
        "encoding_errors": encoding_errors,
    }
    if given is not None:
        Tokenizer.load(given)  # a missing or unusable file: a UserError naming it, before work
        for key in ("vocab_size", "model_type", "character_coverage", "input_sentence_size"):
            del options[key]
        options["tokenizer"] = content_digest([given])
    stamps = {split: [file_stamp(p) for p in paths] for split, paths in inputs.items()}
    fingerprint = digest({"format_version": MANIFEST_FORMAT_VERSION, **options, "in": stamps})
    vocab_keys = (
        *("src", "tgt", "vocab_size", "model_type", "character_coverage"),
        *("input_sentence_size", "encoding_errors"),
    )

    out = Path(out_dir)
    refuse_overwriting(
        [p for paths in inputs.values() for p in paths],
        [text_path(out, split, lang) for split in inputs for lang in (src, tgt)],
        out,
    )

    def write(old: dict[str, Any] | None) -> dict[str, Any]:
        for split in ("valid", "test"):
            if split in inputs and _same_files(inputs[split], inputs["train"]):
                say(
                    f"warning: the {split} split reads the training files: its scores will "
                    "not tell how the model does on text it has not seen"
                )
        with staging_dir(out, [p for paths in inputs.values() for p in paths]) as staging:
            stats: dict[str, _SplitStats] = {}
            for split, (src_path, tgt_path) in inputs.items():
                say(f"reading {split}: {src_path}, {tgt_path}")
                meter = say.meter(f"reading {split}", line_counts[split])
                stats[split] = _clean_split(
                    src_path, tgt_path, staging, split, src, tgt, encoding_errors, meter
                )
                meter.finish()
            for split, split_stats in stats.items():
                if split_stats.pairs and split_stats.same * 2 > split_stats.pairs:
                    src_path, tgt_path = inputs[split]
                    say(
                        f"warning: {split_stats.same:,} of the {split_stats.pairs:,} {split} "
                        f"pairs are the same text on both sides: are {src_path} and "
                        f"{tgt_path} in one language?"
                    )
                if split_stats.pairs == 0:  # a valid or test split scores nothing: refused too
                    src_path, tgt_path = inputs[split]
                    what = "training pairs" if split == "train" else f"{split} pairs"
                    raise UserError(
                        f"{src_path}, {tgt_path}: no {what} left after dropping empty lines"
                    )

            origin = None
            if given is not None:
                origin = tokenizer_source or str(given.resolve())
                say(f"using the tokenizer of {origin}")
                shutil.copyfile(given, staging / TOKENIZER_NAME)
                vocab = Tokenizer.load(staging / TOKENIZER_NAME)
                tokenizer_key = str(options["tokenizer"])
            else:
                # The vocabulary depends on the cleaned training text and the options, not on where
                # the files are or when they were written: a copy or a rewrite of the same text
                # reuses it.
                train_text = [_staged_text(staging, "train", lang) for lang in (src, tgt)]
                tokenizer_key = digest(
                    {
                        "train_text": content_digest(train_text),
                        **{k: options[k] for k in vocab_keys},
                    }
                )
                vocab = staged_tokenizer(
                    staging,
                    reusable_tokenizer(out, old, tokenizer_key) if not force else None,
                    f"training a joint {model_type} vocabulary of {vocab_size:,} "
                    f"on train.{src}+{tgt}",
                    lambda prefix: train_tokenizer(
                        train_text,
                        vocab_size,
                        prefix,
                        model_type,
                        character_coverage=character_coverage,
                        input_sentence_size=input_sentence_size,
                        source=" and ".join(str(p) for p in inputs["train"]),
                    ),
                    say,
                )
            dtype = ids_dtype(max(vocab.vocab_size, vocab.target_vocab_size))

            for split in inputs:
                meter = say.meter(f"encoding {split}", stats[split].pairs)
                limits = (max_len, max_len_ratio) if split == "train" else None
                _encode_split(vocab, staging, split, src, tgt, dtype, limits, stats[split], meter)
                meter.finish()
                if split == "train" and stats[split].pairs == 0:
                    raise UserError(
                        f"every training pair was dropped by the length limits (max_len={max_len}, "
                        f"max_len_ratio={max_len_ratio})"
                    )

            manifest = _manifest(
                options, inputs, stats, vocab, origin, dtype, fingerprint, tokenizer_key, staging
            )
            commit(staging, out, manifest, old)
        return manifest

    return reuse_or_write(out, fingerprint, force, say, write)


def _same_files(paths: tuple[Path, Path], others: tuple[Path, Path]) -> bool:
    """Whether the two pairs of input files are the same files (by path or by inode)."""
    try:
        return all(a.samefile(b) for a, b in zip(paths, others, strict=True))
    except OSError:
        return False


# -- pass 1: read, check, clean ---------------------------------------------------------------


def _clean_split(
    src_path: Path,
    tgt_path: Path,
    staging: Path,
    split: str,
    src: str,
    tgt: str,
    errors: EncodingErrors,
    meter: Meter,
) -> _SplitStats:
    stats = _SplitStats()
    with (
        open_input(src_path) as src_in,
        open_input(tgt_path) as tgt_in,
        _staged_text(staging, split, src).open("w", encoding="utf-8", newline="\n") as src_out,
        _staged_text(staging, split, tgt).open("w", encoding="utf-8", newline="\n") as tgt_out,
    ):
        for line_no, (raw_src, raw_tgt) in enumerate(zip(src_in, tgt_in, strict=False), start=1):
            src_text, bad_src = decode_line(raw_src, src_path, line_no, errors)
            tgt_text, bad_tgt = decode_line(raw_tgt, tgt_path, line_no, errors)
            stats.replaced["src"] += bad_src
            stats.replaced["tgt"] += bad_tgt
            src_text = src_text.translate(LINE_BREAKS).strip()
            tgt_text = tgt_text.translate(LINE_BREAKS).strip()
            stats.lines += 1
            if line_no % 10_000 == 0:
                meter.advance(10_000)
            if not src_text or not tgt_text:
                stats.dropped["empty"] += 1
                continue
            src_out.write(src_text + "\n")
            tgt_out.write(tgt_text + "\n")
            stats.pairs += 1
            stats.same += src_text == tgt_text
        # The line counts were compared up front; a file that changed since is caught here.
        if src_in.readline() or tgt_in.readline():
            raise UserError(f"{src_path} and {tgt_path} changed while being read")
    meter.advance(stats.lines % 10_000)
    return stats


def _staged_text(staging: Path, split: str, lang: str) -> Path:
    return staging / f"{split}.{lang}.clean"


# -- pass 3: encode ---------------------------------------------------------------------------


def _encode_split(
    tokenizer: Tokenizer,
    staging: Path,
    split: str,
    src: str,
    tgt: str,
    dtype: np.dtype,
    limits: tuple[int, float] | None,
    stats: _SplitStats,
    meter: Meter,
) -> None:
    sides = {"src": src, "tgt": tgt}
    lengths: dict[str, list[np.ndarray]] = {"src": [], "tgt": []}
    kept = 0
    with contextlib.ExitStack() as stack:
        bins = {
            k: stack.enter_context(ids_paths(staging, split, v)[0].open("wb"))
            for k, v in sides.items()
        }
        texts = {
            k: stack.enter_context(
                text_path(staging, split, v).open("w", encoding="utf-8", newline="\n")
            )
            for k, v in sides.items()
        }
        for src_lines, tgt_lines in zip(
            line_chunks(_staged_text(staging, split, src)),
            line_chunks(_staged_text(staging, split, tgt)),
            strict=True,
        ):
            ids = {
                "src": tokenizer.encode_batch(src_lines),
                "tgt": tokenizer.encode_target_batch(tgt_lines),
            }
            lens = {
                k: np.fromiter(map(len, v), dtype=np.int64, count=len(v)) for k, v in ids.items()
            }
            keep = np.ones(len(src_lines), dtype=bool)
            if limits is not None:
                max_len, max_ratio = limits
                too_long = (lens["src"] > max_len) | (lens["tgt"] > max_len)
                keep &= ~too_long
                stats.dropped["too_long"] += int(too_long.sum())
                if max_ratio > 0:
                    longer = np.maximum(lens["src"], lens["tgt"])
                    shorter = np.maximum(np.minimum(lens["src"], lens["tgt"]), 1)
                    bad_ratio = keep & (longer > max_ratio * shorter)
                    keep &= ~bad_ratio
                    stats.dropped["length_ratio"] += int(bad_ratio.sum())
            rows = np.flatnonzero(keep).tolist()
            lines = {"src": src_lines, "tgt": tgt_lines}
            for side in sides:
                kept_lens = write_ids([ids[side][r] for r in rows], dtype, bins[side])
                lengths[side].append(kept_lens)
                texts[side].writelines(lines[side][r] + "\n" for r in rows)
                stats.tokens[side] += int(kept_lens.sum())
                stats.longest[side] = max(stats.longest[side], int(kept_lens.max(initial=0)))
            kept += len(rows)
            meter.advance(len(src_lines))
    stats.pairs = kept
    for side, lang in sides.items():
        write_offsets(staging, split, lang, lengths[side])
        _staged_text(staging, split, lang).unlink()


# -- manifest ----------------------------------------------------------------------------------


def _manifest(
    options: dict[str, Any],
    inputs: dict[str, tuple[Path, Path]],
    stats: dict[str, _SplitStats],
    tokenizer: Tokenizer,
    origin: str | None,
    dtype: np.dtype,
    fingerprint: str,
    tokenizer_key: str,
    staging: Path,
) -> dict[str, Any]:
    src, tgt = options["src"], options["tgt"]
    splits: dict[str, Any] = {}
    for split, (src_path, tgt_path) in inputs.items():
        s = stats[split]
        splits[split] = {
            "pairs": s.pairs,
            "input_lines": s.lines,
            "inputs": {src: str(src_path.resolve()), tgt: str(tgt_path.resolve())},
            "tokens": {src: s.tokens["src"], tgt: s.tokens["tgt"]},
            "longest": {src: s.longest["src"], tgt: s.longest["tgt"]},
            "dropped": dict(s.dropped),
            "utf8_replaced_lines": {src: s.replaced["src"], tgt: s.replaced["tgt"]},
        }
    dropped_total = {
        reason: sum(stats[split].dropped[reason] for split in inputs)
        for reason in ("empty", "too_long", "length_ratio")
    }
    return {
        "format": "aiayn-data",
        "format_version": MANIFEST_FORMAT_VERSION,
        "aiayn_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "src": src,
        "tgt": tgt,
        "vocab_size": tokenizer.vocab_size,
        # Only for a tokenizer with a target vocabulary of its own (imported from Marian).
        **({} if tokenizer.shared else {"tgt_vocab_size": tokenizer.target_vocab_size}),
        "tokenizer": TOKENIZER_NAME,
        "tokenizer_options": {
            **(
                {"from": origin}
                if origin is not None
                else {
                    k: options[k]
                    for k in ("model_type", "character_coverage", "input_sentence_size")
                }
            ),
            "special_ids": {"pad": 0, "unk": 1, "bos": 2, "eos": 3},
        },
        "dtype": dtype.name,
        "filters": {
            "max_len": options["max_len"],
            "max_len_ratio": options["max_len_ratio"],
            "applied_to": ["train"],
        },
        "encoding_errors": options["encoding_errors"],
        "splits": splits,
        "dropped": dropped_total,
        "dropped_reasons": {
            "empty": "an empty or whitespace-only line on either side",
            "too_long": f"more than max_len={options['max_len']} tokens on a side (train only)",
            "length_ratio": (
                f"longer side over max_len_ratio={options['max_len_ratio']} times the shorter "
                "(train only)"
            ),
        },
        "files": {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()},
        "fingerprint": fingerprint,
        "tokenizer_key": tokenizer_key,
    }


# -- named corpora ----------------------------------------------------------------------------

CORPORA = ("bible", "multi30k", "wmt14")
_CORPUS_LANGS = {"bible": ("en", "es"), "multi30k": ("en", "de"), "wmt14": ("en", "de")}


def prepare_corpus(
    corpus: str,
    out_dir: str | Path,
    *,
    vocab_size: int = 8000,
    src: str | None = None,
    tgt: str | None = None,
    cache_dir: str | Path | None = None,
    sword_path: str | Path | list[str | Path] | None = None,
    download: bool = False,
    log: Log | Report | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Fetch (or extract) a named corpus and prepare it like :func:`prepare_data`.

    ``bible``: the embedded English-Spanish corpus from local SWORD modules (with ``download``,
    CrossWire's module zips are fetched into the cache when none are installed); its text goes
    to ``cache_dir/bible``. ``multi30k`` and ``wmt14`` are downloaded into ``cache_dir``
    (default :func:`aiayn.data.sources.download.default_cache_dir`). ``src``/``tgt`` default to
    the corpus's own pair (en-es, en-de) and may be swapped to translate the other way.
    """
    if corpus not in CORPORA:
        raise UserError(f"unknown corpus {corpus!r}; choose one of {', '.join(CORPORA)}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    default_src, default_tgt = _CORPUS_LANGS[corpus]
    src, tgt = src or default_src, tgt or default_tgt
    if corpus == "bible":
        if {src, tgt} != set(bible.BIBLE_LANGS):
            raise UserError("the Bible corpus is English-Spanish: --src/--tgt must be en and es")
        prefixes = bible.bible_corpus(cache, sword_path, download, log)
    elif corpus == "multi30k":
        prefixes = multi30k.download_multi30k(cache, src, tgt, log=log)
    else:
        if {src, tgt} != {"en", "de"}:
            raise UserError("WMT14 here is English-German: --src/--tgt must be en and de")
        prefixes = wmt14.download_wmt14(cache, log=log)
    return prepare_data(
        prefixes["train"],
        prefixes["valid"],
        prefixes.get("test"),
        src,
        tgt,
        vocab_size,
        out_dir,
        log=log,
        **options,
    )
