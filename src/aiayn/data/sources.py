"""Where parallel text comes from: the embedded Bible corpus, Multi30k and WMT14 English-German.

Each source ends as plain ``PREFIX.{lang}`` files (one sentence a line) that
:func:`aiayn.data.prepare.prepare_data` reads like any user's files.

* :func:`bible_pairs` / :func:`write_bible_corpus`: verse-aligned English-Spanish text from
  the public-domain World English Bible and Reina-Valera 1909, read with ``pysword`` from the
  SWORD modules Debian ships (``sword-text-web``, ``sword-text-sparv`` under /usr/share/sword) or
  from module zips (:func:`download_sword_modules` fetches CrossWire's). The split is fixed by a
  hash of the verse reference; see ``docs/data.md``.
* :func:`download_multi30k`: task 1 raw files from the dataset's GitHub repository.
* :func:`download_wmt14`: the paper's WMT 2014 English-German data (Europarl v7, Common Crawl,
  News Commentary v9; newstest2013 for validation, newstest2014 for test).

Downloads go through :func:`fetch` into a cache directory and are reused when present.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import html
import json
import math
import os
import re
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiayn.errors import UserError

Log = Callable[[str], None]

# -- downloads --------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$AIAYN_CACHE``, else ``$XDG_CACHE_HOME/aiayn``, else ``~/.cache/aiayn``."""
    if env := os.environ.get("AIAYN_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aiayn"


def fetch(url: str, dest: Path) -> None:
    """Download ``url`` to ``dest`` (through a temporary file, so a failed download leaves none)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "aiayn-data/1"})
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(request, timeout=60) as response:
            shutil.copyfileobj(response, out, length=1 << 20)
        os.replace(tmp_name, dest)
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", None) or getattr(err, "strerror", None) or err
        raise UserError(f"{url}: download failed ({reason}); is the network reachable?") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)


def cached_download(url: str, cache_dir: Path, log: Log | None = None) -> Path:
    """The file behind ``url`` in ``cache_dir`` (named after the URL's last part)."""
    dest = Path(cache_dir) / url.rsplit("/", 1)[-1]
    if not dest.is_file():
        if log:
            log(f"downloading {url}")
        fetch(url, dest)
    return dest


# -- the embedded Bible corpus ----------------------------------------------------------------

DEBIAN_SWORD_DIR = Path("/usr/share/sword")
# Module names: Debian's (eBible.org builds) first, then CrossWire's.
ENGLISH_MODULES = ("engWEB2015eb", "WEB")
SPANISH_MODULES = ("spaRV1909eb", "SpaRV1909")
CROSSWIRE_ZIP_URL = "https://www.crosswire.org/ftpmirror/pub/sword/packages/rawzip/{name}.zip"
BIBLE_LANGS = ("en", "es")
# A verse belongs to valid when bucket < VALID_BUCKETS, to test when bucket < VALID + TEST,
# else to train; bucket = first 8 bytes of sha256("Gen.1.1") as an integer, mod 1000.
SPLIT_BUCKETS = 1000
VALID_BUCKETS = 32
TEST_BUCKETS = 32
BIBLE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class VersePair:
    ref: str  # OSIS reference(s) of the English side: "John.3.16", "Num.13.32+Num.13.33"
    en: str
    es: str


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


# Elements dropped with their content: notes (footnotes, cross references) and what lives only
# inside them, speaker labels, and non-canonical headings (handled separately below).
_DROP_WITH_CONTENT = ("note", "speaker", "catchWord", "rdg", "rdgGroup", "figure", "index")
_DROP_WITH_CONTENT += ("scripRef", "scripCom")  # ThML cross references and comments
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


def sword_paths(sword_path: str | Path | Sequence[str | Path] | None) -> list[Path]:
    if sword_path is None:
        candidates = []
        if env := os.environ.get("SWORD_PATH"):
            candidates += [Path(p) for p in env.split(os.pathsep) if p]
        candidates += [DEBIAN_SWORD_DIR, Path.home() / ".sword"]
        return [p for p in candidates if (p / "mods.d").is_dir()]
    paths = [sword_path] if isinstance(sword_path, (str, Path)) else list(sword_path)
    out = []
    for p in map(Path, paths):
        if p.is_dir() and (p / "mods.d").is_dir():
            out.append(p)
        elif p.is_file() and p.suffix.lower() == ".zip":
            out.append(p)
        elif p.is_dir():  # a directory of module zips
            zips = sorted(p.glob("*.zip"))
            if not zips:
                raise UserError(f"{p}: neither a SWORD directory (mods.d/) nor one with .zip files")
            out += zips
        else:
            raise UserError(f"{p}: no such SWORD module directory or zip")
    return out


_MISSING_MODULES_HELP = (
    "install the Debian/Ubuntu packages sword-text-web and sword-text-sparv "
    "(apt-get install sword-text-web sword-text-sparv; scripts/setup_env.sh does it as root), "
    "or download CrossWire's module zips (aiayn prepare --corpus bible --download) "
    "and pass them with --sword-path"
)


def _open_modules(paths: list[Path]) -> tuple[Any, Any, str, str]:
    """(English bible, Spanish bible, their module names) from the first paths that have them."""
    try:
        from pysword.modules import SwordModules
    except ImportError:  # pragma: no cover - pysword is a dependency
        raise UserError("the pysword package is missing: pip install pysword") from None
    found: dict[str, tuple[Any, dict[str, str]]] = {}
    for path in paths:
        modules = SwordModules(str(path))
        try:
            confs = modules.parse_modules()
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
            raise UserError(f"{path}: cannot read SWORD modules ({err})") from None
        for name, conf in confs.items():
            found.setdefault(name, (modules, conf))
    chosen = []
    for wanted in (ENGLISH_MODULES, SPANISH_MODULES):
        name = next((n for n in wanted if n in found), None)
        if name is None:
            where = ", ".join(map(str, paths)) or "no SWORD directory found"
            raise UserError(
                f"SWORD module {' or '.join(wanted)} not found ({where}): {_MISSING_MODULES_HELP}"
            )
        modules, conf = found[name]
        if conf.get("sourcetype", "OSIS").upper() not in ("OSIS", "THML", "PLAIN"):
            raise UserError(f"{name}: markup {conf.get('sourcetype')} is not supported")
        try:
            bible = modules.get_bible_from_module(name)
        except (OSError, ValueError) as err:
            raise UserError(f"{name}: cannot open the module ({err})") from None
        _cache_blocks(bible)
        chosen.append((bible, name))
    return chosen[0][0], chosen[1][0], chosen[0][1], chosen[1][1]


def _cache_blocks(bible: Any) -> None:
    """Keep the last decompressed block: pysword inflates a whole book for every verse read.

    Reading book by book, this turns minutes into about a second.
    """
    inflate = getattr(bible, "_decompressed_text", None)
    if inflate is None:  # raw-text modules are not compressed
        return
    last: dict[tuple[str, int], bytes] = {}

    def cached(testament: str, buf_num: int) -> bytes:
        key = (testament, buf_num)
        if key not in last:
            last.clear()
            last[key] = inflate(testament, buf_num)
        return last[key]

    bible._decompressed_text = cached


def _books(bible: Any) -> dict[str, Any]:
    """OSIS book id -> pysword BookStructure, in canonical order."""
    books = bible.get_structure().get_books()
    return {b.osis_name: b for testament in ("ot", "nt") for b in books.get(testament, [])}


def _book_verses(bible: Any, book: Any) -> list[tuple[str, str]]:
    """(OSIS reference, plain text) of every verse slot of a book, empty ones included."""
    verses = []
    for chapter in range(1, book.num_chapters + 1):
        texts = list(bible.get_iter(books=[book.name], chapters=[chapter], clean=False))
        if len(texts) != book.chapter_lengths[chapter - 1]:
            raise UserError(f"{book.osis_name} {chapter}: the module returned {len(texts)} verses")
        ref = f"{book.osis_name}.{chapter}."
        verses += [(f"{ref}{verse}", clean_markup(t)) for verse, t in enumerate(texts, 1)]
    return verses


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


# "... Amén. Fué escrita á los Hebreos desde Italia con Timoteo." (RV 1909, end of Hebrews)
_SUBSCRIPTION_RE = re.compile(r"(Amén\.)\s+[^.]*\b(?:escrita|enviada)\b.*$")


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


def bible_pairs(
    sword_path: str | Path | Sequence[str | Path] | None = None,
) -> Iterator[VersePair]:
    """English (WEB) - Spanish (RV 1909) verse pairs in canonical order.

    ``sword_path``: a SWORD directory (with ``mods.d/``), a module zip, a directory of zips, or a
    list of these; by default ``$SWORD_PATH``, /usr/share/sword and ~/.sword.

    The modules number verses differently in places (the Spanish text follows the Hebrew
    numbering in some chapters, e.g. Numbers 13, while its module claims the KJV's), so verses
    are not paired by reference alone: each book is aligned by verse length (Gale & Church)
    within a few verses of the reference, which pairs shifted verses correctly and joins a verse
    that one side splits in two. Pairs with an empty side, or lengths too unlikely for a
    translation (:data:`MAX_LENGTH_MISMATCH`), are left out.
    """
    english, spanish, _, _ = _open_modules(sword_paths(sword_path))
    en_books = _books(english)
    for osis, es_book in _books(spanish).items():
        en_book = en_books.get(osis)
        if en_book is None:
            continue
        en_verses = _book_verses(english, en_book)
        es_verses = _book_verses(spanish, es_book)
        if es_verses:  # the KJV-style subscription after an epistle is not scripture text
            ref, text = es_verses[-1]
            es_verses[-1] = (ref, _SUBSCRIPTION_RE.sub(r"\1", text))
        en_lengths = [len(t) for _, t in en_verses]
        es_lengths = [len(t) for _, t in es_verses]
        ratio = (sum(es_lengths) or 1) / (sum(en_lengths) or 1)
        for a0, a1, b0, b1 in align_lengths(en_lengths, es_lengths):
            en = " ".join(t for _, t in en_verses[a0:a1] if t)
            es = " ".join(t for _, t in es_verses[b0:b1] if t)
            if en and es and length_mismatch(len(en), len(es), ratio) <= MAX_LENGTH_MISMATCH:
                yield VersePair("+".join(r for r, _ in en_verses[a0:a1]), en, es)


def write_bible_corpus(
    out_dir: str | Path,
    sword_path: str | Path | Sequence[str | Path] | None = None,
    log: Log | None = None,
) -> dict[str, Path]:
    """Write ``{train,valid,test}.{en,es}`` (and ``.ref``, the verse references) to ``out_dir``.

    Returns the prefixes ``{"train": out_dir/"train", ...}``. Files already there from a complete
    earlier run (marked by ``bible.done``) are reused.
    """
    out = Path(out_dir)
    prefixes = {split: out / split for split in ("train", "valid", "test")}
    done = out / "bible.done"
    paths = sword_paths(sword_path)
    stamp = json.dumps({"format": BIBLE_FORMAT_VERSION, "modules": _modules_stamp(paths)})
    if done.is_file() and done.read_text(encoding="utf-8").strip() == stamp:
        return prefixes
    if log:
        log(f"extracting the Bible corpus from {', '.join(map(str, paths)) or 'SWORD modules'}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".bible-", dir=out))
    except OSError as err:
        raise UserError(f"{out}: cannot write the Bible corpus here ({err.strerror})") from None
    try:
        counts = dict.fromkeys(prefixes, 0)
        with contextlib.ExitStack() as stack:
            handles = {
                (split, kind): stack.enter_context(
                    (staging / f"{split}.{kind}").open("w", encoding="utf-8", newline="\n")
                )
                for split in prefixes
                for kind in (*BIBLE_LANGS, "ref")
            }
            for pair in bible_pairs(paths):
                split = bible_split(pair.ref)
                handles[split, "en"].write(pair.en + "\n")
                handles[split, "es"].write(pair.es + "\n")
                handles[split, "ref"].write(pair.ref + "\n")
                counts[split] += 1
        for path in staging.iterdir():
            os.replace(path, out / path.name)
        done.write_text(stamp + "\n", encoding="utf-8")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if log:
        log("Bible corpus: " + ", ".join(f"{s} {n:,} verses" for s, n in counts.items()))
    return prefixes


def _modules_stamp(paths: list[Path]) -> list[list[Any]]:
    """What identifies the module files: zips and conf files by name, size and mtime."""
    files = [p for p in paths if p.is_file()]
    files += [c for p in paths if p.is_dir() for c in sorted((p / "mods.d").glob("*.conf"))]
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def download_sword_modules(
    cache_dir: str | Path,
    names: Iterable[str] = (ENGLISH_MODULES[1], SPANISH_MODULES[1]),
    log: Log | None = None,
) -> list[Path]:
    """CrossWire's module zips (by default WEB and SpaRV1909), downloaded once into the cache."""
    target = Path(cache_dir) / "sword"
    return [cached_download(CROSSWIRE_ZIP_URL.format(name=n), target, log) for n in names]


# -- Multi30k ---------------------------------------------------------------------------------

MULTI30K_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{name}.{lang}.gz"
MULTI30K_LANGS = ("en", "de", "fr", "cs")
# Our split name -> the file stem in the dataset repository.
MULTI30K_SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}


def download_multi30k(
    cache_dir: str | Path,
    src: str = "en",
    tgt: str = "de",
    log: Log | None = None,
) -> dict[str, Path]:
    """Multi30k task 1 (train 29,000, val 1,014, test_2016_flickr 1,000) as plain text prefixes."""
    for lang in (src, tgt):
        if lang not in MULTI30K_LANGS:
            raise UserError(f"Multi30k task 1 has no {lang!r} side (it has {MULTI30K_LANGS})")
    root = Path(cache_dir) / "multi30k"
    prefixes = {}
    for split, stem in MULTI30K_SPLITS.items():
        for lang in (src, tgt):
            dest = root / f"{split}.{lang}"
            if dest.is_file():
                continue
            archive = cached_download(MULTI30K_URL.format(name=stem, lang=lang), root / "gz", log)
            _atomic_write_from(dest, lambda out, a=archive: _gunzip_into(a, out))
        prefixes[split] = root / split
    return prefixes


def _gunzip_into(archive: Path, out: Any) -> None:
    try:
        with gzip.open(archive, "rb") as handle:
            shutil.copyfileobj(handle, out, length=1 << 20)
    except (OSError, EOFError) as err:
        raise UserError(
            f"{archive}: not a readable gzip file ({err}); delete it to retry"
        ) from None


# -- WMT14 English-German ---------------------------------------------------------------------

WMT14_TRAIN = (
    # (archive URL, member path without the language suffix)
    (
        "https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz",
        "training/europarl-v7.de-en",
    ),
    ("https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz", "commoncrawl.de-en"),
    (
        "https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz",
        "training/news-commentary-v9.de-en",
    ),
)
WMT14_DEV_URL = "https://www.statmt.org/wmt14/dev.tgz"  # dev/newstest2013.{en,de}
WMT14_TEST_URL = "https://www.statmt.org/wmt14/test-full.tgz"  # the full 3,003 sentences
WMT14_TEST_MEMBERS = {
    "en": "test-full/newstest2014-deen-src.en.sgm",
    "de": "test-full/newstest2014-deen-ref.de.sgm",
}
_SEG_RE = re.compile(r"<seg[^>]*>(.*?)</seg>", re.IGNORECASE)


def download_wmt14(cache_dir: str | Path, log: Log | None = None) -> dict[str, Path]:
    """WMT 2014 English-German as in the paper: about 4.5M training pairs, newstest2013 (valid)
    and newstest2014 (test). Returns prefixes whose ``.en`` and ``.de`` files exist."""
    root = Path(cache_dir) / "wmt14"
    archives = root / "archives"
    prefixes = {split: root / f"{split}" for split in ("train", "valid", "test")}
    langs = ("en", "de")
    if not all(Path(f"{prefixes['train']}.{lang}").is_file() for lang in langs):
        corpora = [(cached_download(url, archives, log), member) for url, member in WMT14_TRAIN]
        for lang in langs:

            def write_train(out: Any, lang: str = lang) -> None:
                for archive, member in corpora:
                    with _member(archive, f"{member}.{lang}") as handle:
                        _copy_lines(handle, out)

            _atomic_write_from(Path(f"{prefixes['train']}.{lang}"), write_train)
    if not all(Path(f"{prefixes['valid']}.{lang}").is_file() for lang in langs):
        dev = cached_download(WMT14_DEV_URL, archives, log)
        for lang in langs:

            def write_dev(out: Any, lang: str = lang) -> None:
                with _member(dev, f"dev/newstest2013.{lang}") as handle:
                    _copy_lines(handle, out)

            _atomic_write_from(Path(f"{prefixes['valid']}.{lang}"), write_dev)
    if not all(Path(f"{prefixes['test']}.{lang}").is_file() for lang in langs):
        test = cached_download(WMT14_TEST_URL, archives, log)
        for lang in langs:

            def write_test(out: Any, lang: str = lang) -> None:
                with _member(test, WMT14_TEST_MEMBERS[lang]) as handle:
                    out.write(sgm_segments(handle.read().decode("utf-8")).encode("utf-8"))

            _atomic_write_from(Path(f"{prefixes['test']}.{lang}"), write_test)
    return prefixes


def sgm_segments(sgm: str) -> str:
    """The ``<seg>`` texts of a WMT SGML file, one a line, entities decoded."""
    return "".join(html.unescape(seg).strip() + "\n" for seg in _SEG_RE.findall(sgm))


@contextlib.contextmanager
def _member(archive: Path, name: str) -> Iterator[Any]:
    try:
        with tarfile.open(archive, "r:*") as tar:
            try:
                handle = tar.extractfile(name)
            except KeyError:
                handle = None
            if handle is None:
                raise UserError(f"{archive}: has no file {name}; delete the archive to retry")
            with handle:
                yield handle
    except (tarfile.TarError, EOFError, OSError) as err:
        raise UserError(f"{archive}: damaged archive ({err}); delete it to retry") from None


def _copy_lines(handle: Any, out: Any) -> None:
    """Copy a text member, making sure it ends with a newline before the next one starts."""
    last = b"\n"
    while block := handle.read(1 << 20):
        out.write(block)
        last = block[-1:]
    if last != b"\n":
        out.write(b"\n")


def _atomic_write_from(dest: Path, write: Callable[[Any], None]) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
