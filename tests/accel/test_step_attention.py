"""StepAttention (aiayn.accel.attention): the decoder's beam steps over many sentences attended
by two matrix products, equal to PyTorch's attention to float32 rounding, and only where it
serves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import aiayn.accel
from aiayn.accel import Float32Attention, StepAttention, accelerate
from aiayn.accel.attention import STEP_PAIRS, STEP_QUERIES
from aiayn.config import ModelConfig
from aiayn.inference.search import beam_search
from aiayn.model.attention import MultiHeadAttention, attention_mask
from aiayn.model.transformer import Transformer

HEADS = 4


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, ...]]]:
    """The query shapes PyTorch's attention kernel is called with (the products are not)."""
    calls: list[tuple[int, ...]] = []
    real = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(tuple(q.shape))
        return real(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    yield calls


def _attention() -> StepAttention:
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, HEADS, 8, 8, self_attention=True).eval()
    mha.__class__ = StepAttention
    return mha  # type: ignore[return-value]


def _heads(sentences: int, queries: int, keys: int, dtype: torch.dtype = torch.float32) -> list:
    gen = torch.Generator().manual_seed(sentences * 31 + queries)
    q = torch.randn(sentences, HEADS, queries, 8, generator=gen)
    k, v = (torch.randn(sentences, HEADS, keys, 8, generator=gen) for _ in range(2))
    return [q.to(dtype), k.to(dtype), v.to(dtype)]


def _sdpa(q, k, v, mask):  # type: ignore[no-untyped-def]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


ENOUGH = -(-STEP_PAIRS // HEADS)  # sentences: at least STEP_PAIRS (sentence, head) pairs


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("queries", [2, 4, STEP_QUERIES])
def test_beam_steps_of_many_sentences_equal_pytorchs_attention(
    mask_kind: str, queries: int, kernel_calls: list
) -> None:
    sentences, keys = ENOUGH + 3, 10
    q, k, v = _heads(sentences, queries, keys)
    mask = None
    if mask_kind == "bool":  # the memory's padding
        pad = torch.zeros(sentences, keys, dtype=torch.bool)
        pad[1::2, 7:] = True
        mask = attention_mask(pad)
    elif mask_kind == "additive":  # the beam cache's lineage mask
        mask = torch.zeros(sentences, 1, queries, keys)
        mask[:, :, 1:, ::3] = float("-inf")
    with torch.inference_mode():
        got = _attention().scaled_dot_product(q, k, v, mask, False)
    assert kernel_calls == []  # the products
    torch.testing.assert_close(got, _sdpa(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_bfloat16_heads_are_attended_in_float32(kernel_calls: list) -> None:
    q, k, v = _heads(ENOUGH, 4, 6, torch.bfloat16)
    mask = torch.zeros(ENOUGH, 1, 4, 6, dtype=torch.bfloat16)
    mask[..., 2] = float("-inf")
    with torch.inference_mode():
        got = _attention().scaled_dot_product(q, k.float(), v.float(), mask, False)
    assert kernel_calls == []
    assert got.dtype == torch.bfloat16
    want = _sdpa(q.float(), k.float(), v.float(), mask.float()).bfloat16()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_everything_else_takes_pytorchs_attention(kernel_calls: list) -> None:
    """Too few (sentence, head) pairs, one query (greedy), too many queries, causal, float16,
    autocast, autograd, training with dropout: Float32Attention's path, bit for bit."""
    mha = _attention()
    plain = Float32Attention.scaled_dot_product
    cases = [
        (_heads(ENOUGH - 1, 4, 9), False),
        (_heads(ENOUGH, 1, 9), False),
        (_heads(ENOUGH, STEP_QUERIES + 1, 9), False),
        (_heads(ENOUGH, 4, 4), True),
        (_heads(ENOUGH, 4, 9, torch.float16), False),
    ]
    assert (ENOUGH - 1) * HEADS < STEP_PAIRS
    with torch.inference_mode():
        for heads, causal in cases:
            want = plain(mha, *heads, None, causal)
            assert torch.equal(mha.scaled_dot_product(*heads, None, causal), want)
        heads = _heads(ENOUGH, 4, 9, torch.bfloat16)
        want = plain(mha, *heads, None, False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(mha.scaled_dot_product(*heads, None, False), want)
    heads = _heads(ENOUGH, 4, 9)
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
    assert len(kernel_calls) == 2 * (len(cases) + 3)  # each case and its reference


def _model() -> Transformer:
    config = ModelConfig(vocab_size=40, d_model=32, d_ff=64, n_heads=HEADS, n_layers=2)
    torch.manual_seed(0)
    return Transformer(config).eval()


def test_only_the_decoder_gets_it_and_only_where_it_paid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder's attention modules, on the CPUs whose float32 weights are packed for
    oneDNN (x86 other than Intel's, where it was measured); the encoder keeps PyTorch's
    kernel (its queries are whole sentences)."""
    monkeypatch.setattr(aiayn.accel, "fp32_pack_library", lambda: "onednn")
    model = _model()
    acceleration = accelerate(model, "decode", pack_weights=False)
    assert "beam steps attended by products" in acceleration.levers
    decoder = [m for m in model.decoder.modules() if isinstance(m, MultiHeadAttention)]
    encoder = [m for m in model.encoder.modules() if isinstance(m, MultiHeadAttention)]
    assert decoder and all(type(m) is StepAttention for m in decoder)
    assert encoder and all(type(m) is MultiHeadAttention for m in encoder)
    acceleration.undo()
    assert all(type(m) is MultiHeadAttention for m in decoder)
    monkeypatch.setattr(aiayn.accel, "fp32_pack_library", lambda: "mkl")
    acceleration = accelerate(model, "decode")
    assert "beam steps attended by products" not in acceleration.levers
    assert all(type(m) is MultiHeadAttention for m in model.modules() if m in decoder)
    acceleration.undo()
    bf16 = _model().to(torch.bfloat16)
    with accelerate(bf16, "decode", precision="bf16") as acceleration:
        assert "attention in float32" in acceleration.levers
        for module in bf16.modules():
            if isinstance(module, MultiHeadAttention):
                assert isinstance(module, Float32Attention)


def test_beam_search_over_many_sentences_finds_the_plain_hypotheses(
    monkeypatch: pytest.MonkeyPatch, kernel_calls: list
) -> None:
    monkeypatch.setattr(aiayn.accel, "fp32_pack_library", lambda: "onednn")
    plain, fast = _model(), _model()
    accelerate(fast, "decode", pack_weights=False)
    gen = torch.Generator().manual_seed(2)
    sentences = ENOUGH + 1
    src = torch.randint(4, 40, (sentences, 7), generator=gen)
    pad = torch.zeros_like(src, dtype=torch.bool)
    pad[1::2, 5:] = True  # padded memory: the cross-attention's boolean mask
    src[pad] = 0

    def hypotheses(model: Transformer) -> list:
        with torch.inference_mode():
            cache = model.init_cache(model.encode(src, pad), pad, 9, beam_size=4)
            found = beam_search(model.log_probs_step, cache, sentences, beam_size=4, max_len=8)
        return [[(h.tokens, h.score) for h in hyps] for hyps in found]

    got = hypotheses(fast)
    # the encoder's layers only: every decoder step attended by the products
    assert kernel_calls and all(shape[2] == src.size(1) for shape in kernel_calls)
    want = hypotheses(plain)
    assert [[t for t, _ in hyps] for hyps in got] == [[t for t, _ in hyps] for hyps in want]
    for ours, theirs in zip(got, want, strict=True):
        assert [s for _, s in ours] == pytest.approx([s for _, s in theirs], abs=1e-4)
