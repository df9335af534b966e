"""The pre-softmax projection and the label-smoothed loss (§5.4) fused: training on the CPU.

``projected_label_smoothed_nll(hidden, weight, target, ε, pad_id)`` equals
:func:`aiayn.training.loss.label_smoothed_nll` of ``hidden @ weight.T`` without forming the
(N, V) logits. The Trainer takes it when the model is accelerated for training on the CPU
(:func:`aiayn.accel.accelerate`, ``Acceleration.fused_loss``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.accel.linear import BF16_ROW_MULTIPLE, round_up

# Per target position with logits x (V,), ℓ = log_softmax(x), smoothed target
# q = (1 - ε)·onehot(y) + ε/V:
#
#     loss = (1 - ε)·(-ℓ_y) + ε·(-mean_v ℓ_v),      ∂loss/∂x = softmax(x) - q.
#
# The gradient needs no autograd graph over the (N, V) logits. ``projected_label_smoothed_nll``
# computes, per chunk of rows, the logits (a matrix product), their losses, the gradient
# softmax - q (written over the logits while they are in cache) and that chunk's share of the
# gradients of the decoder output and of the projection matrix. The (N, V) logits never exist,
# padding rows are dropped before projecting, and autograd's dozen passes over (N, V) tensors
# become three (figures: docs/performance.md).

# Rows per chunk: each chunk's (V, d) weight-gradient update reads and writes the whole
# projection matrix, so a chunk must be large enough to amortise that, and small enough that
# its (rows, V) logits stay in cache between the passes over them.
PROJECTION_CHUNK_ROWS = 256
# With bfloat16 products, the gradients of up to this many rows are kept (in bfloat16) and
# multiplied into the weight gradient at once: one (V, d) product and one float32
# accumulation per group of chunks instead of per chunk.
LOW_PRECISION_GROUP_ROWS = 1024


def _loss_and_gradient_(logits: Tensor, y: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """The summed loss and NLL of a chunk's logits (rows, V) for targets y (rows, 1);
    overwrites the logits with the gradient softmax(x) - q (in place, while in cache)."""
    vocab = logits.size(1)
    log_probs = torch.log_softmax(logits, dim=-1, out=logits)  # in place
    nll = -log_probs.gather(1, y).squeeze(1)
    loss = nll
    if epsilon > 0.0:
        loss = (1.0 - epsilon) * nll - epsilon * log_probs.mean(dim=-1)
    grad = log_probs.exp_()  # softmax(x), in place
    if epsilon > 0.0:
        grad.sub_(epsilon / vocab)
    grad.scatter_add_(1, y, torch.full_like(grad[:, :1], epsilon - 1.0))  # - q
    return loss.sum(), nll.sum()


def _same_dtype_forward(
    hidden: Tensor, weight: Tensor, target: Tensor, epsilon: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss sum, NLL sum, gradient of hidden, gradient of weight), everything in the inputs'
    dtype (float32; float64 in tests)."""
    n, vocab = hidden.size(0), weight.size(0)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros_like(weight)
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    nll_sum = torch.zeros_like(loss_sum)
    step = PROJECTION_CHUNK_ROWS
    # One (rows, V) buffer: the logits, then their log-probabilities, then the gradient.
    buffer = torch.empty(min(step, n), vocab, dtype=hidden.dtype, device=hidden.device)
    for start in range(0, n, step):
        h = hidden[start : start + step]
        logits = torch.mm(h, weight.t(), out=buffer[: h.size(0)])  # (rows, V)
        loss, nll = _loss_and_gradient_(logits, target[start : start + step, None], epsilon)
        loss_sum += loss
        nll_sum += nll
        torch.mm(logits, weight, out=grad_hidden[start : start + step])  # (rows, d)
        grad_weight.addmm_(logits.t(), h)  # (V, d)
    return loss_sum, nll_sum, grad_hidden, grad_weight


def _low_precision_forward(
    hidden: Tensor, weight: Tensor, target: Tensor, epsilon: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """As :func:`_same_dtype_forward` with the three matrix products in ``dtype`` (bfloat16):
    the logits are rounded to ``dtype`` as autocast's projection would round them, the
    log-softmax, losses and the gradient softmax - q are float32, and the gradient is rounded
    to ``dtype`` for the two backward products. The weight gradient is float32, the hidden
    gradient in ``dtype``.

    The rows are padded with zeros to a multiple of ``BF16_ROW_MULTIPLE`` (padding rows get
    no loss and a zero gradient): oneDNN compiles a kernel for every new row count of a
    bfloat16 product (see :mod:`aiayn.accel.linear`)."""
    n, vocab = hidden.size(0), weight.size(0)
    device = hidden.device
    multiple = BF16_ROW_MULTIPLE
    padded = round_up(n, multiple)
    h_low = F.pad(hidden.to(dtype), (0, 0, 0, padded - n))
    w_low = weight.to(dtype)
    grad_hidden = torch.empty_like(h_low)
    grad_weight: Tensor | None = None
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    nll_sum = torch.zeros_like(loss_sum)
    step = max(multiple, PROJECTION_CHUNK_ROWS // multiple * multiple)
    group = max(step, LOW_PRECISION_GROUP_ROWS // step * step)
    logits_low = torch.empty(min(step, padded), vocab, dtype=dtype, device=device)
    buffer = torch.empty(min(step, padded), vocab, dtype=torch.float32, device=device)
    grads = torch.empty(min(group, padded), vocab, dtype=dtype, device=device)  # a group's
    for first in range(0, padded, group):
        last = min(first + group, padded)
        for start in range(first, last, step):
            h = h_low[start : min(start + step, last)]
            rows, real = h.size(0), max(0, min(h.size(0), n - start))
            torch.mm(h, w_low.t(), out=logits_low[:rows])
            logits = buffer[:real].copy_(logits_low[:real])  # float32 from here
            y = target[start : start + real, None]
            loss, nll = _loss_and_gradient_(logits, y, epsilon)
            loss_sum += loss
            nll_sum += nll
            g = grads[start - first : start - first + rows]
            g[:real].copy_(logits)
            g[real:].zero_()
            torch.mm(g, w_low, out=grad_hidden[start : start + rows])  # (rows, d)
        part = torch.mm(grads[: last - first].t(), h_low[first:last])  # (V, d) in dtype
        grad_weight = part.float() if grad_weight is None else grad_weight.add_(part)
    if grad_weight is None:  # no rows: every target position was padding
        grad_weight = torch.zeros_like(weight)
    return loss_sum, nll_sum, grad_hidden[:n], grad_weight


class _ProjectedLabelSmoothedNLL(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        target: Tensor,
        epsilon: float,
        compute_dtype: torch.dtype | None,
    ) -> tuple[Tensor, Tensor]:
        if compute_dtype is None:
            loss_sum, nll_sum, grad_hidden, grad_weight = _same_dtype_forward(
                hidden, weight, target, epsilon
            )
        else:
            loss_sum, nll_sum, grad_hidden, grad_weight = _low_precision_forward(
                hidden, weight, target, epsilon, compute_dtype
            )
        ctx.hidden_dtype = hidden.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss_sum, nll_sum

    @staticmethod
    def backward(
        ctx: Any, grad_loss: Tensor, grad_nll: Tensor
    ) -> tuple[Tensor, Tensor, None, None, None]:
        # Only the smoothed loss is trained on; the NLL is reported beside it.
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = grad_hidden.to(ctx.hidden_dtype).mul_(grad_loss)
        return grad_hidden, grad_weight.mul_(grad_loss), None, None, None


def projected_label_smoothed_nll(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    epsilon: float,
    pad_id: int,
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """``label_smoothed_nll(hidden @ weight.T, target, ε, pad_id)`` without the (N, V) logits.

    ``hidden`` (..., d) are decoder outputs, ``weight`` (V, d) the pre-softmax projection,
    ``target`` (...) the target ids. Same returns as :func:`label_smoothed_nll` (float32 sums
    over non-padding positions); only the first is differentiable. Call it outside autocast.

    By default everything is computed in the dtype of ``hidden`` and ``weight``, which must
    agree (float32). ``compute_dtype=torch.bfloat16`` (``train.precision=bf16`` on the CPU)
    takes float32 or bfloat16 hidden states and runs the three matrix products in bfloat16,
    everything between them in float32; the weight's gradient is float32, the hidden states'
    in their own dtype.
    """
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"label smoothing epsilon must be in [0, 1), got {epsilon}")
    if compute_dtype is None:
        if hidden.dtype != weight.dtype:
            raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}")
    elif compute_dtype != torch.bfloat16:
        raise ValueError(f"compute_dtype must be None or torch.bfloat16, got {compute_dtype}")
    target = target.reshape(-1)
    keep = (target != pad_id).nonzero().squeeze(1)
    rows = hidden.reshape(-1, hidden.size(-1)).index_select(0, keep)
    return _ProjectedLabelSmoothedNLL.apply(
        rows, weight, target.index_select(0, keep), epsilon, compute_dtype
    )
