"""Token ids into the flat files of a DATA_DIR (the layout: :mod:`aiayn.data.corpus`): the
sentences' ids back to back in a ``.bin`` file, their ``int64`` offsets and ``int32`` lengths
beside it. Text is encoded in chunks of lines, so that no split is held whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain, islice
from pathlib import Path
from typing import BinaryIO

import numpy as np

from aiayn.data.corpus import ids_paths

_CHUNK_LINES = 20_000


def line_chunks(path: Path) -> Iterator[list[str]]:
    """The lines of a UTF-8 text file, split at newlines only and without them, a chunk at a
    time."""
    with path.open(encoding="utf-8", newline="\n") as handle:
        while chunk := list(islice(handle, _CHUNK_LINES)):
            yield [line[:-1] if line.endswith("\n") else line for line in chunk]


def write_ids(ids: list[list[int]], dtype: np.dtype, out: BinaryIO) -> np.ndarray:
    """Append the sentences' ids back to back to a ``.bin`` file; returns their lengths."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    flat.tofile(out)
    return lengths


def write_offsets(directory: Path, split: str, lang: str, lengths: list[np.ndarray]) -> None:
    """``.idx.npy`` (int64 offsets) and ``.len.npy`` (int32) of sentences of these lengths."""
    all_lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.zeros(len(all_lens) + 1, dtype=np.int64)
    np.cumsum(all_lens, out=offsets[1:])
    _, idx_path, len_path = ids_paths(directory, split, lang)
    np.save(idx_path, offsets)
    np.save(len_path, all_lens.astype(np.int32))
