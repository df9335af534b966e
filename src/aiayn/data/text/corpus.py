"""One split of a text-task DATA_DIR (``aiayn prepare --task lm|classify``), memory-mapped.

The files are those of a translation DATA_DIR with ``txt`` for the language suffix (see
:mod:`aiayn.data.text` for the layout), plus the class indices of a classification task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from aiayn.data.corpus import (
    check_split,
    data_kind,
    load_manifest,
    open_ids,
    read_lines,
    text_path,
)
from aiayn.errors import UserError

# The suffix of the text files: {split}.txt, {split}.txt.bin, {split}.txt.idx.npy, ...
TEXT_SUFFIX = "txt"
TEXT_TASKS = ("lm", "classify")


def labels_path(data_dir: str | Path, split: str) -> Path:
    """The ``int64`` class index of every line of a classification split."""
    return Path(data_dir) / f"{split}.labels.npy"


class TextCorpus:
    """One split of a text-task DATA_DIR: one text (a document, a sentence) per line.

    ``lengths[i]`` is the number of tokens of line ``i`` (no BOS/EOS); ``labels`` the class
    index of every line (``None`` for the lm task), ``label_names`` the classes in index order.
    The flat ids (``token_ids``, in the manifest's dtype) and their ``int64`` ``offsets`` stay
    on disk behind memory maps: line ``i`` is ``token_ids[offsets[i]:offsets[i + 1]]``.
    """

    def __init__(self, data_dir: Path, split: str, manifest: dict[str, Any]) -> None:
        self.data_dir = data_dir
        self.split = split
        self.task: str = manifest["task"]
        self.vocab_size: int = int(manifest["vocab_size"])
        self.label_names: list[str] = [str(name) for name in manifest.get("labels", [])]
        self.token_ids, self.offsets, self.lengths = open_ids(
            data_dir, split, TEXT_SUFFIX, np.dtype(manifest["dtype"])
        )
        n = int(manifest["splits"][split]["lines"])
        if len(self.lengths) != n:
            raise UserError(
                f"{data_dir}: {split} has {len(self.lengths)} lines of token ids, the manifest "
                f"says {n}; run `aiayn prepare` again"
            )
        self.labels: np.ndarray | None = None
        if self.task == "classify":
            self.labels = _load_labels(labels_path(data_dir, split), n, len(self.label_names))

    @classmethod
    def open(cls, data_dir: str | Path, split: str) -> TextCorpus:
        """Open ``split`` ("train", "valid" or "test") of a directory prepared for a text task."""
        data_dir = Path(data_dir)
        manifest = load_manifest(data_dir)
        if data_kind(manifest) != "text":
            raise UserError(
                f"{data_dir} holds parallel data for translation; the lm, mlm and classify "
                "tasks need text prepared with `aiayn prepare --task lm` (or --task classify)"
            )
        if manifest.get("task") not in TEXT_TASKS:
            raise UserError(f"{data_dir}: unknown text task {manifest.get('task')!r}")
        check_split(data_dir, manifest, split)
        return cls(data_dir, split, manifest)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps are not pickled (that would copy them): worker processes reopen the files.
        return {"data_dir": self.data_dir, "split": self.split}

    def __setstate__(self, state: dict[str, Any]) -> None:
        other = TextCorpus.open(state["data_dir"], state["split"])
        self.__dict__.update(other.__dict__)

    def ids(self, i: int) -> np.ndarray:
        """The token ids (int64, without BOS/EOS) of line ``i``."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"line {i} out of range for {len(self)} lines")
        i = int(i) % len(self)
        return np.array(self.token_ids[self.offsets[i] : self.offsets[i + 1]], dtype=np.int64)

    def text_path(self) -> Path:
        return text_path(self.data_dir, self.split, TEXT_SUFFIX)

    def texts(self) -> list[str]:
        """The kept texts (labels removed), aligned with the line indices."""
        return read_lines(self.text_path())


def _load_labels(path: Path, n: int, n_classes: int) -> np.ndarray:
    try:
        labels = np.load(path, mmap_mode="r")
    except FileNotFoundError:
        raise UserError(f"{path}: missing; run `aiayn prepare` again") from None
    except ValueError as err:
        raise UserError(f"{path}: damaged ({err}); run `aiayn prepare` again") from None
    if labels.shape != (n,) or labels.dtype != np.int64:
        raise UserError(f"{path}: expected {n} int64 labels; run `aiayn prepare` again")
    if n and not (0 <= int(labels.min()) and int(labels.max()) < n_classes):
        raise UserError(f"{path}: a label outside the {n_classes} classes of the manifest")
    return labels
