"""A prepared DATA_DIR: one split read through memory maps, never as Python lists.

Layout written by :func:`aiayn.data.prepare.prepare_data` (see ``docs/data.md``; the text
tasks' layout, :mod:`aiayn.data.text`, reuses its files with the suffix ``txt``)::

    DATA_DIR/manifest.json            written last: a directory without it is not trusted
    DATA_DIR/spm.model                the joint sentencepiece model
    DATA_DIR/{split}.{lang}           the kept sentences as text (references for BLEU)
    DATA_DIR/{split}.{lang}.bin       flat token ids of all sentences (dtype in the manifest)
    DATA_DIR/{split}.{lang}.idx.npy   int64 offsets, n + 1 entries: sentence i is bin[o[i]:o[i+1]]
    DATA_DIR/{split}.{lang}.len.npy   int32 lengths (tokens, no BOS/EOS)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from aiayn.data.collate import BOS_ID, EOS_ID, PAD_ID, Batch
from aiayn.errors import UserError

MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "spm.model"
MANIFEST_FORMAT_VERSION = 1
SPLITS = ("train", "valid", "test")


def manifest_path(data_dir: str | Path) -> Path:
    return Path(data_dir) / MANIFEST_NAME


def tokenizer_path(data_dir: str | Path) -> Path:
    """Where a prepared DATA_DIR keeps its sentencepiece model."""
    return Path(data_dir) / TOKENIZER_NAME


def text_path(data_dir: str | Path, split: str, lang: str) -> Path:
    """The kept raw sentences of one side of a split, aligned with the corpus indices."""
    return Path(data_dir) / f"{split}.{lang}"


def ids_paths(data_dir: str | Path, split: str, lang: str) -> tuple[Path, Path, Path]:
    """(flat ids, offsets, lengths) files of one side of a split."""
    stem = Path(data_dir) / f"{split}.{lang}"
    return (
        stem.with_name(stem.name + ".bin"),
        stem.with_name(stem.name + ".idx.npy"),
        stem.with_name(stem.name + ".len.npy"),
    )


def ids_dtype(vocab_size: int) -> np.dtype:
    """The dtype of the ``.bin`` token files: ``uint16`` while the ids fit, else ``int32``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def load_manifest(data_dir: str | Path) -> dict[str, Any]:
    """Read DATA_DIR/manifest.json; a missing or foreign file is a :class:`UserError`."""
    path = manifest_path(data_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(
            f"{path} not found: {data_dir} is not a prepared data directory "
            "(run `aiayn prepare` first; an interrupted run leaves no manifest)"
        ) from None
    except OSError as err:
        raise UserError(f"{path}: cannot read: {err.strerror}") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}, line {err.lineno}: invalid JSON: {err.msg}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "aiayn-data":
        raise UserError(f"{path}: not an aiayn data manifest")
    version = manifest.get("format_version")
    if version != MANIFEST_FORMAT_VERSION:
        raise UserError(
            f"{path}: manifest format version {version}, this aiayn reads "
            f"{MANIFEST_FORMAT_VERSION}; run `aiayn prepare` again"
        )
    return manifest


def data_kind(manifest: dict[str, Any]) -> Literal["parallel", "text"]:
    """What a manifest describes: ``"parallel"`` text for translation (manifests without a
    ``kind``) or ``"text"`` for the lm / mlm / classify tasks (:mod:`aiayn.data.text`)."""
    kind = manifest.get("kind", "parallel")
    if kind == "parallel":
        return "parallel"
    if kind == "text":
        return "text"
    raise UserError(f"unknown kind of data {kind!r} in the manifest; run `aiayn prepare` again")


class Corpus:
    """One split of a prepared DATA_DIR; token ids stay on disk behind memory maps."""

    def __init__(self, data_dir: Path, split: str, manifest: dict[str, Any]) -> None:
        self.data_dir = data_dir
        self.split = split
        self.src_lang: str = manifest["src"]
        self.tgt_lang: str = manifest["tgt"]
        self.vocab_size: int = int(manifest["vocab_size"])
        # Separate vocabularies (an imported Marian model's): the target side's own size.
        self.tgt_vocab_size: int = int(manifest.get("tgt_vocab_size", self.vocab_size))
        dtype = np.dtype(manifest["dtype"])
        self._src_ids, self._src_off, self.src_lengths = open_ids(
            data_dir, split, self.src_lang, dtype
        )
        self._tgt_ids, self._tgt_off, self.tgt_lengths = open_ids(
            data_dir, split, self.tgt_lang, dtype
        )
        n = int(manifest["splits"][split]["pairs"])
        if len(self.src_lengths) != n or len(self.tgt_lengths) != n:
            raise UserError(
                f"{data_dir}: {split} has {len(self.src_lengths)} source and "
                f"{len(self.tgt_lengths)} target sentences, the manifest says {n}; "
                "run `aiayn prepare` again"
            )

    @classmethod
    def open(cls, data_dir: str | Path, split: str) -> Corpus:
        """Open ``split`` ("train", "valid" or "test") of a prepared directory."""
        data_dir = Path(data_dir)
        manifest = load_manifest(data_dir)
        if data_kind(manifest) != "parallel":
            task = manifest.get("task", "?")
            raise UserError(
                f"{data_dir} is prepared for the {task} task (aiayn prepare --task {task}); a "
                "translation model needs parallel data (aiayn prepare --train PREFIX --valid "
                "PREFIX --src LANG --tgt LANG)"
            )
        check_split(data_dir, manifest, split)
        return cls(data_dir, split, manifest)

    def __len__(self) -> int:
        return len(self.src_lengths)

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps are not pickled (that would copy them): worker processes reopen the files.
        return {"data_dir": self.data_dir, "split": self.split}

    def __setstate__(self, state: dict[str, Any]) -> None:
        other = Corpus.open(state["data_dir"], state["split"])
        self.__dict__.update(other.__dict__)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and target token ids (int64, without BOS/EOS) of pair ``i``."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"pair {i} out of range for {len(self)} pairs")
        i = int(i) % len(self)
        src = np.array(self._src_ids[self._src_off[i] : self._src_off[i + 1]], dtype=np.int64)
        tgt = np.array(self._tgt_ids[self._tgt_off[i] : self._tgt_off[i + 1]], dtype=np.int64)
        return src, tgt

    def batch(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """The padded :class:`Batch` of these pairs; equal to ``collate_pairs`` of them."""
        idx = np.asarray(indices, dtype=np.int64)
        src_ids = _pad_rows(self._src_ids, self._src_off, idx, lead=None, tail=EOS_ID)
        tgt_in = _pad_rows(self._tgt_ids, self._tgt_off, idx, lead=BOS_ID, tail=None)
        tgt_out = _pad_rows(self._tgt_ids, self._tgt_off, idx, lead=None, tail=EOS_ID)
        for rows, lang, vocab in (
            (src_ids, self.src_lang, self.vocab_size),
            (tgt_out, self.tgt_lang, self.tgt_vocab_size),
        ):
            check_ids(rows, idx[:, None], vocab, self.data_dir, self.split, lang)
        src = torch.from_numpy(src_ids)
        return Batch(src, src == PAD_ID, torch.from_numpy(tgt_in), torch.from_numpy(tgt_out))

    def src_text_path(self) -> Path:
        return text_path(self.data_dir, self.split, self.src_lang)

    def tgt_text_path(self) -> Path:
        return text_path(self.data_dir, self.split, self.tgt_lang)

    def src_texts(self) -> list[str]:
        """The raw source sentences, aligned with the pair indices."""
        return read_lines(self.src_text_path())

    def tgt_texts(self) -> list[str]:
        """The raw target sentences (the original references), aligned with the pair indices."""
        return read_lines(self.tgt_text_path())


def check_ids(
    ids: np.ndarray, lines: np.ndarray, vocab_size: int, data_dir: Path, split: str, side: str
) -> None:
    """A :class:`UserError` naming the file and the sentence when token ids read from
    ``split``'s ``side`` (a language, or ``txt``) hold one outside the vocabulary: a damaged
    file, or one written with another tokenizer. ``lines``: the line of the split (from 0) of
    each id, broadcast to ``ids``' shape. A min and a max where the ids are good."""
    if not ids.size or (int(ids.min()) >= 0 and int(ids.max()) < vocab_size):
        return
    where = tuple(np.argwhere((ids < 0) | (ids >= vocab_size))[0])
    line = int(np.broadcast_to(lines, ids.shape)[where]) + 1
    bin_path = ids_paths(data_dir, split, side)[0]
    raise UserError(
        f"{bin_path}: the sentence of line {line} of {text_path(data_dir, split, side).name} "
        f"holds token id {int(ids[where])}, outside the vocabulary of {vocab_size}: the file "
        "is damaged or was written with another tokenizer; run `aiayn prepare` again with "
        "--force"
    )


def check_split(data_dir: Path, manifest: dict[str, Any], split: str) -> None:
    """A :class:`UserError` naming the splits there are when ``split`` is not one of them."""
    if split not in manifest.get("splits", {}):
        have = ", ".join(manifest.get("splits", {})) or "none"
        raise UserError(
            f"{manifest_path(data_dir)}: no {split!r} split in this data directory (it has: {have})"
        )


def open_ids(
    data_dir: Path, split: str, lang: str, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The token ids, offsets and lengths of one side of a split, memory-mapped; a
    :class:`UserError` where the files are missing or do not fit together."""
    bin_path, idx_path, len_path = ids_paths(data_dir, split, lang)
    try:
        offsets = np.load(idx_path, mmap_mode="r")
        lengths = np.load(len_path, mmap_mode="r")
        size = bin_path.stat().st_size
        if size % dtype.itemsize:
            raise UserError(f"{bin_path}: size {size} is not a multiple of {dtype.itemsize} bytes")
        # np.memmap refuses empty files; an empty split gets an empty array instead.
        ids = np.memmap(bin_path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    except FileNotFoundError as err:
        raise UserError(f"{err.filename}: missing; run `aiayn prepare` again") from None
    except ValueError as err:
        raise UserError(f"{data_dir}: damaged {split}.{lang} files ({err})") from None
    if len(offsets) != len(lengths) + 1 or (len(offsets) and int(offsets[-1]) != len(ids)):
        raise UserError(f"{data_dir}: {split}.{lang} offsets do not match the token file")
    return ids, offsets, lengths


def _pad_rows(
    flat: np.ndarray, offsets: np.ndarray, idx: np.ndarray, lead: int | None, tail: int | None
) -> np.ndarray:
    """Gather rows ``idx`` of a ragged array into a (B, T) int64 matrix with optional BOS/EOS."""
    starts = np.asarray(offsets[idx], dtype=np.int64)
    lengths = np.asarray(offsets[idx + 1], dtype=np.int64) - starts
    shift = 1 if lead is not None else 0
    width = int(lengths.max(initial=0)) + shift + (1 if tail is not None else 0)
    out = np.full((len(idx), width), PAD_ID, dtype=np.int64)
    if lead is not None:
        out[:, 0] = lead
    total = int(lengths.sum())
    if total:
        rows = np.repeat(np.arange(len(idx)), lengths)
        # Position of each token inside its sentence: 0..len-1, for all sentences at once.
        cols = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[rows, cols + shift] = flat[np.repeat(starts, lengths) + cols]
    if tail is not None:
        out[np.arange(len(idx)), lengths + shift] = tail
    return out


def read_lines(path: Path) -> list[str]:
    """A prepared text file's lines, split at newlines only, without their line ends."""
    try:
        with path.open(encoding="utf-8", newline="\n") as handle:
            return [line.rstrip("\n") for line in handle]
    except FileNotFoundError:
        raise UserError(f"{path}: missing; run `aiayn prepare` again") from None
