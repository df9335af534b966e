"""The embedded Bible corpus: verse-aligned English-Spanish text from the public-domain World
English Bible and Reina-Valera 1909.

The texts are read with ``pysword`` from the SWORD modules Debian ships (``sword-text-web``,
``sword-text-sparv`` under /usr/share/sword) or from module zips (:func:`download_sword_modules`
fetches CrossWire's); :mod:`.bible_text` makes plain, aligned, split text of them. See
``docs/data.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pysword.modules import SwordModules

from aiayn.data.sources.bible_text import (
    MAX_LENGTH_MISMATCH,
    align_lengths,
    bible_split,
    clean_markup,
    length_mismatch,
    strip_subscription,
)
from aiayn.data.sources.download import cached_download
from aiayn.errors import UserError
from aiayn.progress import Log

DEBIAN_SWORD_DIR = Path("/usr/share/sword")
# Module names: Debian's (eBible.org builds) first, then CrossWire's.
ENGLISH_MODULES = ("engWEB2015eb", "WEB")
SPANISH_MODULES = ("spaRV1909eb", "SpaRV1909")
CROSSWIRE_ZIP_URL = "https://www.crosswire.org/ftpmirror/pub/sword/packages/rawzip/{name}.zip"
BIBLE_LANGS = ("en", "es")
# Part of the stamp of a written corpus: bump it when the text written changes (bible_text's
# cleaning, alignment or split), so that an earlier corpus is extracted again.
BIBLE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class VersePair:
    ref: str  # OSIS reference(s) of the English side: "John.3.16", "Num.13.32+Num.13.33"
    en: str
    es: str


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
    """Keep the last decompressed block: pysword inflates a whole book for every verse read."""
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
    translation (:data:`~aiayn.data.sources.bible_text.MAX_LENGTH_MISMATCH`), are left out.
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
            es_verses[-1] = (ref, strip_subscription(text))
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


def bible_corpus(
    cache_dir: str | Path,
    sword_path: str | Path | Sequence[str | Path] | None = None,
    download: bool = False,
    log: Log | None = None,
) -> dict[str, Path]:
    """:func:`write_bible_corpus` into ``cache_dir/bible``; with ``download``, CrossWire's
    module zips are fetched into the cache first when no modules are installed."""
    modules = sword_path
    if modules is None and download and not sword_paths(None):
        modules = download_sword_modules(cache_dir, log=log)
    return write_bible_corpus(Path(cache_dir) / "bible", modules, log=log)


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
