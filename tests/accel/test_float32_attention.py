"""Float32Attention (aiayn.accel.attention): bfloat16 heads on the CPU attended in float32,
values and gradients those of float32 attention rounded once."""

from __future__ import annotations

import pytest
import torch

from aiayn.accel import Float32Attention
from aiayn.model.attention import MultiHeadAttention, attention_mask


def _attention(self_attention: bool = True) -> Float32Attention:
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, 8, 8, self_attention=self_attention)
    mha.__class__ = Float32Attention
    assert isinstance(mha, Float32Attention)
    return mha


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "causal"])
def test_bfloat16_attention_on_the_cpu_runs_in_float32(mask_kind: str) -> None:
    # Also under autocast, which would otherwise turn the heads back into bfloat16; the result
    # is rounded to bfloat16 once.
    mha = _attention()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen).bfloat16() for _ in range(3))
    mask, causal = None, mask_kind == "causal"
    if mask_kind == "bool":
        mask = attention_mask(torch.tensor([[False] * 4 + [True], [False] * 5]))
    elif mask_kind == "additive":  # the beam cache's lineage mask comes in the cache's dtype
        mask = torch.zeros(2, 1, 5, 5, dtype=torch.bfloat16)
        mask[..., 3] = float("-inf")
    float_mask = mask.float() if mask is not None and mask.is_floating_point() else mask
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=float_mask, is_causal=causal
    ).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mha.scaled_dot_product(q, k, v, mask, causal)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert torch.equal(mha.scaled_dot_product(q, k, v, mask, causal), want)
    # float32 keys and values with bfloat16 queries (a float32 cache), likewise
    assert torch.equal(mha.scaled_dot_product(q, k.float(), v.float(), mask, causal), want)
    # float32 queries take the plain path
    q32, k32, v32 = q.float(), k.float(), v.float()
    plain = MultiHeadAttention.scaled_dot_product(mha, q32, k32, v32, float_mask, causal)
    assert torch.equal(mha.scaled_dot_product(q32, k32, v32, float_mask, causal), plain)


def test_bfloat16_attention_gradients_are_float32_attention_gradients_rounded() -> None:
    mha = _attention()
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, 2, 3, 4, generator=gen).bfloat16() for _ in range(3)]
    grad_out = torch.randn(1, 2, 3, 4, generator=gen).bfloat16()
    ours = [t.clone().requires_grad_() for t in inputs]
    mha.scaled_dot_product(*ours, None, True).backward(grad_out)
    wide = [t.float().requires_grad_() for t in inputs]
    out = torch.nn.functional.scaled_dot_product_attention(*wide, is_causal=True)
    out.backward(grad_out.float())
    for mine, reference in zip(ours, wide, strict=True):
        assert torch.equal(mine.grad, reference.grad.bfloat16())


def test_cross_attention_keys_and_values_come_in_float32_for_a_float32_cache() -> None:
    mha = _attention(self_attention=False).to(torch.bfloat16)
    memory = torch.randn(2, 5, 16).bfloat16()
    k, v = mha.project_kv(memory)
    want_k, want_v = MultiHeadAttention.project_kv(mha, memory)
    assert k.dtype == v.dtype == torch.float32
    assert torch.equal(k, want_k.float()) and torch.equal(v, want_v.float())
    k32, _ = mha.float().project_kv(memory.float())  # float32 stays float32, untouched
    assert torch.equal(k32, MultiHeadAttention.project_kv(mha, memory.float())[0])
