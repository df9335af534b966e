"""``aiayn cache``: what aiayn keeps in its cache directory and PyTorch's compiler cache, with
their sizes, and clearing them."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

# What --clear takes: aiayn's compiled decoder steps, PyTorch's inductor cache (what compiling
# them leaves in the temporary directory), the downloaded corpora, or all of them.
_CLEARABLE = ("compiled", "inductor", "corpora", "all")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "cache",
        help="show or clear aiayn's cache (compiled decoder steps, corpora)",
        description="List what aiayn keeps in its cache directory ($AIAYN_CACHE, else "
        "$XDG_CACHE_HOME/aiayn, else ~/.cache/aiayn) with the size of each part, and PyTorch's "
        "inductor cache, where compiling a decoder step leaves its intermediate files "
        "($TORCHINDUCTOR_CACHE_DIR, else a folder in the system's temporary directory). "
        "--clear removes a part: each is made again when it is needed (a compiled step by "
        "`translate --compiled-step` or the end of a training run, a corpus by its download).",
    )
    parser.add_argument(
        "--clear",
        choices=_CLEARABLE,
        help="remove the compiled decoder steps (compiled), PyTorch's inductor cache "
        "(inductor; shared with any other use of torch.compile by this user), the downloaded "
        "corpora (corpora), or all of them",
    )
    parser.set_defaults(run=run)


def inductor_cache_dir() -> Path:
    """PyTorch's inductor cache directory, without making it (``TORCHINDUCTOR_CACHE_DIR``,
    else its default in the temporary directory)."""
    if env := os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(env)
    # PyTorch's documented default: torchinductor_<user> in the temporary directory (read here
    # without importing Inductor, which takes seconds).
    import getpass
    import re
    import tempfile

    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}"


def _size(path: Path) -> int:
    """Bytes in the files under ``path`` (links not followed)."""
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(folder) / name).lstat().st_size
            except OSError:  # removed meanwhile
                pass
    return total


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _parts() -> dict[str, list[Path]]:
    """Each part of the cache and the paths it holds (those that exist)."""
    from aiayn.accel.store import compiled_dir
    from aiayn.data.sources.download import default_cache_dir

    root = default_cache_dir()
    compiled = compiled_dir()
    corpora = sorted(p for p in root.iterdir() if p != compiled) if root.is_dir() else []
    inductor = inductor_cache_dir()
    return {
        "compiled": [compiled] if compiled.exists() else [],
        "inductor": [inductor] if inductor.exists() else [],
        "corpora": corpora,
    }


def run(args: argparse.Namespace) -> int:
    from aiayn.accel.store import compiled_dir
    from aiayn.data.sources.download import default_cache_dir

    parts = _parts()
    if args.clear is not None:
        names = list(parts) if args.clear == "all" else [args.clear]
        for name in names:
            freed = 0
            for path in parts[name]:
                freed += _size(path)
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            print(f"{name}: removed {_mb(freed)}")
        return 0
    places = {
        "compiled": compiled_dir(),
        "inductor": inductor_cache_dir(),
        "corpora": default_cache_dir(),
    }
    for name, paths in parts.items():
        size = sum(_size(p) for p in paths)
        print(f"{name:<9} {_mb(size):>12}  {places[name]}")
    print("(aiayn cache --clear compiled|inductor|corpora|all removes a part)")
    return 0
