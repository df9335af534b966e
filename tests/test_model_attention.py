"""Attention against the formula softmax(QKᵀ/√d_k)V written out in float64."""

import math

import pytest
import torch
from torch.testing import assert_close

from aiayn.model.attention import MultiHeadAttention, attention_mask, naive_attention


def _formula(q, k, v, allowed):
    """Per (batch, head, query): softmax over allowed keys of q·k/√d_k, times V. Plain loops."""
    b, h, t, _ = q.shape
    out = torch.zeros(b, h, t, v.size(-1), dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for ti in range(t):
                keys = [s for s in range(k.size(2)) if allowed(bi, ti, s)]
                scores = torch.stack([q[bi, hi, ti] @ k[bi, hi, s] for s in keys])
                weights = torch.softmax(scores / math.sqrt(q.size(-1)), dim=0)
                out[bi, hi, ti] = sum(w * v[bi, hi, s] for w, s in zip(weights, keys, strict=True))
    return out


def test_naive_attention_is_the_formula_with_padding_and_causal_masks():
    q, k = (
        torch.randn(2, 3, 5, 4, dtype=torch.float64),
        torch.randn(2, 3, 5, 4, dtype=torch.float64),
    )
    v = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    out, _ = naive_attention(q, k, v, attention_mask(pad))
    assert_close(out, _formula(q, k, v, lambda b, t, s: not pad[b, s]))
    out, _ = naive_attention(q, k, v, None, causal=True)
    assert_close(out, _formula(q, k, v, lambda b, t, s: s <= t))


@pytest.mark.parametrize("self_attention", [True, False])
@pytest.mark.parametrize(("n_heads", "d_k", "d_v"), [(4, 8, 8), (2, 4, 12)])
def test_multi_head_attention_equals_per_head_formula(self_attention, n_heads, d_k, d_v):
    d_model = 16
    mha = MultiHeadAttention(d_model, n_heads, d_k, d_v, self_attention=self_attention).double()
    for p in mha.parameters():  # non-zero biases so that they are exercised too
        torch.nn.init.normal_(p)
    x = torch.randn(3, 5, d_model, dtype=torch.float64)
    memory = torch.randn(3, 7, d_model, dtype=torch.float64)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 6:] = True
    # The weight matrices of each head, sliced out of the (possibly fused) projections.
    if self_attention:
        wq, wk, wv = mha.qkv_proj.weight.split([n_heads * d_k, n_heads * d_k, n_heads * d_v])
        bq, bk, bv = mha.qkv_proj.bias.split([n_heads * d_k, n_heads * d_k, n_heads * d_v])
        source, allowed = x, (lambda b, t, s: s <= t)
        out = mha(x, causal=True)
    else:
        wq, bq = mha.q_proj.weight, mha.q_proj.bias
        wk, wv = mha.kv_proj.weight.split([n_heads * d_k, n_heads * d_v])
        bk, bv = mha.kv_proj.bias.split([n_heads * d_k, n_heads * d_v])
        source, allowed = memory, (lambda b, t, s: not pad[b, s])
        out = mha(x, memory, mask=attention_mask(pad))
    heads = []
    for i in range(n_heads):
        qi = x @ wq[i * d_k : (i + 1) * d_k].T + bq[i * d_k : (i + 1) * d_k]
        ki = source @ wk[i * d_k : (i + 1) * d_k].T + bk[i * d_k : (i + 1) * d_k]
        vi = source @ wv[i * d_v : (i + 1) * d_v].T + bv[i * d_v : (i + 1) * d_v]
        heads.append(_formula(qi[:, None], ki[:, None], vi[:, None], allowed)[:, 0])
    expected = torch.cat(heads, dim=-1) @ mha.out_proj.weight.T + mha.out_proj.bias
    assert_close(out, expected)


def test_attention_bias_can_be_switched_off():
    mha = MultiHeadAttention(16, 4, 4, 4, self_attention=True, bias=False)
    assert mha.qkv_proj.bias is None and mha.out_proj.bias is None


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "causal"])
def test_bfloat16_attention_on_the_cpu_runs_in_float32(mask_kind):
    # PyTorch's CPU attention is ~5x slower in bfloat16: the heads are attended in float32
    # (also under autocast, which would otherwise turn them back into bfloat16) and the
    # result rounded to bfloat16 once.
    from aiayn.model.attention import scaled_dot_product

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
        got = scaled_dot_product(q, k, v, mask, 0.0, causal)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert torch.equal(scaled_dot_product(q, k, v, mask, 0.0, causal), want)


def test_bfloat16_attention_gradients_are_float32_attention_gradients_rounded():
    from aiayn.model.attention import scaled_dot_product

    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, 2, 3, 4, generator=gen).bfloat16() for _ in range(3)]
    grad_out = torch.randn(1, 2, 3, 4, generator=gen).bfloat16()
    ours = [t.clone().requires_grad_() for t in inputs]
    scaled_dot_product(*ours, None, 0.0, True).backward(grad_out)
    wide = [t.float().requires_grad_() for t in inputs]
    out = torch.nn.functional.scaled_dot_product_attention(*wide, is_causal=True)
    out.backward(grad_out.float())
    for mine, reference in zip(ours, wide, strict=True):
        assert torch.equal(mine.grad, reference.grad.bfloat16())
