"""Tiny word-reversal models for the interop tests: sentences of tests.helpers.WORDS and a
model trained briefly to reverse them (kept for the session: the same arguments give the same
model)."""

from __future__ import annotations

import random

import torch

from aiayn.config import load_config
from aiayn.data.tokenizer import Tokenizer
from aiayn.model.transformer import Transformer
from tests.helpers import WORDS, train_to_reverse


def sentence(rng: random.Random, low: int = 1, high: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


_MODELS: dict[tuple[str, ...], Transformer] = {}


def trained_model(tokenizer: Tokenizer, *overrides: str, steps: int = 60) -> Transformer:
    """A tiny model trained for ``steps`` updates of 16 pairs to reverse word sequences."""
    key = (*overrides, str(steps), str(tokenizer.vocab_size))
    if key in _MODELS:
        return _MODELS[key]
    config = load_config(
        overrides=[
            "preset=tiny",
            f"model.vocab_size={tokenizer.vocab_size}",
            "model.dropout=0",
            *overrides,
        ]
    )
    torch.manual_seed(0)
    rng = random.Random(0)
    model = Transformer(config.model)
    train_to_reverse(model, lambda: tokenizer.encode(sentence(rng)), steps, batch=16, lr=1e-2)
    _MODELS[key] = model.eval()
    return model
