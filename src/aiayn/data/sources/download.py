"""Downloads into a cache directory, and the file helpers the downloaded corpora share.

Every file is written through a temporary file beside it, so a failed download or extraction
leaves none; a file already in the cache is reused.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from aiayn.errors import UserError
from aiayn.progress import Log, Meter, Report, as_report


def default_cache_dir() -> Path:
    """``$AIAYN_CACHE``, else ``$XDG_CACHE_HOME/aiayn``, else ``~/.cache/aiayn``."""
    if env := os.environ.get("AIAYN_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aiayn"


def fetch(url: str, dest: Path, report: Report | None = None) -> None:
    """Download ``url`` to ``dest`` (through a temporary file, so a failed download leaves none),
    with a meter in ``report``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "aiayn-data/1"})
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(request, timeout=60) as response:
            size = int(response.headers.get("Content-Length") or 0)
            meter = (report or Report()).meter(dest.name, size, "MB", 10**6)
            _copy(response, out, meter)
        os.replace(tmp_name, dest)
        meter.finish()
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
        report = as_report(log)
        report(f"downloading {url}")
        fetch(url, dest, report)
    return dest


def _copy(source: Any, out: Any, meter: Meter) -> None:
    while block := source.read(1 << 20):
        out.write(block)
        meter.advance(len(block))


def atomic_write_from(dest: Path, write: Callable[[Any], None]) -> None:
    """Write ``dest`` with ``write(binary file)`` through a temporary file beside it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def gunzip_into(archive: Path, out: Any) -> None:
    """Copy the decompressed content of the gzip file ``archive`` into the binary file ``out``."""
    try:
        with gzip.open(archive, "rb") as handle:
            shutil.copyfileobj(handle, out, length=1 << 20)
    except (OSError, EOFError) as err:
        raise UserError(
            f"{archive}: not a readable gzip file ({err}); delete it to retry"
        ) from None


@contextlib.contextmanager
def archive_member(archive: Path, name: str) -> Iterator[Any]:
    """The member ``name`` of the tar file ``archive``, open for binary reading."""
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


def copy_lines(handle: Any, out: Any) -> None:
    """Copy a text member, making sure it ends with a newline before the next one starts."""
    last = b"\n"
    while block := handle.read(1 << 20):
        out.write(block)
        last = block[-1:]
    if last != b"\n":
        out.write(b"\n")
