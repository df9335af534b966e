"""Dropout with a quarter of the random draws, and the residual add fused with it (CPU).

``F.dropout`` on the CPU draws one float per element from the Mersenne Twister, on one
thread. Here one 64-bit draw serves four elements: each 16-bit quarter is compared with a
threshold, an independent Bernoulli keep mask per element with the drop probability rounded
to a multiple of 2⁻¹⁶ (0.1 becomes 6,554 / 65,536 = 0.10000610; kept elements are scaled by
the exact 1 / (1 - that), so the expectation is unchanged). A p that the grid would move by
more than 0.1% of itself (below ≈ 0.008) goes to ``F.dropout``. Figures: docs/performance.md.

:class:`GridDropout` replaces ``nn.Dropout``; :class:`GridResidual` replaces the model's
:class:`~aiayn.model.layers.Residual` (``x + Dropout(y)``) with one ``addcmul`` whose mask is
made in the activations' dtype, so that neither pass converts a bool mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.model.layers import Residual

_LEVELS = 1 << 16  # the drop probability's resolution: one 16-bit quarter of a draw each


def _drop_level(p: float) -> int:
    # Below 1 for any p < 1, so that the kept elements' scale stays finite.
    return min(round(p * _LEVELS), _LEVELS - 1)


def drop_probability(p: float) -> float:
    """The drop probability :func:`keep_mask` realises for ``p``: a multiple of 2⁻¹⁶
    (at most 1 - 2⁻¹⁶)."""
    return _drop_level(p) / _LEVELS


def _grid_probability(p: float, device: torch.device) -> float | None:
    """``drop_probability(p)`` where :func:`keep_mask` serves: on the CPU, for a p that the
    2⁻¹⁶ grid moves by at most 0.1% of itself; None where ``F.dropout`` does instead."""
    q = drop_probability(p)
    if device.type != "cpu" or abs(q - p) > 1e-3 * p:
        return None
    return q


def keep_mask(
    shape: torch.Size, p: float, device: torch.device, dtype: torch.dtype = torch.bool
) -> Tensor:
    """Mask of ``shape``, each element independently False (0) with probability
    ``drop_probability(p)``, else True (1): bool, or written directly as ``dtype``."""
    n = shape.numel()
    # Uniform over all 64-bit words (``random_()`` would leave the sign bit 0), so each of a
    # word's four 16-bit quarters is uniform over [-2¹⁵, 2¹⁵) and independent of the others.
    words = torch.randint(-(1 << 63), (1 << 63) - 1, ((n + 3) // 4,), device=device)
    quarters = words.view(torch.int16)[:n]
    threshold = _drop_level(p) - (1 << 15)  # P(quarter < threshold) = drop_probability(p)
    mask = torch.empty(n, dtype=dtype, device=device)
    return torch.ge(quarters, threshold, out=mask).view(shape)


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Inverted dropout: zero each element with probability p (on the CPU,
    ``drop_probability(p)``), scale the rest by the inverse of the keep probability."""
    if not training or p == 0.0:
        return x
    q = _grid_probability(p, x.device)
    if q is None:
        return F.dropout(x, p, training)
    return torch.where(keep_mask(x.shape, p, x.device), x * (1.0 / (1.0 - q)), 0.0)


def dropout_add(x: Tensor, y: Tensor, p: float, training: bool) -> Tensor:
    """``x + dropout(y, p, training)`` in one pass: ``addcmul(x, y, keep_mask, value=1 /
    (1 - p'))`` with the mask in y's dtype; the same mask and values as :func:`dropout`
    for the same random state."""
    if not training or p == 0.0:
        return x + y
    q = _grid_probability(p, y.device)
    if q is None:
        return x + F.dropout(y, p, training)
    return torch.addcmul(x, y, keep_mask(y.shape, p, y.device, y.dtype), value=1.0 / (1.0 - q))


class GridDropout(nn.Dropout):
    """``nn.Dropout`` through :func:`dropout` (the same module, parameters and state)."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)


class GridResidual(Residual):
    """:class:`~aiayn.model.layers.Residual` through :func:`dropout_add`."""

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return dropout_add(x, y, self.p, self.training)
