"""The incremental decoder's state: preallocated self-attention K/V and projected memory.

Rows come in groups of ``beam_size`` per source sentence. Everything is stored per sentence:
the projected memory once, and the self-attention keys and values of all of a sentence's
beams side by side, ``(sentences, H, max_len, beam_size, Dh)``: slot ``b`` at position ``j``
holds what beam ``b`` computed at step ``j``, and is never moved.

Beam search makes each new beam continue some old beam of its sentence, so a beam's history
is spread over the slots: ``lineage[row, j]`` is the slot that holds the row's position ``j``.
Reordering the beams reorders ``lineage`` (one index per row and position) instead of
copying every cached key and value, and self-attention looks at all ``beam_size × (t + 1)``
stored keys of the sentence with a mask that leaves each row its own lineage (see
:meth:`DecoderCache.self_attention_mask`). The sentence's keys are read once for its beams
together, as in cross-attention.

A decoder whose self-attention sees a window (``local``, ``longformer``: the ``w`` previous
positions and the first ``g``) keeps a ring of ``g + w + 1`` slots per beam instead of
``max_len`` (``DecoderCache.ring``): position ``j`` goes to slot ``j`` below ``g`` and to slot
``g + (j - g) mod (w + 1)`` above, overwriting the position that has just left the window, so
the filled slots are exactly the keys the window sees. The lineage is kept per slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LayerCache:
    """One decoder layer's cached tensors, one row per *sentence*.

    ``self_k``/``self_v`` are preallocated to ``max_len`` positions and written in place, one
    slot per beam; ``cross_k``/``cross_v`` are the encoder memory projected once (with
    ``model.cross_attention = "linformer"``, to k rows along the sequence: S is then k).
    """

    self_k: Tensor  # (sentences, H, max_len, beam, Dk)
    self_v: Tensor  # (sentences, H, max_len, beam, Dv)
    # None in a decoder-only model (no cross-attention).
    cross_k: Tensor | None  # (sentences, H, S, Dk)
    cross_v: Tensor | None  # (sentences, H, S, Dv)

    def write(self, slot: int, k: Tensor, v: Tensor) -> None:
        """Store the keys/values (sentences, H, beam, Dh) of a step at ``slot`` (its position,
        or its place in a ring: :meth:`DecoderCache.slot`)."""
        self.self_k[:, :, slot] = k
        self.self_v[:, :, slot] = v

    def keys_values(self, length: int) -> tuple[Tensor, Tensor]:
        """Slots ``0 .. length - 1`` of every beam: (sentences, H, length × beam, Dh)
        views, slot-major (key ``j * beam + b`` is beam slot b's slot j)."""
        return (
            self.self_k[:, :, :length].flatten(2, 3),
            self.self_v[:, :, :length].flatten(2, 3),
        )

    def select(self, moves: tuple[Tensor, Tensor] | None, n: int, length: int) -> None:
        """Keep ``n`` sentences, after ``moves`` (see :func:`keep_rows`); of the
        self-attention buffers only the ``length`` positions written so far are copied."""
        self.self_k = keep_rows(self.self_k, moves, n, length)
        self.self_v = keep_rows(self.self_v, moves, n, length)
        if self.cross_k is not None and self.cross_v is not None:
            self.cross_k = keep_rows(self.cross_k, moves, n)
            self.cross_v = keep_rows(self.cross_v, moves, n)


def row_moves(rows: Tensor) -> tuple[Tensor, Tensor] | None:
    """The moves that keep ``rows`` (in that order) of a batch: ``(dst, src)``, the places
    ``i`` where row ``rows[i]`` is not already, and those rows; None where every kept row
    stays where it is (:func:`keep_rows`)."""
    order = rows.tolist()  # one host sync for every buffer the moves are applied to
    dst = [i for i, row in enumerate(order) if row != i]
    if not dst:
        return None
    places = torch.tensor(dst, device=rows.device)
    return places, rows[places]


def keep_rows(
    buffer: Tensor, moves: tuple[Tensor, Tensor] | None, n: int, length: int | None = None
) -> Tensor:
    """The first ``n`` rows of ``buffer`` after copying rows ``src`` to rows ``dst``
    (``moves = (dst, src)``; of a self-attention buffer only positions ``:length``).

    In place: a batch's cache is allocated once, and only the rows that change place are
    copied (the gather reads them all before any is written, so any order is safe). Search
    keeps a sentence where it is and fills the place of a finished one from the end of the
    batch, so that a step where a few sentences finish moves a few rows, not the batch.
    With autograd recording, a gather into a new tensor instead (the cross-attention keys and
    values are then views that autograd does not let change in place)."""
    if moves is None:
        return buffer[:n]
    dst, src = moves
    if buffer.requires_grad and torch.is_grad_enabled():
        rows = torch.arange(n, device=buffer.device)
        rows[dst] = src
        return buffer.index_select(0, rows)
    if length is None:
        buffer[dst] = buffer[src]
    else:
        buffer[dst, :, :length] = buffer[src, :, :length]
    return buffer[:n]


@dataclass
class DecoderCache:
    """State of an incremental decode over ``rows`` = sentences × ``beam_size`` decoder rows.

    ``length`` positions have been decoded so far; the next ``decode_step`` writes position
    ``length``. Rows ``i * beam_size .. (i + 1) * beam_size - 1`` belong to sentence i.

    ``reorder(rows)`` gathers rows (beam search: each new beam takes the state of the beam it
    extends); with ``beam_size > 1`` every row must stay within its sentence's group, as beam
    search guarantees, and only ``lineage`` moves. ``keep(rows)`` drops the rows not listed
    (finished sentences, whole groups at a time), so the work shrinks as sentences finish.
    """

    layers: list[LayerCache]
    # (sentences, 1, 1, S), True = attend; None when no padding (or Linformer's projected rows)
    cross_mask: Tensor | None
    length: int
    max_len: int
    beam_size: int = 1
    # (rows, capacity): the beam slot holding each row's key and value at each position (of
    # the ring: at each ring slot); None with one beam per sentence (a row's history is then
    # its own slot).
    lineage: Tensor | None = None
    # (g, w + 1): the positions a windowed self-attention keeps, in a ring (the module
    # docstring); None: every position.
    ring: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.beam_size > 1 and self.lineage is None:
            # Each position is set to the row's own slot by the step that writes it
            # (self_attention_mask), before anything reads it.
            rows = self.layers[0].self_k.size(0) * self.beam_size
            device = self.layers[0].self_k.device
            self.lineage = torch.zeros(rows, self.capacity, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        """Slots per beam: ``max_len``, or the ring's ``g + w + 1``."""
        return self.max_len if self.ring is None else sum(self.ring)

    def slot(self, position: int) -> int:
        """Where position ``position`` is stored."""
        if self.ring is None or position < self.ring[0]:
            return position
        first, size = self.ring
        return first + (position - first) % size

    def filled(self, length: int) -> int:
        """Slots holding the first ``length`` positions (the window's, in a ring)."""
        return min(length, self.capacity)

    @property
    def batch_size(self) -> int:
        """Decoder rows (sentences × beam_size)."""
        return self.layers[0].self_k.size(0) * self.beam_size

    def self_attention_mask(self) -> Tensor | None:
        """For the step that writes position ``length``: an additive mask (sentences, 1,
        beam, filled × beam; filled = length + 1, or the ring's slots), 0 where row b of a
        sentence may attend (the slots of its lineage) and -inf elsewhere; None with one beam
        per sentence.

        Every row's own new key is in its own slot, so ``lineage[:, length]`` is first reset
        to the row's slot.
        """
        if self.lineage is None:
            return None
        k, t = self.beam_size, self.filled(self.length + 1)
        rows = self.lineage.size(0)
        slots = torch.arange(k, device=self.lineage.device)
        self.lineage[:, self.slot(self.length)] = slots.repeat(rows // k)
        own = self.lineage[:, :t, None] == slots  # (rows, t, K): position j's key is slot b
        mask = torch.zeros(own.shape, dtype=self.layers[0].self_k.dtype, device=own.device)
        mask.masked_fill_(~own, float("-inf"))
        return mask.view(rows // k, 1, k, t * k)

    def reorder(self, rows: Tensor) -> None:
        """Row i of the cache becomes old row ``rows[i]`` (same number of rows)."""
        if rows.numel() != self.batch_size:
            raise ValueError(
                f"reorder expects {self.batch_size} row indices, got {rows.numel()}; "
                "use keep() to change the batch size"
            )
        if self.lineage is not None:
            self.lineage = self.lineage.index_select(0, rows)
        else:
            self._select(rows)

    def keep(self, rows: Tensor) -> None:
        """Keep only ``rows`` (in that order); the batch shrinks to ``len(rows)``. With
        ``beam_size > 1``, ``rows`` lists whole groups: ``beam_size`` rows per kept sentence."""
        n = rows.numel()
        if n > self.batch_size:
            raise ValueError(f"keep got {n} rows for a batch of {self.batch_size}")
        if n % self.beam_size != 0:
            raise ValueError(f"keep needs whole groups of {self.beam_size} rows, got {n}")
        if self.lineage is not None:
            self.lineage = self.lineage.index_select(0, rows)
            self._select(rows[:: self.beam_size] // self.beam_size)
        else:
            self._select(rows)

    def _select(self, sentences: Tensor) -> None:
        moves = row_moves(sentences)
        for layer in self.layers:
            layer.select(moves, sentences.numel(), self.filled(self.length))
        if self.cross_mask is not None:
            self.cross_mask = self.cross_mask.index_select(0, sentences)


def empty_self_kv(
    sentences: int, n_heads: int, max_len: int, beam_size: int, d_k: int, d_v: int, like: Tensor
) -> tuple[Tensor, Tensor]:
    """Preallocated (uninitialised) self-attention key and value buffers for one layer, in
    the dtype and on the device of ``like`` (the layer's projected cross-attention keys)."""
    shape = (sentences, n_heads, max_len, beam_size)
    k = torch.empty(*shape, d_k, dtype=like.dtype, device=like.device)
    v = torch.empty(*shape, d_v, dtype=like.dtype, device=like.device)
    return k, v
