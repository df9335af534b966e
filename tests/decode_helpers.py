"""A few cached decoder steps of a model, for the tests of the accelerated layers."""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.model.transformer import Transformer


def step_log_probs(model: Transformer, rows: int, vocab: int = 50) -> Tensor:
    """Three steps' log-probabilities (3, rows, V) over ``rows`` random sources (the first
    padded), each copied at once (an accelerated model writes every step into one buffer)."""
    torch.manual_seed(2)
    src = torch.randint(4, vocab, (rows, 9))
    src_pad = torch.zeros_like(src, dtype=torch.bool)
    src_pad[0, 6:] = True
    with torch.inference_mode():
        cache = model.init_cache(model.encode(src, src_pad), src_pad, max_len=4)
        tokens = torch.randint(4, vocab, (rows,))
        return torch.stack([model.log_probs_step(tokens, cache).clone() for _ in range(3)])
