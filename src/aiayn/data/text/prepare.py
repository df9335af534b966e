"""``aiayn prepare --task lm|classify`` as a library function: text in, a binarised DATA_DIR
out (the layout: :mod:`aiayn.data.text`).

The passes and guarantees of translation's :func:`aiayn.data.prepare.prepare_data`, on one
text per line instead of a pair: every split is read and checked (strict UTF-8, file and line
in every error) before any work; a sentencepiece model with ``<mask>`` at ``MASK_ID`` is
trained on the kept training text (or reused: the one already there when the text and options
are the same, or a given one); each split is encoded into flat memory-mapped ids. Everything
is written into a staging directory and moved into place with the manifest last; the same
inputs and options reuse the directory as it is. What the two share: the reading of
:mod:`aiayn.data.raw_text`, the staging and reuse of :mod:`aiayn.data.staging` and the id
files of :mod:`aiayn.data.binarise`.
"""

from __future__ import annotations

import datetime
import shutil
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aiayn import __version__
from aiayn.data.binarise import line_chunks, write_ids, write_offsets
from aiayn.data.collate import BOS_ID, EOS_ID, MASK_ID, PAD_ID, UNK_ID
from aiayn.data.corpus import (
    MANIFEST_FORMAT_VERSION,
    TOKENIZER_NAME,
    ids_dtype,
    ids_paths,
    text_path,
)
from aiayn.data.raw_text import LINE_BREAKS, EncodingErrors, decode_line, open_input
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
from aiayn.data.text.corpus import TEXT_SUFFIX, TEXT_TASKS, labels_path
from aiayn.data.tokenizer import (
    DEFAULT_CHARACTER_COVERAGE,
    DEFAULT_INPUT_SENTENCE_SIZE,
    MASK_PIECE,
    Tokenizer,
    train_tokenizer,
)
from aiayn.errors import UserError
from aiayn.progress import Log, Meter, Report, as_report

SPECIAL_IDS = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID, "mask": MASK_ID}


@dataclass
class _SplitStats:
    input_lines: int = 0
    lines: int = 0
    empty: int = 0
    replaced: int = 0
    tokens: int = 0
    longest: int = 0
    # Classification: the class of every kept line, as an index into the label names (while
    # train is read without given names: into the names in the order they first appeared).
    labels: array[int] = field(default_factory=lambda: array("q"))


def prepare_text(
    task: str,
    train: str | Path,
    valid: str | Path,
    test: str | Path | None,
    out_dir: str | Path,
    vocab_size: int,
    *,
    labels: Sequence[str] | None = None,
    tokenizer: str | Path | None = None,
    tokenizer_source: str | None = None,
    model_type: str = "bpe",
    encoding_errors: EncodingErrors = "strict",
    character_coverage: float = DEFAULT_CHARACTER_COVERAGE,
    input_sentence_size: int = DEFAULT_INPUT_SENTENCE_SIZE,
    force: bool = False,
    log: Log | Report | None = None,
) -> dict[str, Any]:
    """Prepare DATA_DIR for a text task from one file per split; returns the manifest.

    ``task="lm"``: plain text, one document or sentence per line (for the lm and mlm tasks).
    ``task="classify"``: ``LABEL<TAB>TEXT`` per line; a line without a tab, with an empty label
    or an empty text is an error naming file and line. The classes are ``labels`` in that order
    when given (any other label is an error), else the labels of the training file, sorted
    (numerically when all are integers); a valid or test label that is not among them is an
    error naming file, line and label. Empty (or whitespace-only) lines are skipped and counted
    in both tasks; no line is dropped for its length (long texts are cut when batched).

    ``tokenizer``: an existing ``spm.model`` (of a pre-trained model or of another text DATA_DIR)
    to use instead of training one; it must carry ``<mask>`` at ``MASK_ID``, and ``vocab_size``
    and the vocabulary options are then ignored; ``tokenizer_source`` names where it came from in
    the manifest (default: the file). With the same inputs (path, size, modification
    time) and options the existing directory is reused as it is, unless ``force``.
    """
    say = as_report(log)
    if task not in TEXT_TASKS:
        raise UserError(f"unknown text task {task!r}; choose one of {', '.join(TEXT_TASKS)}")
    if encoding_errors not in ("strict", "replace"):
        raise UserError(f"encoding_errors must be 'strict' or 'replace', got {encoding_errors!r}")
    names = None if labels is None else _check_label_names(labels, task)
    files = {"train": Path(train), "valid": Path(valid)}
    if test is not None:
        files["test"] = Path(test)
    for path in files.values():  # every input is checked before any work
        open_input(path).close()

    given = None if tokenizer is None else Path(tokenizer)
    if given is not None:
        _check_text_tokenizer(Tokenizer.load(given), tokenizer_source or given)
        vocab_options: dict[str, Any] = {"tokenizer": content_digest([given])}
    else:
        vocab_options = {
            "vocab_size": vocab_size,
            "model_type": model_type,
            "character_coverage": character_coverage,
            "input_sentence_size": input_sentence_size,
        }
    options = {"task": task, "labels": names, "encoding_errors": encoding_errors, **vocab_options}
    stamps = {split: file_stamp(path) for split, path in files.items()}
    fingerprint = digest(
        {"format_version": MANIFEST_FORMAT_VERSION, "kind": "text", **options, "in": stamps}
    )

    out = Path(out_dir)
    refuse_overwriting(
        list(files.values()), [text_path(out, split, TEXT_SUFFIX) for split in files], out
    )

    def write(old: dict[str, Any] | None) -> dict[str, Any]:
        with staging_dir(out, list(files.values())) as staging:
            stats, classes = _read_splits(task, files, staging, names, encoding_errors, say)
            vocab, tokenizer_key = _staged_text_tokenizer(
                staging,
                given,
                vocab_options,
                encoding_errors,
                (out, None if force else old),
                files["train"],
                say,
            )
            dtype = ids_dtype(vocab.vocab_size)
            for split, split_stats in stats.items():
                meter = say.meter(f"encoding {split}", split_stats.lines)
                _encode_split(vocab, staging, split, dtype, split_stats, meter)
                meter.finish()
                if classes is not None:
                    np.save(
                        labels_path(staging, split), np.frombuffer(split_stats.labels, np.int64)
                    )

            manifest = {
                "format": "aiayn-data",
                "format_version": MANIFEST_FORMAT_VERSION,
                "kind": "text",
                "task": task,
                "aiayn_version": __version__,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"
                ),
                "vocab_size": vocab.vocab_size,
                "tokenizer": TOKENIZER_NAME,
                "tokenizer_options": {
                    **(
                        {"from": tokenizer_source or str(given.resolve())}
                        if given is not None
                        else {k: v for k, v in vocab_options.items() if k != "vocab_size"}
                    ),
                    "special_ids": SPECIAL_IDS,
                },
                "dtype": dtype.name,
                "encoding_errors": encoding_errors,
                **({"labels": classes} if classes is not None else {}),
                "splits": {
                    split: _split_manifest(files[split], s, classes) for split, s in stats.items()
                },
                "dropped_reasons": {"empty": "an empty or whitespace-only line"},
                "files": {
                    p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()
                },
                "fingerprint": fingerprint,
                "tokenizer_key": tokenizer_key,
            }
            commit(staging, out, manifest, old)
        return manifest

    return reuse_or_write(out, fingerprint, force, say, write)


def _check_label_names(labels: Sequence[str], task: str) -> list[str]:
    if task != "classify":
        raise UserError(f"label names go with the classify task, not {task}")
    names = [str(name) for name in labels]
    if not names or any(name != name.strip() or not name or "\t" in name for name in names):
        raise UserError(f"label names must be non-empty, without tabs or outer spaces: {names}")
    if len(set(names)) != len(names):
        raise UserError(f"label names must be distinct: {names}")
    if len(names) < 2:
        raise UserError(f"a classifier needs two label names or more, got {names}")
    return names


def _check_text_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    if not tokenizer.has_mask:
        raise UserError(
            f"{path}: this tokenizer has no {MASK_PIECE} at id {MASK_ID} (a translation "
            "tokenizer?); the text tasks need the spm.model of a model or data directory "
            "prepared with --task lm or --task classify, or none, to train one"
        )


def _staged_text_tokenizer(
    staging: Path,
    given: Path | None,
    vocab_options: dict[str, Any],
    encoding_errors: EncodingErrors,
    previous: tuple[Path, dict[str, Any] | None],
    source: Path,
    say: Report,
) -> tuple[Tokenizer, str]:
    """``staging/spm.model`` and its key: a copy of ``given``; else the one of the previous
    DATA_DIR and manifest when it was trained on the same text with the same options; else one
    trained on ``staging/train.txt`` (read from ``source``) with ``vocab_options``."""
    if given is not None:
        say(f"using the tokenizer {given}")
        shutil.copyfile(given, staging / TOKENIZER_NAME)
        return Tokenizer.load(staging / TOKENIZER_NAME), digest(vocab_options)
    # As for translation: the vocabulary depends on the kept training text and the options,
    # so a copy or a rewrite of the same text reuses it.
    train_text = text_path(staging, "train", TEXT_SUFFIX)
    key = digest(
        {
            "train_text": content_digest([train_text]),
            "symbols": [MASK_PIECE],
            "encoding_errors": encoding_errors,
            **vocab_options,
        }
    )
    vocab_size, model_type = vocab_options["vocab_size"], vocab_options["model_type"]
    tokenizer = staged_tokenizer(
        staging,
        reusable_tokenizer(*previous, key),
        f"training a {model_type} vocabulary of {vocab_size:,} on {source}",
        lambda prefix: train_tokenizer(
            [train_text],
            vocab_size,
            prefix,
            model_type,
            character_coverage=vocab_options["character_coverage"],
            input_sentence_size=vocab_options["input_sentence_size"],
            source=str(source),
            user_defined_symbols=[MASK_PIECE],
        ),
        say,
    )
    return tokenizer, key


# -- pass 1: read, check, clean ---------------------------------------------------------------


@dataclass
class _Classes:
    """Class indices by label; labels not there yet are added in order of appearance, unless
    the classes are ``fixed`` (given, or those of the training data)."""

    index: dict[str, int]
    fixed: bool

    def of(self, label: str, path: Path, line_no: int) -> int:
        if label in self.index:
            return self.index[label]
        if self.fixed:
            shown = ", ".join(list(self.index)[:12]) + (", ..." if len(self.index) > 12 else "")
            raise UserError(
                f"{path}, line {line_no}: label {label!r} is not one of the {len(self.index)} "
                f"classes (those of the training data, or the given ones: {shown})"
            )
        self.index[label] = len(self.index)
        return self.index[label]


def _read_splits(
    task: str,
    files: dict[str, Path],
    staging: Path,
    names: list[str] | None,
    errors: EncodingErrors,
    say: Report,
) -> tuple[dict[str, _SplitStats], list[str] | None]:
    """Every split's kept text into ``staging/{split}.txt``, train first; returns the statistics
    and the class names (``names``, else those of the training data, sorted)."""
    stats: dict[str, _SplitStats] = {}
    classes = None
    if task == "classify":
        given = {} if names is None else {name: i for i, name in enumerate(names)}
        classes = _Classes(given, fixed=names is not None)
    for split, path in files.items():
        say(f"reading {split}: {path}")
        meter = say.meter(f"reading {split}", 0)
        stats[split] = _read_split(
            path, text_path(staging, split, TEXT_SUFFIX), classes, errors, meter
        )
        meter.finish()
        if stats[split].lines == 0:  # a valid or test split scores nothing: refused too
            what = "training lines" if split == "train" else f"{split} lines"
            raise UserError(f"{path}: no {what} left after skipping empty lines")
        if classes is not None and split == "train":
            if not classes.fixed:
                names = _sort_classes(classes, stats[split])
            seen = np.unique(np.frombuffer(stats[split].labels, np.int64))
            if len(seen) < 2:
                assert names is not None
                raise UserError(
                    f"{path}: every line has the label {names[int(seen[0])]!r}; a classifier "
                    "needs training lines of two classes or more"
                )
    return stats, names


def _read_split(
    path: Path, out_path: Path, classes: _Classes | None, errors: EncodingErrors, meter: Meter
) -> _SplitStats:
    """Read one split: plain lines, or ``LABEL<TAB>TEXT`` lines when there are ``classes``."""
    stats = _SplitStats()
    with open_input(path) as lines, out_path.open("w", encoding="utf-8", newline="\n") as out:
        for line_no, raw in enumerate(lines, start=1):
            line, replaced = decode_line(raw, path, line_no, errors)
            stats.input_lines += 1
            if line_no % 10_000 == 0:
                meter.advance(10_000)
            stats.replaced += replaced
            text = line.translate(LINE_BREAKS).strip()
            if not text:
                stats.empty += 1
                continue
            if classes is not None:  # the tab may be at either end of the stripped line
                label, text = _label_and_text(line.translate(LINE_BREAKS), path, line_no)
                stats.labels.append(classes.of(label, path, line_no))
            out.write(text + "\n")
            stats.lines += 1
    meter.advance(stats.input_lines % 10_000)
    return stats


def _label_and_text(line: str, path: Path, line_no: int) -> tuple[str, str]:
    label, tab, text = line.partition("\t")
    label, text = label.strip(), text.strip()
    if not tab:
        raise UserError(f"{path}, line {line_no}: no tab; a classify line is LABEL<TAB>TEXT")
    if not label:
        raise UserError(f"{path}, line {line_no}: empty label before the tab")
    if not text:
        raise UserError(f"{path}, line {line_no}: empty text after the label {label!r}")
    return label, text


def _sort_classes(classes: _Classes, train: _SplitStats) -> list[str]:
    """Sort the classes found in train (numerically when all labels are integers) and fix
    them; ``train.labels`` is re-indexed from order of appearance to that order."""
    seen = list(classes.index)
    try:
        names = sorted(seen, key=int)
    except ValueError:
        names = sorted(seen)
    classes.index = {name: i for i, name in enumerate(names)}
    classes.fixed = True
    remap = np.array([classes.index[name] for name in seen], dtype=np.int64)
    train.labels = array("q", remap[np.frombuffer(train.labels, np.int64)].tobytes())
    return names


# -- pass 3: encode ---------------------------------------------------------------------------


def _encode_split(
    tokenizer: Tokenizer,
    staging: Path,
    split: str,
    dtype: np.dtype,
    stats: _SplitStats,
    meter: Meter,
) -> None:
    lengths = []
    with ids_paths(staging, split, TEXT_SUFFIX)[0].open("wb") as ids_out:
        for lines in line_chunks(text_path(staging, split, TEXT_SUFFIX)):
            chunk_lengths = write_ids(tokenizer.encode_batch(lines), dtype, ids_out)
            lengths.append(chunk_lengths)
            stats.tokens += int(chunk_lengths.sum())
            stats.longest = max(stats.longest, int(chunk_lengths.max(initial=0)))
            meter.advance(len(lines))
    write_offsets(staging, split, TEXT_SUFFIX, lengths)


def _split_manifest(path: Path, stats: _SplitStats, names: list[str] | None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "lines": stats.lines,
        "input_lines": stats.input_lines,
        "input": str(path.resolve()),
        "tokens": stats.tokens,
        "longest": stats.longest,
        "dropped": {"empty": stats.empty},
        "utf8_replaced_lines": stats.replaced,
    }
    if names is not None:
        counts = np.bincount(np.frombuffer(stats.labels, np.int64), minlength=len(names))
        info["label_counts"] = dict(zip(names, counts.tolist(), strict=True))
    return info
