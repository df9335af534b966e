"""StepAttention (aiayn.accel.attention): beam steps over many sentences attended by two
matrix products, equal to PyTorch's attention to float32 rounding, and only where it serves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aiayn.accel import StepAttention, accelerate
from aiayn.accel.attention import STEP_PAIRS, STEP_QUERIES
from aiayn.config import ModelConfig
from aiayn.inference.search import beam_search
from aiayn.model.attention import MultiHeadAttention, attention_mask
from aiayn.model.transformer import Transformer


def _attention() -> StepAttention:
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, 8, 8, self_attention=True).eval()
    mha.__class__ = StepAttention
    return mha  # type: ignore[return-value]


def _heads(sentences: int, queries: int, keys: int, dtype: torch.dtype = torch.float32) -> list:
    gen = torch.Generator().manual_seed(sentences * 31 + queries)
    q = torch.randn(sentences, 4, queries, 8, generator=gen)
    k, v = (torch.randn(sentences, 4, keys, 8, generator=gen) for _ in range(2))
    return [q.to(dtype), k.to(dtype), v.to(dtype)]


def _sdpa(q, k, v, mask):  # type: ignore[no-untyped-def]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_beam_steps_of_many_sentences_equal_pytorchs_attention(mask_kind: str) -> None:
    sentences, beam, keys = STEP_PAIRS // 4 + 3, 4, 10
    q, k, v = _heads(sentences, beam, keys)
    mask = None
    if mask_kind == "bool":  # the memory's padding
        pad = torch.zeros(sentences, keys, dtype=torch.bool)
        pad[1::2, 7:] = True
        mask = attention_mask(pad)
    elif mask_kind == "additive":  # the beam cache's lineage mask
        mask = torch.zeros(sentences, 1, beam, keys)
        mask[:, :, 1:, ::3] = float("-inf")
    mha = _attention()
    calls: list[str] = []
    real = F.scaled_dot_product_attention
    try:
        F.scaled_dot_product_attention = lambda *a, **kw: calls.append("sdpa") or real(*a, **kw)
        with torch.inference_mode():
            got = mha.scaled_dot_product(q, k, v, mask, False)
    finally:
        F.scaled_dot_product_attention = real
    assert calls == []  # the products, not PyTorch's kernel
    torch.testing.assert_close(got, _sdpa(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_bfloat16_heads_are_attended_in_float32() -> None:
    q, k, v = _heads(STEP_PAIRS, 4, 6, torch.bfloat16)
    with torch.inference_mode():
        got = _attention().scaled_dot_product(q, k.float(), v.float(), None, False)
    assert got.dtype == torch.bfloat16
    want = _sdpa(q.float(), k.float(), v.float(), None).bfloat16()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_everything_else_takes_pytorchs_attention() -> None:
    """One sentence, one query (greedy), a long query (the encoder), causal, autograd,
    training with dropout: MultiHeadAttention's path, bit for bit."""
    mha = _attention()
    plain = MultiHeadAttention.scaled_dot_product
    cases = [
        (_heads(1, 4, 9), False),
        (_heads(STEP_PAIRS, 1, 9), False),
        (_heads(STEP_PAIRS, STEP_QUERIES + 1, 9), False),
        (_heads(STEP_PAIRS, 4, 4), True),
    ]
    with torch.inference_mode():
        for heads, causal in cases:
            want = plain(mha, *heads, None, causal)
            assert torch.equal(mha.scaled_dot_product(*heads, None, causal), want)
    heads = _heads(STEP_PAIRS, 4, 9)
    with torch.no_grad():
        want = plain(mha, *heads, None, False)
    assert torch.equal(mha.scaled_dot_product(*heads, None, False), want)  # grad enabled
    mha.dropout = 0.5
    mha.train()
    with torch.inference_mode():
        torch.manual_seed(5)
        want = plain(mha, *heads, None, False)
        torch.manual_seed(5)
        assert torch.equal(mha.scaled_dot_product(*heads, None, False), want)


def test_beam_search_over_many_sentences_finds_the_plain_hypotheses() -> None:
    config = ModelConfig(vocab_size=40, d_model=32, d_ff=64, n_heads=4, n_layers=2, dropout=0.0)
    torch.manual_seed(0)
    plain = Transformer(config).eval()
    fast = Transformer(config).eval()
    fast.load_state_dict(plain.state_dict())
    acceleration = accelerate(fast, "decode", pack_weights=False, memory_settings=False)
    assert "beam steps attended by products" in acceleration.levers
    assert all(
        type(m) is StepAttention for m in fast.modules() if isinstance(m, MultiHeadAttention)
    )
    gen = torch.Generator().manual_seed(2)
    sentences = STEP_PAIRS  # × 4 heads: well over STEP_PAIRS pairs
    src = torch.randint(4, 40, (sentences, 7), generator=gen)
    pad = torch.zeros_like(src, dtype=torch.bool)

    def hypotheses(model: Transformer) -> list:
        with torch.inference_mode():
            cache = model.init_cache(model.encode(src, pad), pad, 9, beam_size=4)
            found = beam_search(model.log_probs_step, cache, sentences, beam_size=4, max_len=8)
        return [[(h.tokens, h.score) for h in hyps] for hyps in found]

    got, want = hypotheses(fast), hypotheses(plain)
    assert [[t for t, _ in hyps] for hyps in got] == [[t for t, _ in hyps] for hyps in want]
    for ours, theirs in zip(got, want, strict=True):
        assert [s for _, s in ours] == pytest.approx([s for _, s in theirs], abs=1e-4)
    acceleration.undo()
    assert all(
        type(m) is MultiHeadAttention for m in fast.modules() if isinstance(m, MultiHeadAttention)
    )
