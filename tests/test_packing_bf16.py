"""bfloat16 weights packed for oneDNN (aiayn.model.packing), as ``precision="bf16"`` decodes on
the CPU: the same products as the plain bfloat16 layers at every row count, rows padded so that
oneDNN builds few kernels, float32 log-probabilities in the cache's buffer."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from aiayn.config import ModelConfig
from aiayn.model import packing
from aiayn.model.packing import is_packed, linear, onednn_rows, pack_for_inference, uses_packed
from aiayn.model.transformer import Transformer
from aiayn.runtime import cpu_has_bfloat16
from decode_helpers import step_log_probs

needs_bf16 = pytest.mark.skipif(
    not (packing.onednn_packing_available() and cpu_has_bfloat16()),
    reason="PyTorch without oneDNN's packed-linear operators, or a CPU without bfloat16",
)


def _model() -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=50, d_model=32, d_ff=64, n_heads=4, n_layers=2, dropout=0.0)
    return Transformer(config).eval().to(torch.bfloat16)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


@pytest.fixture
def onednn_rows_seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Row counts of the products that went through oneDNN's packed operator."""
    calls: list[int] = []
    real = packing._onednn_linear

    def spy(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        calls.append(x.numel() // x.shape[-1])
        return real(x, packed, bias)

    monkeypatch.setattr(packing, "_onednn_linear", spy)
    return calls


def test_onednn_rows_pads_from_17_rows_to_16_then_64() -> None:
    assert [onednn_rows(rows) for rows in range(1, 17)] == list(range(1, 17))
    for rows in range(17, 400):
        padded = onednn_rows(rows)
        step = 16 if rows <= 64 else 64
        assert padded % step == 0 and rows <= padded < rows + step


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 65, 130])
def test_bf16_linear_goes_through_the_pack_at_every_row_count(
    rows: int, onednn_rows_seen: list[int]
) -> None:
    torch.manual_seed(1)
    layer = nn.Linear(48, 80).to(torch.bfloat16)
    assert pack_for_inference(layer) == 1 and is_packed(layer)
    onednn_rows_seen.clear()  # the pack's own check
    x = torch.randn(rows, 1, 48).bfloat16()  # a decoder step's (B, 1, d) input
    with torch.no_grad():
        got = linear(layer, x)
        want = layer(x)
        assert uses_packed(layer, x)
        assert not uses_packed(layer, x.float())  # a float32 input: the layer itself
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (rows, 1, 80)
    # Both round float32 sums to bfloat16: at most a step of 2^-8 apart.
    assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    assert onednn_rows_seen == [onednn_rows(rows)]
    x.requires_grad_()
    assert linear(layer, x).requires_grad  # autograd on: the layer itself
    assert onednn_rows_seen == [onednn_rows(rows)]


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_bf16_decoder_steps_equal_the_unpacked_bf16_model(
    rows: int, onednn_rows_seen: list[int]
) -> None:
    model = _model()
    want, _ = step_log_probs(model, rows)
    assert onednn_rows_seen == []
    assert pack_for_inference(model) == len(_linears(model))
    got, in_scratch = step_log_probs(model, rows)
    assert onednn_rows_seen
    # float32 log-probabilities, written into the cache's buffer
    assert got.dtype == want.dtype == torch.float32 and in_scratch
    assert_close(got, want, rtol=0.0, atol=0.04)  # a bfloat16 step of the logits at most


@needs_bf16
def test_a_bf16_pack_that_disagrees_with_the_plain_product_is_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = packing._onednn_linear

    def wrong_from_31_rows(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        out = real(x, packed, bias)
        return out + 0.5 if x.numel() // x.shape[-1] >= 31 else out

    monkeypatch.setattr(packing, "_onednn_linear", wrong_from_31_rows)
    layer = nn.Linear(16, 24).to(torch.bfloat16)
    assert pack_for_inference(layer) == 0 and not is_packed(layer)


@needs_bf16
def test_translator_in_bf16_packs_for_onednn() -> None:
    from aiayn.inference.translator import Translator

    class Letters:
        def encode(self, text: str) -> list[int]:
            return [4 + (ord(c) % 40) for c in text]

        def decode(self, ids: list[int]) -> str:
            return "".join(chr(97 + i % 26) for i in ids)

    model = _model().float()
    translator = Translator(model, Letters(), precision="bf16")  # type: ignore[arg-type]
    assert all(is_packed(m) and m.weight.dtype == torch.bfloat16 for m in _linears(model))
    assert len(translator.translate(["hello", "", "abc"])) == 3
