"""Attention on the CPU: bfloat16 computed in float32; beam steps by matrix products.

PyTorch's CPU attention kernels are several times slower in bfloat16 than in float32, while
attention is a small part of the arithmetic (docs/performance.md): :class:`Float32Attention`
attends over float32 heads and returns bfloat16, and gives the cross-attention keys and
values in float32, so that an incremental decoder keeps its whole cache in float32 and converts
only each step's new keys and values, once.

:class:`StepAttention`, the decoder's attention when decoding on the CPUs where it was measured
to pay, attends a beam search's steps over many sentences by two matrix products.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.accel import panels
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


# Beam search's decoder steps attend by two matrix products where at least this many
# (sentence, head) pairs attend with 2 to STEP_QUERIES queries each (the beams of a sentence);
# fewer pairs (one sentence), one query (greedy) and longer queries (the encoder, training)
# take PyTorch's kernel, which was as fast or faster there (docs/performance.md).
STEP_PAIRS = 32
STEP_QUERIES = 16


class StepAttention(Float32Attention):
    """:class:`Float32Attention` whose beam steps over many sentences attend by two matrix
    products and a softmax rather than ``F.scaled_dot_product_attention``: PyTorch's CPU
    kernel splits the work into one task per sentence and head, each only a few queries long,
    which is slower than the plain products at decoding's shapes (docs/performance.md). The same
    function: the sums run in another order (float32 rounding), and a row whose every key is
    masked gives NaN where the kernel gives zeros (a translation has none: every source has
    its end-of-sentence token). Inference on the CPU only (no autograd, autocast or
    dropout); elsewhere the parent's path. Its cross-attention keys and values are kept
    contiguous, so that no step copies them for the products."""

    def scaled_dot_product(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool
    ) -> Tensor:
        b, h, queries, _ = q.shape
        if (
            causal
            or not 2 <= queries <= STEP_QUERIES
            or b * h < STEP_PAIRS
            or q.device.type != "cpu"
            or q.dtype not in (torch.float32, torch.bfloat16)
            or (self.training and self.dropout > 0)
            or torch.is_grad_enabled()
            or torch.is_autocast_enabled("cpu")
        ):
            return super().scaled_dot_product(q, k, v, mask, causal)
        half = q.dtype is torch.bfloat16
        if half:
            q, k, v = q.float(), k.float(), v.float()
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.size(-1) ** -0.5)
        if mask is not None:
            if mask.dtype is torch.bool:
                scores.masked_fill_(mask.logical_not(), float("-inf"))
            else:
                scores.add_(mask)
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return out.to(torch.bfloat16) if half else out

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        # (B, H, S, Dh) views of one projection cannot be merged into B × H matrices:
        # matmul would copy them at every step.
        k, v = super().project_kv(memory)
        if k.device.type == "cpu" and not torch.is_grad_enabled():
            return k.contiguous(), v.contiguous()
        return k, v


class PanelAttention(MultiHeadAttention):
    """:class:`~aiayn.model.attention.MultiHeadAttention` whose float32 inference on the CPU
    attends through aiayn's kernel (:func:`aiayn.accel.panels.attend`) once that is loaded:
    one task per sentence and head, a query's scores and weighted sum of values in registers,
    and the heads written side by side so that merging them is a view: faster than PyTorch's
    kernel for the encoder's short sentences (docs/performance.md). The same function to
    float32 rounding; training, autocast, bfloat16 and other devices take the parent's path."""

    def scaled_dot_product(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool
    ) -> Tensor:
        if (
            causal
            or q.dtype is not torch.float32
            or q.device.type != "cpu"
            or (self.training and self.dropout > 0)
            or torch.is_grad_enabled()
            or torch.is_autocast_enabled("cpu")
            or not panels.loaded()
        ):
            return super().scaled_dot_product(q, k, v, mask, causal)
        return panels.attend(q, k, v, mask, q.size(-1) ** -0.5)
