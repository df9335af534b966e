"""The Bible corpus's text, without I/O: OSIS markup cleaning, the length-based verse alignment
(Gale & Church, 1993), the fixed train/valid/test split by verse reference, and the books,
genres and splits of the text tasks (held-out books for the language model, chapters for
classification).

See ``docs/data.md`` for what each step does to the text.
"""

from __future__ import annotations

import hashlib
import html
import math
import re
from collections.abc import Sequence

# -- the split --------------------------------------------------------------------------------

# A verse belongs to valid when bucket < VALID_BUCKETS, to test when bucket < VALID + TEST,
# else to train; bucket = first 8 bytes of sha256("Gen.1.1") as an integer, mod 1000.
SPLIT_BUCKETS = 1000
VALID_BUCKETS = 32
TEST_BUCKETS = 32


def bible_split(ref: str) -> str:
    """The fixed split of a verse: "train", "valid" or "test", from its OSIS reference alone.

    A pair of joined verses ("Num.13.32+Num.13.33") goes where its first verse goes.
    """
    first = ref.split("+", 1)[0]
    bucket = int.from_bytes(hashlib.sha256(first.encode()).digest()[:8], "big") % SPLIT_BUCKETS
    if bucket < VALID_BUCKETS:
        return "valid"
    if bucket < VALID_BUCKETS + TEST_BUCKETS:
        return "test"
    return "train"


# -- books, genres and the splits of the text tasks -------------------------------------------

# The 66 books of the corpus in canonical order (OSIS ids).
BIBLE_BOOKS: tuple[str, ...] = (
    *("Gen", "Exod", "Lev", "Num", "Deut", "Josh", "Judg", "Ruth", "1Sam", "2Sam", "1Kgs"),
    *("2Kgs", "1Chr", "2Chr", "Ezra", "Neh", "Esth", "Job", "Ps", "Prov", "Eccl", "Song"),
    *("Isa", "Jer", "Lam", "Ezek", "Dan", "Hos", "Joel", "Amos", "Obad", "Jonah", "Mic"),
    *("Nah", "Hab", "Zeph", "Hag", "Zech", "Mal"),
    *("Matt", "Mark", "Luke", "John", "Acts", "Rom", "1Cor", "2Cor", "Gal", "Eph", "Phil"),
    *("Col", "1Thess", "2Thess", "1Tim", "2Tim", "Titus", "Phlm", "Heb", "Jas", "1Pet", "2Pet"),
    *("1John", "2John", "3John", "Jude", "Rev"),
)
# The genres, in this (class index) order, and the runs of books each one covers.
BIBLE_GENRES = ("law", "history", "wisdom", "prophets", "gospels", "epistles", "apocalyptic")
_GENRE_RUNS = (
    ("law", "Gen", "Deut"),
    ("history", "Josh", "Esth"),
    ("wisdom", "Job", "Song"),
    ("prophets", "Isa", "Mal"),
    ("gospels", "Matt", "John"),
    ("history", "Acts", "Acts"),
    ("epistles", "Rom", "Jude"),
    ("apocalyptic", "Rev", "Rev"),
)
_BOOK_GENRE = {
    book: genre
    for genre, first, last in _GENRE_RUNS
    for book in BIBLE_BOOKS[BIBLE_BOOKS.index(first) : BIBLE_BOOKS.index(last) + 1]
}
# The held-out books of the language-model task: a few of each part of the canon.
LM_VALID_BOOKS = ("Ruth", "Joel", "Jonah", "Phil", "2Pet")
LM_TEST_BOOKS = ("Esth", "Amos", "Col", "Jas", "Titus")
# The classification task holds out this share of the chapters of every book for valid, and as
# many for test (rounded to whole chapters: books of fewer than 10 chapters are all train).
CHAPTER_SHARE = 0.05


def ref_book(ref: str) -> str:
    """The OSIS book id of a reference: "Gen" for "Gen.1.1" (the first verse of a joined pair)."""
    book = ref.split(".", 1)[0]
    if book not in _BOOK_GENRE:
        raise ValueError(f"{ref!r}: unknown OSIS book {book!r}")
    return book


def book_genre(book: str) -> str:
    """The genre of an OSIS book id: one of :data:`BIBLE_GENRES`."""
    try:
        return _BOOK_GENRE[book]
    except KeyError:
        raise ValueError(f"unknown OSIS book {book!r}") from None


def canonical_order(ref: str) -> tuple[int, int, int]:
    """A sort key putting references in canonical order: (book, chapter, verse)."""
    book, chapter, verse = ref.split("+", 1)[0].split(".")
    return BIBLE_BOOKS.index(ref_book(book)), int(chapter), int(verse)


def book_split(ref: str) -> str:
    """The split of a verse in the language-model task: held-out books are valid and test."""
    book = ref_book(ref)
    if book in LM_VALID_BOOKS:
        return "valid"
    if book in LM_TEST_BOOKS:
        return "test"
    return "train"


def chapter_splits(refs: Sequence[str]) -> list[str]:
    """The split of each verse in the classification task, by chapter ("Gen.1", from the first
    verse of a joined pair): all verses of a chapter go together, so neighbouring verses never
    straddle train and test. Within each book the chapters are ranked by a hash of their id;
    the first ``round(CHAPTER_SHARE * chapters)`` are valid, as many more test, the rest train.
    So every genre is in every split, in about its share of the text."""
    chapters = [".".join(ref.split("+", 1)[0].split(".")[:2]) for ref in refs]
    by_book: dict[str, set[str]] = {}
    for chapter in chapters:
        by_book.setdefault(ref_book(chapter), set()).add(chapter)
    split_of: dict[str, str] = {}
    for book_chapters in by_book.values():
        held_out = int(CHAPTER_SHARE * len(book_chapters) + 0.5)
        ranked = sorted(book_chapters, key=lambda c: hashlib.sha256(c.encode()).digest())
        for rank, chapter in enumerate(ranked):
            split_of[chapter] = (
                "valid" if rank < held_out else "test" if rank < 2 * held_out else "train"
            )
    return [split_of[chapter] for chapter in chapters]


# -- markup -----------------------------------------------------------------------------------

# Elements dropped with their content: notes (footnotes, cross references) and what lives only
# inside them, speaker labels, and non-canonical headings (handled separately below).
_DROP_WITH_CONTENT: tuple[str, ...] = (
    *("note", "speaker", "catchWord", "rdg", "rdgGroup", "figure", "index"),
    *("scripRef", "scripCom"),  # ThML cross references and comments
)
_DROP_RE = re.compile(
    r"<(?P<tag>" + "|".join(_DROP_WITH_CONTENT) + r")\b[^>]*?(?:/>|>.*?</(?P=tag)\s*>)",
    re.DOTALL,
)
# Headings added by editors; titles marked canonical (Psalm superscriptions) are scripture text
# (the Spanish module has them as plain text in verse 1) and keep their content.
_TITLE_RE = re.compile(
    r"<title\b(?![^>]*canonical=\"true\")[^>]*?(?:/>|>.*?</title\s*>)", re.DOTALL
)
# The end of a chapter or book closes the verse: the last verse of a module can carry whatever
# follows the book (the WEB's glossary follows Revelation 22:21).
_END_RE = re.compile(r"<chapter\b[^>]*\beID=|<div\b[^>]*\btype=\"(?:book|glossary)\"[^>]*\beID=")
# Tags that only mark up text inside a line: removed without a trace, so that
# "<w>God</w>’s" stays "God’s". Every other tag (verse, paragraph, line, list, milestone, and
# transChange, which the Spanish module writes without spaces around it: "ejército<transChange>se
# llamaba</transChange><w>Sísara") separates words and leaves a soft space.
_INLINE_TAGS = (
    "w hi seg name divineName foreign reference a font sync i b u em strong span sup sub added "
    "mentioned q inscription abbr"
).split()
_INLINE_RE = re.compile(r"</?\s*(?:" + "|".join(_INLINE_TAGS) + r")\b[^>]*>", re.IGNORECASE)
_ANY_TAG_RE = re.compile(r"<[^>]*>")
_SOFT = "\x00"
_OPENERS = "([{‘“«¿¡—"
_CLOSERS = ",.;:!?)]}’”»…"
_SOFT_RUN_RE = re.compile(r"[\x00\s]*\x00[\x00\s]*")


def _join_soft(match: re.Match[str]) -> str:
    text, start, end = match.string, match.start(), match.end()
    before = text[start - 1] if start else ""
    after = text[end] if end < len(text) else ""
    if not before or not after or before in _OPENERS or after in _CLOSERS:
        return ""
    return " "


def clean_markup(text: str) -> str:
    """Plain text of one verse in OSIS (or ThML) markup.

    Notes are dropped with their content; a removed block element or note leaves at most one
    space, and none before closing punctuation or after opening punctuation, so words are
    never glued together ("God<note>…</note><w>created</w>" becomes "God created").
    """
    if end := _END_RE.search(text):
        text = text[: end.start()]
    text = _DROP_RE.sub(_SOFT, text)
    text = _TITLE_RE.sub(_SOFT, text)
    text = _INLINE_RE.sub("", text)
    text = _ANY_TAG_RE.sub(_SOFT, text)
    text = html.unescape(text)
    text = _SOFT_RUN_RE.sub(_join_soft, text)
    return " ".join(text.split())


# "... Amén. Fué escrita á los Hebreos desde Italia con Timoteo." (RV 1909, end of Hebrews)
_SUBSCRIPTION_RE = re.compile(r"(Amén\.)\s+[^.]*\b(?:escrita|enviada)\b.*$")


def strip_subscription(text: str) -> str:
    """The last verse of a book without the KJV-style subscription after an epistle."""
    return _SUBSCRIPTION_RE.sub(r"\1", text)


# -- alignment --------------------------------------------------------------------------------

# Gale & Church (1993), "A program for aligning sentences in bilingual corpora": prior
# probabilities of the alignment beads and the variance of the length difference per character.
_BEADS = (
    (1, 1, -math.log(0.89)),
    (1, 0, -math.log(0.0099 / 2)),
    (0, 1, -math.log(0.0099 / 2)),
    (2, 1, -math.log(0.089 / 2)),
    (1, 2, -math.log(0.089 / 2)),
)
_VARIANCE = 6.8
# A pair whose lengths are this unlikely (|z| > 4, p < 6.3e-5) is left out: in practice a verse
# with a tail the other side lacks (the RV 1909's subscriptions after the epistles).
MAX_LENGTH_MISMATCH = -math.log(math.erfc(4 / math.sqrt(2)))


def length_mismatch(l1: int, l2: int, ratio: float) -> float:
    """-log P(|delta|) of Gale & Church for segment lengths ``l1``, ``l2`` (characters)."""
    if not l1 and not l2:
        return 0.0
    z = abs(ratio * l1 - l2) / math.sqrt(_VARIANCE * (l1 + l2 / ratio) / 2)
    p = math.erfc(z / math.sqrt(2))
    return -math.log(p) if p > 1e-300 else 690.0


def align_lengths(
    a: Sequence[int], b: Sequence[int], band: int = 4
) -> list[tuple[int, int, int, int]]:
    """Length-based alignment of two segment sequences (Gale & Church, 1993).

    Returns beads ``(a_start, a_end, b_start, b_end)`` covering both sequences in order; a
    bead joins one or two segments of a side (1-1, 1-0, 0-1, 2-1, 1-2). The search stays within
    ``band`` segments of the diagonal, which is plenty for verse numbering that drifts by a verse
    or two.
    """
    n, m = len(a), len(b)
    pa, pb = [0], [0]
    for x in a:
        pa.append(pa[-1] + x)
    for x in b:
        pb.append(pb[-1] + x)
    ratio = (pb[-1] or 1) / (pa[-1] or 1)
    band = max(band, abs(n - m) + 1)
    cost: list[dict[int, float]] = []
    back: list[dict[int, tuple[int, int]]] = []
    for i in range(n + 1):
        center = (i * m) // n if n else 0
        row: dict[int, float] = {}
        back_row: dict[int, tuple[int, int]] = {}
        for j in range(max(0, center - band), min(m, center + band) + 1):
            if i == 0 and j == 0:
                row[0] = 0.0
                continue
            best, arg = math.inf, None
            for di, dj, bead_cost in _BEADS:
                pi, pj = i - di, j - dj
                if pi < 0 or pj < 0:
                    continue
                prev = cost[pi].get(pj) if di else row.get(pj)
                if prev is None:
                    continue
                total = prev + bead_cost + length_mismatch(pa[i] - pa[pi], pb[j] - pb[pj], ratio)
                if total < best:
                    best, arg = total, (di, dj)
            if arg is not None:
                row[j], back_row[j] = best, arg
        cost.append(row)
        back.append(back_row)
    beads = []
    i, j = n, m
    while i or j:
        di, dj = back[i][j]
        beads.append((i - di, i, j - dj, j))
        i, j = i - di, j - dj
    return beads[::-1]
