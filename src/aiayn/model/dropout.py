"""Dropout (§5.4, Srivastava et al. 2014) with half the random-number draws.

On the CPU, ``F.dropout`` draws one float per element from the Mersenne-Twister generator,
single-threaded whatever the thread count: about 6 ms for one 768×512 activation on this
project's 2-core benchmark machine, times 32 dropout sites in the base model. Here one 64-bit
draw serves two elements, each 32-bit half compared with a threshold: the same independent
Bernoulli(1 - p) keep mask (p resolved to 2⁻³², finer than the 2⁻²⁴ of a float comparison),
kept as a bool tensor for the backward pass (1 byte per element instead of a 4-byte float
mask). On other devices it is ``F.dropout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_TWO_32 = 1 << 32


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> Tensor:
    """Bool mask of ``shape``, each element True with probability 1 - p (independently)."""
    n = shape.numel()
    # Uniform over all 64-bit words (``random_()`` would leave the sign bit 0).
    words = torch.randint(-(1 << 63), (1 << 63) - 1, ((n + 1) // 2,), device=device)
    halves = words.view(torch.int32)[:n]  # each uniform over [-2³¹, 2³¹)
    threshold = round(p * _TWO_32) - (1 << 31)  # P(half < threshold) = p
    return (halves >= threshold).view(shape)


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Inverted dropout: zero each element with probability p, scale the rest by 1/(1 - p)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training)
    return torch.where(keep_mask(x.shape, p, x.device), x * (1.0 / (1.0 - p)), 0.0)
