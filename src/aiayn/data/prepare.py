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
directory that :func:`aiayn.data.corpus.load_manifest` accepts with half-written data.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain, islice
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from aiayn import __version__
from aiayn.config import DataConfig
from aiayn.data.corpus import (
    MANIFEST_FORMAT_VERSION,
    MANIFEST_NAME,
    TOKENIZER_NAME,
    ids_dtype,
    ids_paths,
    load_manifest,
    manifest_path,
    text_path,
)
from aiayn.data.sources import bible, multi30k, wmt14
from aiayn.data.sources.download import default_cache_dir
from aiayn.data.tokenizer import (
    DEFAULT_CHARACTER_COVERAGE,
    DEFAULT_INPUT_SENTENCE_SIZE,
    Tokenizer,
    train_tokenizer,
)
from aiayn.errors import UserError
from aiayn.lock import PREPARE_LOCK_NAME, prepare_lock
from aiayn.progress import Log, Meter, Report, as_report

EncodingErrors = Literal["strict", "replace"]

_CHUNK_LINES = 20_000
_STAGING_PREFIX = ".prepare-"
# Characters Python's str.splitlines() treats as line ends: inside a sentence they would break
# the one-sentence-per-line text files for any reader that splits that way.
_LINE_BREAKS = str.maketrans(dict.fromkeys("\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029", " "))


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


def count_lines(path: Path) -> int:
    """Lines as ``for line in file`` sees them: a last line without a newline counts too."""
    count = 0
    last = b"\n"
    with _open_input(path) as handle:
        while block := handle.read(1 << 22):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


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
                f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}: the two sides of "
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
        options["tokenizer"] = _content_digest([given])
    stamps = {split: [_file_stamp(p) for p in paths] for split, paths in inputs.items()}
    fingerprint = _digest({"format_version": MANIFEST_FORMAT_VERSION, **options, "in": stamps})
    vocab_keys = (
        *("src", "tgt", "vocab_size", "model_type", "character_coverage"),
        *("input_sentence_size", "encoding_errors"),
    )

    out = Path(out_dir)
    _refuse_overwriting(
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
        with _staging_dir(out) as staging:
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
                tokenizer_key = _digest(
                    {
                        "train_text": _content_digest(train_text),
                        **{k: options[k] for k in vocab_keys},
                    }
                )
                vocab = _staged_tokenizer(
                    staging,
                    _reusable_tokenizer(out, old, tokenizer_key) if not force else None,
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
            _commit(staging, out, manifest, old)
        return manifest

    return _prepared(out, fingerprint, force, say, write)


def _same_files(paths: tuple[Path, Path], others: tuple[Path, Path]) -> bool:
    """Whether the two pairs of input files are the same files (by path or by inode)."""
    try:
        return all(a.samefile(b) for a, b in zip(paths, others, strict=True))
    except OSError:
        return False


def _refuse_overwriting(inputs: list[Path], outputs: list[Path], out: Path) -> None:
    """A :class:`UserError` when an input file is one that preparing ``out`` writes."""
    written = {path.resolve() for path in outputs}
    for path in inputs:
        if path.resolve() in written:
            raise UserError(f"{path}: an input file inside --out {out} would be overwritten")


def _prepared(
    out: Path,
    fingerprint: str,
    force: bool,
    say: Report,
    write: Callable[[dict[str, Any] | None], dict[str, Any]],
) -> dict[str, Any]:
    """``out``'s manifest where it holds complete data of the same inputs and options (unless
    ``force``), else the manifest ``write(old manifest or None)`` commits there, with ``out``
    held against other prepares. Checked before the lock (a directory that needs no work may
    be read-only) and again under it (another prepare may have just written it)."""
    if not force and (done := _reusable(out, fingerprint, say)) is not None:
        return done
    with _held(out):
        if not force and (done := _reusable(out, fingerprint, say)) is not None:
            return done
        return write(_existing_manifest(out))


def _reusable(out: Path, fingerprint: str, say: Report) -> dict[str, Any] | None:
    """``out``'s manifest where it holds complete data of the same inputs and options (said
    so), else None."""
    old = _existing_manifest(out)
    if old is None or not _up_to_date(out, old, fingerprint):
        return None
    say(f"{out}: up to date (same inputs and options), reusing it")
    return old


def _up_to_date(out: Path, old: dict[str, Any], fingerprint: str) -> bool:
    """Whether ``out`` holds complete data (manifest ``old``) of the same inputs and options."""
    return old.get("fingerprint") == fingerprint and _files_intact(out, old)


@contextlib.contextmanager
def _held(out: Path) -> Iterator[None]:
    """``out`` (created when missing) held against other prepares for the block: one at a
    time, so that no staging directory found there belongs to a live run. Where the block
    fails in a directory it created, the directory goes (its lock file first, still held)."""
    created = not out.exists()
    _make_dir(out)
    with prepare_lock(out):
        try:
            yield
        except BaseException:
            if created and [p.name for p in out.iterdir()] == [PREPARE_LOCK_NAME]:
                with contextlib.suppress(OSError):
                    (out / PREPARE_LOCK_NAME).unlink()
                    out.rmdir()
            raise


@contextlib.contextmanager
def _staging_dir(out: Path) -> Iterator[Path]:
    """A fresh staging directory inside ``out``, removed afterwards.

    Stale ones of killed runs go first; an ``OSError`` inside (disk full, permissions changed
    under us, ...) becomes a :class:`UserError` naming the file.
    """
    _remove_stale_staging(out)
    try:
        staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=out))
    except OSError as err:
        raise UserError(f"{out}: output directory is not writable ({err.strerror})") from None
    try:
        yield staging
    except OSError as err:
        where = err.filename or out
        raise UserError(f"{where}: {err.strerror or err} while preparing {out}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _reusable_tokenizer(out: Path, old: dict[str, Any] | None, key: str) -> Path | None:
    """The existing tokenizer of ``out`` when it was trained with the same text and options."""
    path = out / TOKENIZER_NAME
    if old is not None and old.get("tokenizer_key") == key and path.is_file():
        return path
    return None


def _staged_tokenizer(
    staging: Path,
    reusable: Path | None,
    training: str,
    train: Callable[[Path], Tokenizer],
    say: Report,
) -> Tokenizer:
    """``staging/spm.model``: a copy of ``reusable`` when there is one, else trained by
    ``train(model_prefix)`` (after saying ``training``); sentencepiece's ``.vocab`` is left out.
    """
    model_file = staging / TOKENIZER_NAME
    if reusable is not None:
        say(f"reusing {reusable} (same training text and vocabulary options)")
        shutil.copyfile(reusable, model_file)
        return Tokenizer.load(model_file)
    with say.stage(training):
        tokenizer = train(staging / model_file.stem)
    with contextlib.suppress(FileNotFoundError):
        (staging / (model_file.stem + ".vocab")).unlink()
    return tokenizer


# -- pass 1: read, check, clean ---------------------------------------------------------------


def _open_input(path: Path) -> BinaryIO:
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected a text file") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror})") from None
    start = handle.peek(4)[:4]
    if start[:2] == _GZIP_MAGIC:
        handle.close()
        raise UserError(f"{path}: the file is gzip-compressed: decompress it first (gunzip)")
    # UTF-32's marks first: UTF-32LE's starts with UTF-16LE's.
    wide = next((name for name, mark in _WIDE_MARKS if start.startswith(mark)), None)
    if wide is not None:
        handle.close()
        raise UserError(
            f"{path}: the file is {wide} text (it starts with that byte order mark); convert "
            f"it to UTF-8 first (iconv -f {wide} -t UTF-8)"
        )
    return handle


def _decode(raw: bytes, path: Path, line_no: int, errors: EncodingErrors) -> tuple[str, bool]:
    """One line as text; ``(text, replaced)``. A byte order mark that starts the file is
    dropped. Strict mode names file, line and column of bytes that are not UTF-8 and of a
    NUL (a binary file?); ``replace`` mode makes each a U+FFFD."""
    try:
        text, replaced = raw.decode("utf-8"), False
    except UnicodeDecodeError as err:
        if errors == "strict":
            raise UserError(
                f"{path}, line {line_no}: invalid UTF-8 (byte 0x{raw[err.start]:02x} at byte "
                f"{err.start + 1} of the line); fix the file or pass --encoding-errors replace"
            ) from None
        text, replaced = raw.decode("utf-8", errors="replace"), True
    if line_no == 1:
        text = text.removeprefix("\ufeff")
    if "\x00" in text:
        if errors == "strict":
            raise UserError(
                f"{path}, line {line_no}: a NUL byte (at byte {raw.index(0) + 1} of the line): "
                "is it a text file? Fix it or pass --encoding-errors replace"
            )
        text, replaced = text.replace("\x00", "\ufffd"), True
    return text, replaced


_GZIP_MAGIC = b"\x1f\x8b"
_WIDE_MARKS = (
    ("UTF-32", b"\xff\xfe\x00\x00"),
    ("UTF-32", b"\x00\x00\xfe\xff"),
    ("UTF-16", b"\xff\xfe"),
    ("UTF-16", b"\xfe\xff"),
)


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
        _open_input(src_path) as src_in,
        _open_input(tgt_path) as tgt_in,
        _staged_text(staging, split, src).open("w", encoding="utf-8", newline="\n") as src_out,
        _staged_text(staging, split, tgt).open("w", encoding="utf-8", newline="\n") as tgt_out,
    ):
        for line_no, (raw_src, raw_tgt) in enumerate(zip(src_in, tgt_in, strict=False), start=1):
            src_text, bad_src = _decode(raw_src, src_path, line_no, errors)
            tgt_text, bad_tgt = _decode(raw_tgt, tgt_path, line_no, errors)
            stats.replaced["src"] += bad_src
            stats.replaced["tgt"] += bad_tgt
            src_text = src_text.translate(_LINE_BREAKS).strip()
            tgt_text = tgt_text.translate(_LINE_BREAKS).strip()
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


def _chunks(path: Path) -> Iterator[list[str]]:
    with path.open(encoding="utf-8", newline="\n") as handle:
        while chunk := list(islice(handle, _CHUNK_LINES)):
            yield [line[:-1] if line.endswith("\n") else line for line in chunk]


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
            _chunks(_staged_text(staging, split, src)),
            _chunks(_staged_text(staging, split, tgt)),
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
                kept_lens = _write_ids([ids[side][r] for r in rows], dtype, bins[side])
                lengths[side].append(kept_lens)
                texts[side].writelines(lines[side][r] + "\n" for r in rows)
                stats.tokens[side] += int(kept_lens.sum())
                stats.longest[side] = max(stats.longest[side], int(kept_lens.max(initial=0)))
            kept += len(rows)
            meter.advance(len(src_lines))
    stats.pairs = kept
    for side, lang in sides.items():
        _write_offsets(staging, split, lang, lengths[side])
        _staged_text(staging, split, lang).unlink()


def _write_ids(ids: list[list[int]], dtype: np.dtype, out: BinaryIO) -> np.ndarray:
    """Append the sentences' ids back to back to a ``.bin`` file; returns their lengths."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    flat.tofile(out)
    return lengths


def _write_offsets(directory: Path, split: str, lang: str, lengths: list[np.ndarray]) -> None:
    """``.idx.npy`` (int64 offsets) and ``.len.npy`` (int32) of sentences of these lengths."""
    all_lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.zeros(len(all_lens) + 1, dtype=np.int64)
    np.cumsum(all_lens, out=offsets[1:])
    _, idx_path, len_path = ids_paths(directory, split, lang)
    np.save(idx_path, offsets)
    np.save(len_path, all_lens.astype(np.int32))


# -- manifest and commit ----------------------------------------------------------------------


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


def _commit(staging: Path, out: Path, manifest: dict[str, Any], old: dict[str, Any] | None) -> None:
    """Move the staged files into ``out``; the manifest goes last, and goes first when removed."""
    manifest_file = manifest_path(out)
    with contextlib.suppress(FileNotFoundError):
        manifest_file.unlink()
    for name in manifest["files"]:
        os.replace(staging / name, out / name)
    for name in (old or {}).get("files", {}):
        if name not in manifest["files"] and name != MANIFEST_NAME:
            with contextlib.suppress(OSError):
                (out / name).unlink()
    tmp = staging / MANIFEST_NAME
    tmp.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, manifest_file)


def _existing_manifest(out: Path) -> dict[str, Any] | None:
    if not manifest_path(out).is_file():
        return None
    try:
        return load_manifest(out)
    except UserError:
        return None


def _files_intact(out: Path, manifest: dict[str, Any]) -> bool:
    files = manifest.get("files", {})
    try:
        return bool(files) and all((out / n).stat().st_size == size for n, size in files.items())
    except OSError:
        return False


def _make_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{out}: exists and is not a directory") from None
    except OSError as err:
        raise UserError(f"{out}: cannot create the output directory ({err.strerror})") from None
    if not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory")


def _remove_stale_staging(out: Path) -> None:
    """Staging directories of runs that were killed before they could clean up."""
    for path in out.glob(_STAGING_PREFIX + "*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def _file_stamp(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _content_digest(paths: list[Path]) -> str:
    """SHA-256 of the files' bytes, in order (each file's length included)."""
    sha = hashlib.sha256()
    for path in paths:
        sha.update(path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                sha.update(chunk)
    return sha.hexdigest()


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]


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
