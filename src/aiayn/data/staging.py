"""How ``aiayn prepare`` writes a DATA_DIR, for every task: one prepare at a time in it;
everything written into a staging directory inside it and moved into place at the end, the
manifest removed first and written last, so that an interrupted run never leaves a directory
that :func:`aiayn.data.corpus.load_manifest` accepts with half-written data. A directory that
holds complete data of the same inputs and options (the same fingerprint) is reused as it is,
and a tokenizer trained on the same text with the same options is reused.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from aiayn.data.corpus import MANIFEST_NAME, TOKENIZER_NAME, load_manifest, manifest_path
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import UserError
from aiayn.lock import PREPARE_LOCK_NAME, prepare_lock
from aiayn.progress import Report

_STAGING_PREFIX = ".prepare-"


# -- fingerprints: what decides that a directory or a tokenizer is reused ---------------------


def file_stamp(path: Path) -> dict[str, Any]:
    """An input file as the fingerprint sees it: path, size and modification time."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def content_digest(paths: list[Path]) -> str:
    """SHA-256 of the files' bytes, in order (each file's length included)."""
    sha = hashlib.sha256()
    for path in paths:
        sha.update(path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                sha.update(chunk)
    return sha.hexdigest()


def digest(value: Any) -> str:
    """A short SHA-256 of a JSON value (keys sorted)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]


# -- writing DATA_DIR --------------------------------------------------------------------------


def refuse_overwriting(inputs: list[Path], outputs: list[Path], out: Path) -> None:
    """A :class:`UserError` when an input file is one that preparing ``out`` writes."""
    written = {path.resolve() for path in outputs}
    for path in inputs:
        if path.resolve() in written:
            raise UserError(f"{path}: an input file inside --out {out} would be overwritten")


def reuse_or_write(
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
def staging_dir(out: Path, inputs: list[Path] | None = None) -> Iterator[Path]:
    """A fresh staging directory inside ``out``, removed afterwards.

    Stale ones of killed runs go first; an ``OSError`` inside (permissions changed under us,
    ...) becomes a :class:`UserError` naming the file. A full disk is named as such, with the
    room free and the size of the ``inputs`` (text files), whatever failed of it: numpy and
    sentencepiece report a short write without the system's error number, or not at all (a
    model file cut short).
    """
    _remove_stale_staging(out)
    try:
        staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=out))
    except OSError as err:
        if err.errno in _FULL:
            raise _disk_full(out, inputs, err) from None
        raise UserError(f"{out}: output directory is not writable ({err.strerror})") from None
    try:
        yield staging
    except (OSError, UserError, RuntimeError) as err:
        full = isinstance(err, OSError) and err.errno in _FULL
        if full or _nearly_full(out):
            shutil.rmtree(staging, ignore_errors=True)  # first: the room free is then said
            raise _disk_full(out, inputs, err) from None
        if not isinstance(err, OSError):
            raise
        where = err.filename or out
        raise UserError(f"{where}: {err.strerror or err} while preparing {out}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# Free bytes below which a failure while writing is read as a full disk (a write that fails
# for want of room leaves less than one of its buffers free).
_NEARLY_FULL = 1 << 20


def _free(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _nearly_full(folder: Path) -> bool:
    free = _free(folder)
    return free is not None and free < _NEARLY_FULL


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n / 1e3:,.0f} kB"


def _disk_full(out: Path, inputs: list[Path] | None, err: BaseException) -> UserError:
    """The message of a full disk under ``out``: where, what was free, what it takes."""
    where = getattr(err, "filename", None)
    writing = f" (writing {Path(where).name})" if where else ""
    free = _free(out)
    have = f" ({_mb(free)} free)" if free is not None else ""
    size = sum(p.stat().st_size for p in inputs or () if p.is_file())
    takes = (
        f"; the prepared data takes about twice the input text ({_mb(size)}), and more while "
        "it is written"
        if size
        else ""
    )
    return UserError(
        f"no space left on the device of {out}{have} to prepare the data{writing}{takes}: "
        "free some space there, or give another --out"
    )


def reusable_tokenizer(out: Path, old: dict[str, Any] | None, key: str) -> Path | None:
    """The existing tokenizer of ``out`` when it was trained with the same text and options."""
    path = out / TOKENIZER_NAME
    if old is not None and old.get("tokenizer_key") == key and path.is_file():
        return path
    return None


def staged_tokenizer(
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


def commit(staging: Path, out: Path, manifest: dict[str, Any], old: dict[str, Any] | None) -> None:
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
