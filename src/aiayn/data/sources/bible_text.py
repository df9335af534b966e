"""The Bible corpus's text, without I/O: OSIS markup cleaning, the length-based verse alignment
(Gale & Church, 1993) and the fixed train/valid/test split by verse reference.

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
