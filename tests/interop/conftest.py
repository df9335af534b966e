"""The word-reversal tokenizer and sentences that the interop tests share
(tests/interop/reversal.py has the model)."""

from __future__ import annotations

import random

import pytest

from aiayn.data.tokenizer import Tokenizer, train_tokenizer
from tests.helpers import WORDS
from tests.interop.reversal import sentence


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """One token per word of tests.helpers.WORDS."""
    folder = tmp_path_factory.mktemp("spm")
    rng = random.Random(5)
    text = folder / "text.txt"
    text.write_text("\n".join(sentence(rng) for _ in range(300)), encoding="utf-8")
    return train_tokenizer([text], len(WORDS) + 4, folder / "spm", "word")


@pytest.fixture(scope="module")
def lines() -> list[str]:
    rng = random.Random(7)
    return [sentence(rng) for _ in range(10)]
