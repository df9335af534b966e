"""Multi30k task 1: the raw files from the dataset's GitHub repository."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from aiayn.data.sources.download import atomic_write_from, cached_download, gunzip_into
from aiayn.errors import UserError
from aiayn.progress import Log

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
            atomic_write_from(dest, partial(gunzip_into, archive))
        prefixes[split] = root / split
    return prefixes
