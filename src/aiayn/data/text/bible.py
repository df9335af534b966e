"""The embedded Bible corpus as text-task data: the English or Spanish verses of
:func:`aiayn.data.sources.bible.write_bible_corpus`, regrouped.

* ``lm``: held-out books (:data:`~aiayn.data.sources.bible_text.LM_VALID_BOOKS` and
  ``LM_TEST_BOOKS``) are valid and test, every other book is train: the perplexity is that
  of text the model has never seen a verse of.
* ``classify``: every verse labelled with its genre (law, history, wisdom, prophets, gospels,
  epistles, apocalyptic) or its book; split by chapter, about 5% of each book's chapters to
  valid and 5% to test, so that neighbouring verses never straddle train and test.

The verses are written in canonical order to ``CACHE/bible-text/{task}[-{label}]-{lang}/`` and
rewritten only when their text changes, so that an unchanged corpus reuses DATA_DIR.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiayn.data.corpus import read_lines
from aiayn.data.sources.bible import BIBLE_LANGS, bible_corpus
from aiayn.data.sources.bible_text import (
    BIBLE_BOOKS,
    BIBLE_GENRES,
    LM_TEST_BOOKS,
    LM_VALID_BOOKS,
    book_genre,
    book_split,
    canonical_order,
    chapter_splits,
    ref_book,
)
from aiayn.data.sources.download import atomic_write_from, default_cache_dir
from aiayn.data.text.corpus import TEXT_TASKS
from aiayn.data.text.prepare import prepare_text
from aiayn.errors import UserError
from aiayn.progress import Log

BIBLE_LABELS = ("genre", "book")
_SPLITS = ("train", "valid", "test")


def prepare_bible_text(
    out_dir: str | Path,
    task: str,
    *,
    lang: str = "en",
    label: str = "genre",
    vocab_size: int = 8000,
    sword_path: str | Path | Sequence[str | Path] | None = None,
    download: bool = False,
    cache_dir: str | Path | None = None,
    log: Log | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Prepare DATA_DIR for ``task`` ("lm" or "classify") from the Bible's ``lang`` text.

    ``label`` (classify): "genre" (seven classes, in :data:`BIBLE_GENRES` order) or "book" (66
    classes, OSIS ids in canonical order). ``sword_path``, ``download`` and ``cache_dir`` are
    those of :func:`aiayn.data.prepare.prepare_corpus`; ``options`` go to
    :func:`aiayn.data.text.prepare.prepare_text` (e.g. ``tokenizer``, ``force``).
    """
    if task not in TEXT_TASKS:
        raise UserError(f"unknown text task {task!r}; choose one of {', '.join(TEXT_TASKS)}")
    if lang not in BIBLE_LANGS:
        raise UserError(f"the Bible corpus has {' and '.join(BIBLE_LANGS)} text, not {lang!r}")
    if label not in BIBLE_LABELS:
        raise UserError(f"unknown Bible label {label!r}; choose one of {', '.join(BIBLE_LABELS)}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    prefixes = bible_corpus(cache, sword_path, download, log)
    verses = bible_verses(prefixes, lang)
    refs = [ref for ref, _ in verses]
    if task == "lm":
        _check_books(refs, (*LM_VALID_BOOKS, *LM_TEST_BOOKS))
        name, suffix, labels = f"lm-{lang}", "txt", None
        splits = [book_split(ref) for ref in refs]
        texts = [text for _, text in verses]
    else:
        name, suffix = f"classify-{label}-{lang}", "tsv"
        labels = BIBLE_GENRES if label == "genre" else BIBLE_BOOKS
        splits = chapter_splits(refs)
        books = [ref_book(ref) for ref in refs]
        classes = [book_genre(book) for book in books] if label == "genre" else books
        texts = [f"{c}\t{text}" for c, (_, text) in zip(classes, verses, strict=True)]
    lines: dict[str, list[str]] = {split: [] for split in _SPLITS}
    for split, text in zip(splits, texts, strict=True):
        lines[split].append(text)
    files = {split: cache / "bible-text" / name / f"{split}.{suffix}" for split in _SPLITS}
    for split, path in files.items():
        _write_if_changed(path, "".join(line + "\n" for line in lines[split]))
    return prepare_text(
        task,
        files["train"],
        files["valid"],
        files["test"],
        out_dir,
        vocab_size,
        labels=labels,
        log=log,
        **options,
    )


def bible_verses(prefixes: dict[str, Path], lang: str) -> list[tuple[str, str]]:
    """(reference, text) of every verse in the corpus files of all splits, in canonical order."""
    verses: list[tuple[str, str]] = []
    for split in _SPLITS:
        refs = read_lines(Path(f"{prefixes[split]}.ref"))
        texts = read_lines(Path(f"{prefixes[split]}.{lang}"))
        if len(refs) != len(texts):
            raise UserError(
                f"{prefixes[split]}.ref and .{lang} differ in length; delete "
                f"{Path(prefixes[split]).parent} to extract the corpus again"
            )
        verses += zip(refs, texts, strict=True)
    return sorted(verses, key=lambda verse: canonical_order(verse[0]))


def _check_books(refs: list[str], books: Sequence[str]) -> None:
    present = {ref_book(ref) for ref in refs}
    if missing := [book for book in books if book not in present]:
        raise UserError(f"the Bible corpus has no verses of the held-out books {missing}")


def _write_if_changed(path: Path, text: str) -> None:
    data = text.encode("utf-8")
    try:
        if path.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    try:
        atomic_write_from(path, lambda out: out.write(data))
    except OSError as err:
        raise UserError(f"{path}: cannot write ({err.strerror or err})") from None
