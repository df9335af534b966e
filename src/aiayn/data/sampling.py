"""BPE-dropout: the training pairs segmented anew for every batch (Provilkov et al., 2020).

With ``data.bpe_dropout = p`` every merge of the BPE vocabulary is skipped with probability p
while a training sentence is segmented, so that a word is seen in many segmentations and the
model learns its pieces as well as its whole form. Validation and translation keep the one
deterministic segmentation. Off (0) by default: the paper segments once.

The samples are drawn by sentencepiece from a seed made of the run's seed, the epoch and the
batch's pair indices, so a resumed run draws exactly what the uninterrupted one did.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from aiayn.data.collate import Batch, collate_pairs
from aiayn.data.corpus import Corpus
from aiayn.data.tokenizer import PieceVocabTokenizer, Tokenizer
from aiayn.errors import ConfigError


def check_bpe_dropout(dropout: float, manifest: dict[str, Any], tokenizer: Tokenizer) -> None:
    """Refuse ``data.bpe_dropout`` for a vocabulary it does not apply to (a unigram, char or
    word model, or an imported model's separate vocabularies)."""
    kind = manifest.get("tokenizer_options", {}).get("model_type", "bpe")
    if isinstance(tokenizer, PieceVocabTokenizer) or kind != "bpe":
        what = "an imported model's vocabularies" if kind == "bpe" else f"a {kind} vocabulary"
        raise ConfigError(
            f"data.bpe_dropout={dropout} needs a BPE vocabulary (aiayn prepare's default), "
            f"not {what}"
        )


class BpeDropoutPairs:
    """The pairs of a training :class:`~aiayn.data.corpus.Corpus`, each batch segmented with
    BPE-dropout ``dropout`` from the raw sentences (``DATA_DIR/train.{lang}``).

    Batching still uses the deterministic lengths, so a batch holds the same sentences as
    without sampling; its token count grows with the extra pieces (about 40% at p = 0.1 on
    Multi30k's 8k vocabulary). A sentence whose sample would exceed ``max_len`` tokens keeps its
    deterministic ids, so no batch holds a sentence longer than ``aiayn prepare`` let through.
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
        self.src_texts = corpus.src_texts()
        self.tgt_texts = corpus.tgt_texts()
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
        """The sampling seed of one batch: the run's seed, the epoch and the pair indices."""
        head = np.array([self.seed, self.epoch], dtype=np.int64).tobytes()
        return zlib.crc32(head + indices.astype(np.int64).tobytes())

    def batch(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """The padded :class:`Batch` of these pairs, each side freshly segmented."""
        idx = np.asarray(indices, dtype=np.int64)
        seed = self.batch_seed(idx)
        sample = self.tokenizer.sample_batch
        src = sample([self.src_texts[i] for i in idx], self.dropout, seed)
        tgt = sample([self.tgt_texts[i] for i in idx], self.dropout, (seed + 1) % 2**32)
        for row, i in enumerate(idx.tolist()):
            if len(src[row]) > self.max_len or len(tgt[row]) > self.max_len:
                fixed_src, fixed_tgt = self.corpus.pair(i)
                src[row], tgt[row] = fixed_src.tolist(), fixed_tgt.tolist()
        return collate_pairs(src, tgt)
