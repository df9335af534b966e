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
