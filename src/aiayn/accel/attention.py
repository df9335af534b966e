"""bfloat16 attention on the CPU, computed in float32.

PyTorch's CPU attention kernels are several times slower in bfloat16 than in float32, while
attention is a small part of the arithmetic (docs/performance.md): :class:`Float32Attention`
attends over float32 heads and returns bfloat16, and gives the cross-attention keys and
values in float32, so that an incremental decoder keeps its whole cache in float32 and converts
only each step's new keys and values, once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.model.attention import MultiHeadAttention


class Float32Attention(MultiHeadAttention):
    """:class:`~aiayn.model.attention.MultiHeadAttention` whose bfloat16 CPU heads are attended
    in float32 (outside autocast, which would convert them back). Other dtypes and devices
    take the plain path."""

    def scaled_dot_product(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool
    ) -> Tensor:
        if q.dtype is not torch.bfloat16 or q.device.type != "cpu":
            return super().scaled_dot_product(q, k, v, mask, causal)
        if mask is not None and mask.is_floating_point():
            mask = mask.float()
        with torch.autocast("cpu", enabled=False):
            out = super().scaled_dot_product(q.float(), k.float(), v.float(), mask, causal)
        return out.to(torch.bfloat16)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        k, v = super().project_kv(memory)
        if k.dtype is torch.bfloat16 and k.device.type == "cpu":
            return k.float(), v.float()
        return k, v
