"""The examples of the text tasks, cut from a :class:`TextCorpus`, and BERT's masking.

Every line of the corpus is a document ``BOS + ids + EOS``; the **stream** is their
concatenation, and an lm or mlm example is a span ``[start, end)`` of it:

* ``block_size == 0``: one example per document; a document longer than the model's
  ``max_positions`` is cut into consecutive pieces.
* ``pack="blocks"``: windows every ``block_size`` tokens across document boundaries.
* ``pack="documents"``: whole documents packed greedily, in order, into spans of at most a
  window; a document longer than a window is cut into pieces that stand alone.

A language-model (lm) span has one token more than its inputs (``inputs = span[:-1]``,
``targets = span[1:]``), so its windows are ``block_size + 1`` tokens long and start every
``block_size`` tokens (pieces of a document likewise overlap by one token): every token of the
stream after the first is a target exactly once. A target that is BOS is not predicted (it is
PAD_ID: where a document starts is not a property of the text before it). A masked-language-
model (mlm) span is its own input: windows of ``block_size`` tokens, documents cut into pieces
of at most ``max_positions``. Inside a packed span, attention sees across the EOS/BOS that
separate documents.

A classification example is one line, ``BOS + ids[: max_positions - 2] + EOS``, and its label.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from aiayn.data.collate import BOS_ID, EOS_ID, MASK_ID, PAD_ID, LabelBatch, TokenBatch
from aiayn.data.corpus import check_ids
from aiayn.data.text.corpus import TEXT_SUFFIX, TextCorpus
from aiayn.errors import ConfigError, UserError

EXAMPLE_TASKS = ("lm", "mlm", "classify")
PACKINGS = ("blocks", "documents")
# Ids below this are special (PAD, UNK, BOS, EOS, MASK): never chosen for masking, never drawn
# as a random replacement.
FIRST_ORDINARY_ID = MASK_ID + 1
# BERT's replacement of a chosen token: MASK_ID with this probability, a random token with
# RANDOM_SHARE, unchanged with the rest (80/10/10).
MASK_SHARE = 0.8
RANDOM_SHARE = 0.1


def mask_tokens(
    ids: Tensor,
    vocab_size: int,
    mask_prob: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """BERT's masking of a batch of token ids: ``(inputs, targets)``, both shaped as ``ids``.

    Each position holding an ordinary token (id >= ``FIRST_ORDINARY_ID``: never padding, UNK,
    BOS, EOS or MASK) is chosen independently with probability ``mask_prob``. A chosen token
    becomes MASK_ID with probability 0.8, a uniformly random ordinary token with 0.1, and stays
    as it is with 0.1; ``targets`` holds the original token at the chosen positions and PAD_ID
    everywhere else. The draws come from ``generator`` (None: torch's global RNG of the device).
    """
    if not 0 < mask_prob <= 1:
        raise ValueError(f"mask_prob must be in (0, 1], got {mask_prob}")
    if vocab_size <= FIRST_ORDINARY_ID:
        raise ValueError(f"vocab_size {vocab_size} has no ordinary tokens to draw from")
    shape, device = ids.shape, ids.device
    chosen = torch.rand(shape, generator=generator, device=device) < mask_prob
    chosen &= ids >= FIRST_ORDINARY_ID
    how = torch.rand(shape, generator=generator, device=device)
    random_ids = torch.randint(
        FIRST_ORDINARY_ID, vocab_size, shape, generator=generator, device=device, dtype=ids.dtype
    )
    inputs = torch.where(chosen & (how < MASK_SHARE), MASK_ID, ids)
    inputs = torch.where(chosen & (how >= 1 - RANDOM_SHARE), random_ids, inputs)
    return inputs, torch.where(chosen, ids, PAD_ID)


class TextExamples:
    """The training or validation examples of ``task`` ("lm", "mlm" or "classify") on a corpus.

    ``lengths[i]`` is the number of input tokens of example ``i`` (np.int64), for the
    token-budget sampler: ``TokenBatchSampler(lengths, lengths, max_tokens, ...)``. No example
    has more than ``max_positions`` inputs, nor more than ``block_size`` when it is not 0.
    ``starts``/``ends`` locate the lm and mlm spans in the stream (for classify: the kept
    ``BOS + ids`` of each line, EOS following).
    """

    def __init__(
        self,
        corpus: TextCorpus,
        task: str,
        *,
        block_size: int,
        pack: str = "blocks",
        max_positions: int,
        mask_prob: float = 0.15,
    ) -> None:
        _check_options(task, block_size, pack, max_positions, mask_prob)
        self.corpus = corpus
        self.task = task
        self.mask_prob = float(mask_prob)
        self._doc_lengths = np.asarray(corpus.lengths, dtype=np.int64)
        # Where document i (BOS + ids + EOS) starts in the stream.
        self._doc_starts = np.asarray(corpus.offsets[:-1], dtype=np.int64) + 2 * np.arange(
            len(corpus), dtype=np.int64
        )
        doc_ends = self._doc_starts + self._doc_lengths + 2
        if task == "classify":
            if corpus.labels is None:
                raise UserError(
                    f"{corpus.data_dir} has no labels (prepared for the {corpus.task} task); "
                    "classification needs data prepared with `aiayn prepare --task classify`"
                )
            self.starts = self._doc_starts
            self.ends = self._doc_starts + np.minimum(self._doc_lengths, max_positions - 2) + 1
            self.lengths = self.ends - self.starts + 1
            return
        overlap = 1 if task == "lm" else 0  # an lm span is one token longer than its inputs
        step = block_size or max_positions
        if block_size == 0:
            ranges = self._doc_starts, doc_ends
        elif pack == "blocks":
            stream_end = int(doc_ends[-1]) if len(doc_ends) else 0
            ranges = np.zeros(1, np.int64), np.full(1, stream_end, np.int64)
        else:
            ranges = _pack_documents(self._doc_starts, doc_ends, step + overlap)
        self.starts, self.ends = _cut(*ranges, step, step + overlap)
        self.lengths = self.ends - self.starts - overlap

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(
        self, indices: Sequence[int] | np.ndarray, generator: torch.Generator | None = None
    ) -> TokenBatch | LabelBatch:
        """The padded batch of these examples: a :class:`TokenBatch` (lm, mlm) or a
        :class:`LabelBatch` (classify). The same indices give the same batch, except for the
        mlm masking, drawn from ``generator`` (None: torch's global CPU RNG)."""
        idx = np.asarray(indices, dtype=np.int64)
        spans = self._gather(self.starts[idx], self.ends[idx])
        if self.task == "classify":
            assert self.corpus.labels is not None
            inputs = np.pad(spans, ((0, 0), (0, 1)), constant_values=PAD_ID)
            inputs[np.arange(len(idx)), self.lengths[idx] - 1] = EOS_ID
            labels = np.asarray(self.corpus.labels[idx], dtype=np.int64)
            return LabelBatch(torch.from_numpy(inputs), torch.from_numpy(labels))
        if self.task == "mlm":
            ids = torch.from_numpy(spans)
            return TokenBatch(*mask_tokens(ids, self.corpus.vocab_size, self.mask_prob, generator))
        targets = spans[:, 1:].copy()
        targets[targets == BOS_ID] = PAD_ID
        inputs = spans[:, :-1].copy()
        # The last token of a span is a target only; shorter spans end in padding already.
        inputs[np.arange(inputs.shape[1]) >= self.lengths[idx][:, None]] = PAD_ID
        return TokenBatch(torch.from_numpy(inputs), torch.from_numpy(targets))

    def _gather(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Stream tokens ``[starts[b], ends[b])`` as a (B, T) int64 matrix padded with PAD_ID."""
        lengths = ends - starts
        out = np.full((len(starts), int(lengths.max(initial=0))), PAD_ID, dtype=np.int64)
        total = int(lengths.sum())
        if not total:
            return out
        rows = np.repeat(np.arange(len(starts)), lengths)
        cols = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        position = np.repeat(starts, lengths) + cols
        doc = np.searchsorted(self._doc_starts, position, side="right") - 1
        within = position - self._doc_starts[doc]  # 0: BOS, 1..len: the ids, len + 1: EOS
        tokens = np.where(within == 0, BOS_ID, EOS_ID)
        inner = (within > 0) & (within <= self._doc_lengths[doc])
        flat = np.asarray(self.corpus.offsets[doc[inner]], dtype=np.int64) + within[inner] - 1
        corpus = self.corpus
        ids = np.asarray(corpus.token_ids[flat])
        check_ids(ids, doc[inner], corpus.vocab_size, corpus.data_dir, corpus.split, TEXT_SUFFIX)
        tokens[inner] = ids
        out[rows, cols] = tokens
        return out


def _check_options(
    task: str, block_size: int, pack: str, max_positions: int, mask_prob: float
) -> None:
    if task not in EXAMPLE_TASKS:
        raise ConfigError(f"unknown text task {task!r}; choose one of {', '.join(EXAMPLE_TASKS)}")
    if pack not in PACKINGS:
        raise ConfigError(f"unknown packing {pack!r}; choose one of {', '.join(PACKINGS)}")
    if max_positions < (3 if task == "classify" else 1):
        raise ConfigError(f"max_positions={max_positions} leaves no room for text")
    if not 0 <= block_size <= max_positions:
        raise ConfigError(
            f"block_size={block_size} must be 0 (one example per document) or at most "
            f"max_positions={max_positions}"
        )
    if task == "mlm" and not 0 < mask_prob <= 1:
        raise ConfigError(f"mask_prob must be in (0, 1], got {mask_prob}")


def _pack_documents(
    doc_starts: np.ndarray, doc_ends: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive documents packed greedily into ranges of at most ``width`` stream tokens;
    a document longer than that is a range of its own (cut by :func:`_cut`)."""
    starts: list[int] = []
    ends: list[int] = []
    start = 0  # the current pack is [start, this document's start)
    for doc_start, doc_end in zip(doc_starts.tolist(), doc_ends.tolist(), strict=True):
        if doc_start > start and doc_end - start > width:
            starts.append(start)
            ends.append(doc_start)
            start = doc_start
        if doc_end - doc_start > width:
            starts.append(doc_start)
            ends.append(doc_end)
            start = doc_end
    if len(doc_ends) and int(doc_ends[-1]) > start:
        starts.append(start)
        ends.append(int(doc_ends[-1]))
    return np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)


def _cut(
    starts: np.ndarray, ends: np.ndarray, step: int, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """Spans of at most ``width`` tokens starting every ``step`` tokens within each range
    ``[starts[r], ends[r])``; a last, shorter span is kept if it has at least
    ``width - step + 1`` tokens (so spans that overlap by one cover every pair of neighbours)."""
    least = width - step + 1
    counts = np.maximum((ends - starts - least) // step + 1, 0)
    total = int(counts.sum())
    k = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    span_starts = np.repeat(starts, counts) + k * step
    return span_starts, np.minimum(span_starts + width, np.repeat(ends, counts))
