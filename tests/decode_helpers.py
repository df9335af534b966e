"""A few cached decoder steps of a model, for the tests of packed weights."""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.model.transformer import Transformer


def step_log_probs(model: Transformer, rows: int, vocab: int = 50) -> tuple[Tensor, bool]:
    """Three steps' log-probabilities (3, rows, V) over ``rows`` random sources (the first
    padded), and whether the last step's result was in the cache's buffer."""
    torch.manual_seed(2)
    src = torch.randint(4, vocab, (rows, 9))
    src_pad = torch.zeros_like(src, dtype=torch.bool)
    src_pad[0, 6:] = True
    with torch.inference_mode():
        cache = model.init_cache(model.encode(src, src_pad), src_pad, max_len=4)
        tokens = torch.randint(4, vocab, (rows,))
        out, pointers = [], []
        for _ in range(3):  # the buffer is overwritten by the next step: copied at once
            log_probs = model.log_probs_step(tokens, cache)
            pointers.append(log_probs.data_ptr())
            out.append(log_probs.clone())
        in_scratch = pointers[-1] == cache.scratch(rows, vocab).data_ptr()
        return torch.stack(out), in_scratch
