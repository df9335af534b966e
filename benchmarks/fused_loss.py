"""Label-smoothed cross-entropy with its gradient computed in the forward pass, in cache-sized
chunks of rows: a formulation benchmarked against ``aiayn.training.loss.label_smoothed_nll``
(proposed to the training code, not used by it).

Per target position with logits x (V,), log-probabilities ℓ = log_softmax(x), target y and
smoothing ε, the smoothed target is q = (1 - ε)·onehot(y) + ε/V and

    loss = -Σ_v q_v ℓ_v = (1 - ε)·(-ℓ_y) + ε·(-mean_v ℓ_v),     ∂loss/∂x = softmax(x) - q.

The gradient needs no autograd graph over the (N, V) logits: each chunk of rows is read once,
its log-probabilities, losses and gradient are computed while it sits in cache, and the
gradient is written once. Autograd's version of the same loss makes about a dozen passes over
(N, V) tensors (logsumexp, mean and gather forward; their three backward passes and the sums).

Two entry points:

- ``fused_label_smoothed_nll(logits, target, ε, pad_id)``: same contract as
  ``label_smoothed_nll`` (drop-in).
- ``linear_label_smoothed_nll(hidden, weight, target, ε, pad_id)``: the pre-softmax projection
  fused in as well. Padding rows are dropped *before* the projection (no logits for them), and
  the full (N, V) logits never exist: per chunk, logits → gradient → the chunk's share of the
  gradients of ``hidden`` and ``weight``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Rows per chunk of the logits-level loss: about this many logits (×4 bytes) stay in cache
# between its passes.
CHUNK_ELEMENTS = 1 << 18
# Rows per chunk when the projection is fused in: each chunk's (V, d) weight-gradient update
# reads and writes the whole (V, d) matrix, so chunks must be large enough to amortise that.
LINEAR_CHUNK_ROWS = 256


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


def _loss_and_grad(
    x: Tensor, target: Tensor, epsilon: float, log_probs: Tensor, grad_out: Tensor
) -> tuple[Tensor, Tensor]:
    """Losses and NLLs (rows,) of one chunk of logits x (rows, V). ``log_probs`` is scratch
    space of x's shape; the gradient softmax(x) - q is written into ``grad_out``, which may be
    x itself."""
    vocab = x.size(-1)
    torch.log_softmax(x, dim=-1, out=log_probs)  # ℓ
    nll = -log_probs.gather(1, target[:, None]).squeeze(1)
    loss = (1.0 - epsilon) * nll - epsilon * log_probs.mean(dim=-1) if epsilon > 0 else nll
    torch.exp(log_probs, out=grad_out)  # softmax(x)
    if epsilon > 0:
        grad_out.sub_(epsilon / vocab)
    grad_out.scatter_add_(1, target[:, None], torch.full_like(grad_out[:, :1], epsilon - 1.0))
    return loss, nll


class _FusedLabelSmoothedNLL(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: Tensor, target: Tensor, epsilon: float, pad_id: int
    ) -> tuple[Tensor, Tensor]:
        n, vocab = logits.shape
        keep = target != pad_id
        safe = torch.where(keep, target, torch.zeros_like(target))
        grad = torch.empty_like(logits, dtype=torch.float32)
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        nll = torch.empty_like(loss)
        step = _rows_per_chunk(vocab)
        scratch = torch.empty(min(step, n), vocab, dtype=torch.float32, device=logits.device)
        for start in range(0, n, step):
            rows = slice(start, start + step)
            x = logits[rows].float()
            loss[rows], nll[rows] = _loss_and_grad(
                x, safe[rows], epsilon, scratch[: x.size(0)], grad[rows]
            )
        grad.mul_(keep[:, None])  # padding positions: no loss, no gradient
        ctx.save_for_backward(grad)
        ctx.logits_dtype = logits.dtype
        zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
        return torch.where(keep, loss, zero).sum(), torch.where(keep, nll, zero).sum()

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_loss: Tensor, grad_nll: Tensor
    ) -> tuple[Tensor | None, None, None, None]:
        # Only the smoothed loss is differentiated (the NLL is reported, not trained on).
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_loss).to(ctx.logits_dtype), None, None, None


def fused_label_smoothed_nll(
    logits: Tensor, target: Tensor, epsilon: float, pad_id: int
) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed loss and summed NLL over non-padding positions (drop-in for
    ``aiayn.training.loss.label_smoothed_nll``)."""
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"label smoothing epsilon must be in [0, 1), got {epsilon}")
    return _FusedLabelSmoothedNLL.apply(
        logits.reshape(-1, logits.size(-1)), target.reshape(-1), epsilon, pad_id
    )


class _LinearLabelSmoothedNLL(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, target: Tensor, epsilon: float
    ) -> tuple[Tensor, Tensor]:
        n, vocab = hidden.size(0), weight.size(0)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.empty_like(weight)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        nll_sum = torch.zeros_like(loss_sum)
        step = LINEAR_CHUNK_ROWS
        logits_buffer = torch.empty(min(step, n), vocab, dtype=torch.float32, device=hidden.device)
        scratch = torch.empty_like(logits_buffer)
        for start in range(0, n, step):
            h = hidden[start : start + step]
            rows = h.size(0)
            logits = torch.mm(h, weight.t(), out=logits_buffer[:rows])  # (rows, V)
            # The logits are dead once their log-probabilities exist: the gradient overwrites them.
            loss, nll = _loss_and_grad(
                logits, target[start : start + step], epsilon, scratch[:rows], logits
            )
            loss_sum += loss.sum()
            nll_sum += nll.sum()
            torch.mm(logits, weight, out=grad_hidden[start : start + step])  # (rows, d)
            if start == 0:
                torch.mm(logits.t(), h, out=grad_weight)  # (V, d)
            else:
                grad_weight.addmm_(logits.t(), h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss_sum, nll_sum

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_loss: Tensor, grad_nll: Tensor
    ) -> tuple[Tensor, Tensor, None, None]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden.mul_(grad_loss), grad_weight.mul_(grad_loss), None, None


def linear_label_smoothed_nll(
    hidden: Tensor, weight: Tensor, target: Tensor, epsilon: float, pad_id: int
) -> tuple[Tensor, Tensor]:
    """``label_smoothed_nll(hidden @ weight.T, target, ε, pad_id)`` without the (N, V) logits:
    ``hidden`` (..., d) are the decoder outputs, ``weight`` (V, d) the pre-softmax projection.
    Padding positions are dropped before projecting."""
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"label smoothing epsilon must be in [0, 1), got {epsilon}")
    target = target.reshape(-1)
    keep = (target != pad_id).nonzero().squeeze(1)
    rows = hidden.reshape(-1, hidden.size(-1)).index_select(0, keep)
    return _LinearLabelSmoothedNLL.apply(rows, weight, target.index_select(0, keep), epsilon)
