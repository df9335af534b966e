"""The incremental decoder's state: preallocated self-attention K/V and projected memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LayerCache:
    """One decoder layer's cached tensors.

    ``self_k``/``self_v`` are preallocated to ``max_len`` positions and written in place;
    ``cross_k``/``cross_v`` are the encoder memory projected once, one row per *sentence*
    (shared by the ``beam_size`` decoder rows of that sentence). ``spare_k``/``spare_v`` are
    the second buffers that a reorder gathers into (allocated on the first reorder).
    """

    self_k: Tensor  # (rows, H, max_len, Dk)
    self_v: Tensor  # (rows, H, max_len, Dv)
    cross_k: Tensor  # (sentences, H, S, Dk)
    cross_v: Tensor  # (sentences, H, S, Dv)
    spare_k: Tensor | None = None
    spare_v: Tensor | None = None

    def gather_self(self, rows: Tensor, length: int) -> None:
        """Decoder row i takes the first ``length`` keys and values of old row ``rows[i]``.

        One pass: ``index_select`` writes straight into the spare buffer, which then becomes
        the live one (a gather in place would need a temporary and a second copy).
        """
        n = rows.numel()
        if self.spare_k is None or self.spare_v is None:
            self.spare_k, self.spare_v = (
                torch.empty_like(self.self_k),
                torch.empty_like(self.self_v),
            )
        t = length
        torch.index_select(self.self_k[:, :, :t], 0, rows, out=self.spare_k[:n, :, :t])
        torch.index_select(self.self_v[:, :, :t], 0, rows, out=self.spare_v[:n, :, :t])
        self.self_k, self.spare_k = self.spare_k[:n], self.self_k
        self.self_v, self.spare_v = self.spare_v[:n], self.self_v


@dataclass
class DecoderCache:
    """State of an incremental decode over ``rows`` decoder rows.

    ``length`` positions have been decoded so far; the next ``decode_step`` writes position
    ``length``. Rows come in groups of ``beam_size`` per source sentence (rows
    ``i * beam_size .. (i + 1) * beam_size - 1`` belong to sentence i), and the sentence's
    projected memory is stored once for the group.

    ``reorder(rows)`` gathers rows (beam search: each new beam takes the state of the beam it
    extends); with ``beam_size > 1`` every row must stay within its sentence's group, as beam
    search guarantees, and the memory is left in place. ``keep(rows)`` drops the rows not
    listed (finished sentences, whole groups at a time), so the work shrinks as sentences
    finish.
    """

    layers: list[LayerCache]
    cross_mask: Tensor | None  # (sentences, 1, 1, S), True = attend; None when no padding
    length: int
    max_len: int
    beam_size: int = 1

    @property
    def batch_size(self) -> int:
        """Decoder rows (sentences × beam_size)."""
        return self.layers[0].self_k.size(0)

    def reorder(self, rows: Tensor) -> None:
        """Row i of the cache becomes old row ``rows[i]`` (same number of rows)."""
        if rows.numel() != self.batch_size:
            raise ValueError(
                f"reorder expects {self.batch_size} row indices, got {rows.numel()}; "
                "use keep() to change the batch size"
            )
        for layer in self.layers:
            layer.gather_self(rows, self.length)
        if self.beam_size == 1:
            self._gather_memory(rows)

    def keep(self, rows: Tensor) -> None:
        """Keep only ``rows`` (in that order); the batch shrinks to ``len(rows)``. With
        ``beam_size > 1``, ``rows`` lists whole groups: ``beam_size`` rows per kept sentence."""
        n = rows.numel()
        if n > self.batch_size:
            raise ValueError(f"keep got {n} rows for a batch of {self.batch_size}")
        if n % self.beam_size != 0:
            raise ValueError(f"keep needs whole groups of {self.beam_size} rows, got {n}")
        for layer in self.layers:
            layer.gather_self(rows, self.length)
        sentences = rows[:: self.beam_size] // self.beam_size if self.beam_size > 1 else rows
        self._gather_memory(sentences)

    def _gather_memory(self, sentences: Tensor) -> None:
        for layer in self.layers:
            layer.cross_k = layer.cross_k.index_select(0, sentences)
            layer.cross_v = layer.cross_v.index_select(0, sentences)
        if self.cross_mask is not None:
            self.cross_mask = self.cross_mask.index_select(0, sentences)


def empty_self_kv(
    batch: int, n_heads: int, max_len: int, d_k: int, d_v: int, like: Tensor
) -> tuple[Tensor, Tensor]:
    """Preallocated (uninitialised) self-attention key and value buffers for one layer."""
    k = torch.empty(batch, n_heads, max_len, d_k, dtype=like.dtype, device=like.device)
    v = torch.empty(batch, n_heads, max_len, d_v, dtype=like.dtype, device=like.device)
    return k, v
