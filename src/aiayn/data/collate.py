"""Special token ids and the padded batch the model consumes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

import torch
from torch import Tensor

# Fixed ids shared by the sentencepiece model, the corpus files and the model.
PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
# "<mask>": a user-defined symbol of the tokenizers that `aiayn prepare --task lm|classify`
# trains (masked-language-model pre-training replaces chosen tokens with it).
MASK_ID = 4


@dataclass
class Batch:
    """A padded batch of sentence pairs.

    ``src_ids`` (B, S) is the source followed by EOS; ``src_pad`` (B, S) is True at padding;
    ``tgt_in`` (B, T) is BOS + y and ``tgt_out`` (B, T) is y + EOS, padded with PAD_ID.
    """

    src_ids: Tensor
    src_pad: Tensor
    tgt_in: Tensor
    tgt_out: Tensor

    @property
    def n_src_tokens(self) -> int:
        return int((~self.src_pad).sum())

    @property
    def n_tgt_tokens(self) -> int:
        return int((self.tgt_out != PAD_ID).sum())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.src_ids.to(device, non_blocking=True),
            self.src_pad.to(device, non_blocking=True),
            self.tgt_in.to(device, non_blocking=True),
            self.tgt_out.to(device, non_blocking=True),
        )


SequencesT = TypeVar("SequencesT", bound="_Sequences")


@dataclass
class _Sequences:
    """What the batches of one-sequence tasks share: ``inputs`` (B, T), padded with PAD_ID,
    and a second tensor of what is predicted; moved to a device together."""

    inputs: Tensor  # (B, T)

    @property
    def pad(self) -> Tensor:
        """(B, T), True at padding."""
        return self.inputs == PAD_ID

    @property
    def n_src_tokens(self) -> int:
        return int((self.inputs != PAD_ID).sum())

    def to(self: SequencesT, device: torch.device | str) -> SequencesT:
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)}
        return type(self)(**moved)


@dataclass
class TokenBatch(_Sequences):
    """A padded batch for a token-level task of one sequence: the language model (``inputs``
    are a span without its last token, ``targets`` the span shifted by one) or the masked
    language model (``inputs`` with the chosen tokens replaced, ``targets`` the original token
    at the chosen positions). ``targets`` is PAD_ID where no loss is taken."""

    targets: Tensor  # (B, T)

    @property
    def n_tgt_tokens(self) -> int:
        """Predictions the loss takes (the budget and normaliser of an update)."""
        return int((self.targets != PAD_ID).sum())


@dataclass
class LabelBatch(_Sequences):
    """A padded batch of labelled texts: ``inputs`` (B, T) are BOS + text + EOS (the BOS
    is the position a first-token classifier reads), ``labels`` (B,) class indices."""

    labels: Tensor

    @property
    def n_tgt_tokens(self) -> int:
        """Predictions the loss takes: one per text."""
        return int(self.labels.numel())


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int = PAD_ID) -> Tensor:
    """Right-pad integer sequences into a (B, max_len) long tensor."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for row, seq in enumerate(seqs):
        if len(seq):
            out[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    return out


def collate_pairs(
    src: Sequence[Sequence[int]], tgt: Sequence[Sequence[int]] | None = None
) -> Batch:
    """Pad token-id sequences (without BOS/EOS) into a :class:`Batch`.

    The source gets EOS appended; the target becomes BOS + y (``tgt_in``) and y + EOS
    (``tgt_out``). With ``tgt=None`` (translation), ``tgt_in``/``tgt_out`` are empty (B, 0).
    """
    src_ids = pad_sequences([[*s, EOS_ID] for s in src])
    src_pad = src_ids == PAD_ID
    if tgt is None:
        empty = torch.zeros(len(src), 0, dtype=torch.long)
        return Batch(src_ids, src_pad, empty, empty.clone())
    if len(tgt) != len(src):
        raise ValueError(f"{len(src)} source and {len(tgt)} target sequences")
    tgt_in = pad_sequences([[BOS_ID, *t] for t in tgt])
    tgt_out = pad_sequences([[*t, EOS_ID] for t in tgt])
    return Batch(src_ids, src_pad, tgt_in, tgt_out)
