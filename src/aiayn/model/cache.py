"""The incremental decoder's state: preallocated self-attention K/V and projected memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LayerCache:
    """One decoder layer's cached tensors.

    ``self_k``/``self_v`` are preallocated to ``max_len`` positions and written in place;
    ``cross_k``/``cross_v`` are the encoder memory projected once.
    """

    self_k: Tensor  # (B, H, max_len, Dk)
    self_v: Tensor  # (B, H, max_len, Dv)
    cross_k: Tensor  # (B, H, S, Dk)
    cross_v: Tensor  # (B, H, S, Dv)


@dataclass
class DecoderCache:
    """State of an incremental decode over a batch of B rows.

    ``length`` positions have been decoded so far; the next ``decode_step`` writes position
    ``length``. ``reorder(rows)`` gathers rows (beam search: each new beam takes the state of
    the beam it extends); ``keep(rows)`` drops the rows not listed (finished sentences), so the
    work shrinks as sentences finish.
    """

    layers: list[LayerCache]
    cross_mask: Tensor | None  # (B, 1, 1, S), True = attend; None when no source padding
    length: int
    max_len: int

    @property
    def batch_size(self) -> int:
        return self.layers[0].self_k.size(0)

    def _gather(self, rows: Tensor) -> None:
        t = self.length
        for layer in self.layers:
            # Only the filled prefix of the preallocated buffers carries information.
            layer.self_k[: rows.numel(), :, :t] = layer.self_k[rows, :, :t]
            layer.self_v[: rows.numel(), :, :t] = layer.self_v[rows, :, :t]
            layer.cross_k = layer.cross_k.index_select(0, rows)
            layer.cross_v = layer.cross_v.index_select(0, rows)
        if self.cross_mask is not None:
            self.cross_mask = self.cross_mask.index_select(0, rows)

    def reorder(self, rows: Tensor) -> None:
        """Row i of the cache becomes old row ``rows[i]`` (same batch size)."""
        if rows.numel() != self.batch_size:
            raise ValueError(
                f"reorder expects {self.batch_size} row indices, got {rows.numel()}; "
                "use keep() to change the batch size"
            )
        self._gather(rows)

    def keep(self, rows: Tensor) -> None:
        """Keep only ``rows`` (in that order); the batch shrinks to ``len(rows)``."""
        n = rows.numel()
        if n > self.batch_size:
            raise ValueError(f"keep got {n} rows for a batch of {self.batch_size}")
        self._gather(rows)
        for layer in self.layers:
            layer.self_k = layer.self_k[:n]
            layer.self_v = layer.self_v[:n]


def empty_self_kv(
    batch: int, n_heads: int, max_len: int, d_k: int, d_v: int, like: Tensor
) -> tuple[Tensor, Tensor]:
    """Preallocated (uninitialised) self-attention key and value buffers for one layer."""
    k = torch.empty(batch, n_heads, max_len, d_k, dtype=like.dtype, device=like.device)
    v = torch.empty(batch, n_heads, max_len, d_v, dtype=like.dtype, device=like.device)
    return k, v
