"""Label-smoothed cross-entropy (§5.4), with the plain NLL reported beside it."""

from __future__ import annotations

import torch
from torch import Tensor


def label_smoothed_nll(
    logits: Tensor, target: Tensor, epsilon: float, pad_id: int
) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed loss and summed NLL over the non-padding target positions.

    ``logits`` (..., V) and ``target`` (...) of matching leading shape. The smoothed target
    distribution is ``(1 - ε)·onehot(y) + ε/V`` (uniform over the whole vocabulary, as in
    Szegedy et al. 2016), so the per-token loss is ``(1 - ε)·NLL + ε·(-mean_v log p_v)``.

    Memory-lean: with ``lse = logsumexp(logits)`` we have ``-log p_y = lse - logits_y`` and
    ``-mean_v log p_v = lse - mean_v logits_v``; no (…, V) log-probability tensor is kept,
    only per-token scalars (autograd's backward of ``logsumexp`` is one softmax).

    Returns ``(loss_sum, nll_sum)`` as float32 scalars; positions where ``target == pad_id``
    contribute exactly nothing (they are selected out with ``torch.where``, so even a
    non-finite logit there cannot leak in). With ``epsilon = 0`` the loss equals
    ``F.cross_entropy(logits, target, ignore_index=pad_id, reduction="sum")``.
    """
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"label smoothing epsilon must be in [0, 1), got {epsilon}")
    logits = logits.reshape(-1, logits.size(-1)).float()  # (N, V)
    target = target.reshape(-1)  # (N,)
    keep = target != pad_id  # (N,)
    safe_target = torch.where(keep, target, torch.zeros_like(target))
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    nll = lse - logits.gather(-1, safe_target[:, None]).squeeze(-1)  # (N,)
    if epsilon > 0.0:
        smooth = lse - logits.mean(dim=-1)  # (N,)
        loss = (1.0 - epsilon) * nll + epsilon * smooth
    else:
        loss = nll
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    loss_sum = torch.where(keep, loss, zero).sum()
    nll_sum = torch.where(keep, nll, zero).sum()
    return loss_sum, nll_sum
