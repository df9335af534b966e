"""BPE-dropout: the training pairs segmented anew for every batch (Provilkov et al., 2020).

With ``data.bpe_dropout = p`` every merge of the BPE vocabulary is skipped with probability p
while a training sentence is segmented, so that a word is seen in many segmentations and the
model learns its pieces as well as its whole form. Validation and translation keep the one
deterministic segmentation. Off (0) by default: the paper segments once.

The samples are drawn by sentencepiece from a seed made of the run's seed, the epoch and the
batch's pair indices: within a process, the same batch draws the same samples. sentencepiece's
draws for a seed differ from one process to the next, so a resumed run (or the same command
run again) segments otherwise than the uninterrupted one.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from aiayn.data.collate import Batch, collate_pairs
from aiayn.data.corpus import Corpus
from aiayn.data.tokenizer import PieceVocabTokenizer, Tokenizer, spm_model_type
from aiayn.errors import ConfigError

# sentencepiece's "no seed" value (its default seed): setting it leaves the generator as it is.
_SEEDS = 0xFFFFFFFF


def check_bpe_dropout(dropout: float, tokenizer: Tokenizer) -> None:
    """Refuse ``data.bpe_dropout`` for a vocabulary it does not apply to (a unigram, char or
    word model, or an imported model's separate vocabularies)."""
    if isinstance(tokenizer, PieceVocabTokenizer):
        what = "an imported model's vocabularies"
    else:
        kind = spm_model_type(tokenizer.to_bytes())
        if kind == "bpe":
            return
        what = f"a {kind} vocabulary"
    raise ConfigError(
        f"data.bpe_dropout={dropout} needs a BPE vocabulary (aiayn prepare's default), not {what}"
    )


class TextLines:
    """The lines of a UTF-8 text file by index, read through a memory map (a large corpus
    costs its offsets in memory, 8 bytes a line, not a Python string a line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.stat().st_size == 0:
            self._bytes = np.zeros(0, dtype=np.uint8)
        else:
            self._bytes = np.memmap(path, dtype=np.uint8, mode="r")
        ends = np.flatnonzero(self._bytes == ord("\n"))
        if len(self._bytes) and (not len(ends) or ends[-1] != len(self._bytes) - 1):
            ends = np.append(ends, len(self._bytes))  # a last line without a newline
        self._starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        self._ends = ends.astype(np.int64)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int) -> str:
        return bytes(self._bytes[self._starts[i] : self._ends[i]]).decode("utf-8")


class BpeDropoutPairs:
    """The pairs of a training :class:`~aiayn.data.corpus.Corpus`, each batch segmented with
    BPE-dropout ``dropout`` from the prepared sentences (``DATA_DIR/train.{lang}``).

    Batches are cut by the prepared lengths, so a batch holds the same sentences as without
    sampling, and more tokens (about 40% more at p = 0.1 on Multi30k's 8k vocabulary). A
    sentence whose sample is longer than ``max_len`` tokens on either side keeps its prepared
    ids on both (``max_len``: the length ``aiayn prepare`` let through, or what the model's
    positions hold if that is less).
    """

    def __init__(
        self, corpus: Corpus, tokenizer: Tokenizer, dropout: float, seed: int, max_len: int
    ) -> None:
        if not 0.0 < dropout < 1.0:
            raise ValueError(f"bpe dropout must be in (0, 1), got {dropout}")
        self.corpus = corpus
        self.tokenizer = tokenizer
        self.dropout = float(dropout)
        self.seed = int(seed)
        self.max_len = int(max_len)
        self.epoch = 0
        self.src_texts = TextLines(corpus.src_text_path())
        self.tgt_texts = TextLines(corpus.tgt_text_path())
        if len(self.src_texts) != len(corpus) or len(self.tgt_texts) != len(corpus):
            raise ConfigError(
                f"{corpus.src_text_path()} and {corpus.tgt_text_path()} do not hold the "
                f"{len(corpus)} sentences of the prepared ids; run `aiayn prepare` again"
            )

    def __len__(self) -> int:
        return len(self.corpus)

    @property
    def src_lengths(self) -> np.ndarray:
        return self.corpus.src_lengths

    @property
    def tgt_lengths(self) -> np.ndarray:
        return self.corpus.tgt_lengths

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose batches come next (part of each batch's seed)."""
        self.epoch = int(epoch)

    def batch_seed(self, indices: np.ndarray) -> int:
        """The sampling seed of one batch's source side (its target side: the next one): the
        run's seed, the epoch and the pair indices."""
        head = np.array([self.seed, self.epoch], dtype=np.int64).tobytes()
        return zlib.crc32(head + indices.astype(np.int64).tobytes()) % _SEEDS

    def batch(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """The padded :class:`Batch` of these pairs, each side freshly segmented."""
        idx = np.asarray(indices, dtype=np.int64)
        seed = self.batch_seed(idx)
        sample = self.tokenizer.sample_batch
        src = sample([self.src_texts[i] for i in idx], self.dropout, seed)
        tgt = sample([self.tgt_texts[i] for i in idx], self.dropout, (seed + 1) % _SEEDS)
        for row, i in enumerate(idx.tolist()):
            if len(src[row]) > self.max_len or len(tgt[row]) > self.max_len:
                prepared_src, prepared_tgt = self.corpus.pair(i)
                src[row], tgt[row] = prepared_src.tolist(), prepared_tgt.tolist()
        return collate_pairs(src, tgt)
