"""The paper's WMT 2014 English-German data: Europarl v7, Common Crawl and News Commentary v9
for training, newstest2013 for validation, newstest2014 (from its SGML files) for test."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from aiayn.data.sources.download import (
    archive_member,
    atomic_write_from,
    cached_download,
    copy_lines,
)
from aiayn.progress import Log

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
                    with archive_member(archive, f"{member}.{lang}") as handle:
                        copy_lines(handle, out)

            atomic_write_from(Path(f"{prefixes['train']}.{lang}"), write_train)
    if not all(Path(f"{prefixes['valid']}.{lang}").is_file() for lang in langs):
        dev = cached_download(WMT14_DEV_URL, archives, log)
        for lang in langs:

            def write_dev(out: Any, lang: str = lang) -> None:
                with archive_member(dev, f"dev/newstest2013.{lang}") as handle:
                    copy_lines(handle, out)

            atomic_write_from(Path(f"{prefixes['valid']}.{lang}"), write_dev)
    if not all(Path(f"{prefixes['test']}.{lang}").is_file() for lang in langs):
        test = cached_download(WMT14_TEST_URL, archives, log)
        for lang in langs:

            def write_test(out: Any, lang: str = lang) -> None:
                with archive_member(test, WMT14_TEST_MEMBERS[lang]) as handle:
                    out.write(sgm_segments(handle.read().decode("utf-8")).encode("utf-8"))

            atomic_write_from(Path(f"{prefixes['test']}.{lang}"), write_test)
    return prefixes


def sgm_segments(sgm: str) -> str:
    """The ``<seg>`` texts of a WMT SGML file, one a line, entities decoded."""
    return "".join(html.unescape(seg).strip() + "\n" for seg in _SEG_RE.findall(sgm))
