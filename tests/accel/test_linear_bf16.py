"""bfloat16 weights packed for oneDNN (aiayn.accel.linear), as ``precision="bf16"`` decodes on
the CPU: the same products as the plain bfloat16 layers to bfloat16's rounding, at every row
count, over padded rows."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from aiayn.accel import CpuLinear, accelerate, cpu_has_bfloat16
from aiayn.accel import linear as linear_module
from aiayn.accel.linear import onednn_packing_available, onednn_rows, pack
from tests.helpers import LetterTokenizer, linear_layers, packing_model, step_log_probs

needs_bf16 = pytest.mark.skipif(
    not (onednn_packing_available() and cpu_has_bfloat16()),
    reason="PyTorch without oneDNN's packed-linear operators, or a CPU without bfloat16",
)


def test_onednn_rows_pads_from_17_rows_to_16_then_64() -> None:
    assert [onednn_rows(rows) for rows in range(1, 17)] == list(range(1, 17))
    for rows in range(17, 400):
        padded = onednn_rows(rows)
        step = 16 if rows <= 64 else 64
        assert padded % step == 0 and rows <= padded < rows + step


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 65, 130])
def test_bf16_products_go_through_the_pack_at_every_row_count(
    rows: int, onednn_rows_seen: list[int]
) -> None:
    torch.manual_seed(1)
    layer = nn.Linear(48, 80).to(torch.bfloat16)
    plain = copy.deepcopy(layer)
    assert accelerate(layer, "decode", precision="bf16").packed == 1
    onednn_rows_seen.clear()  # the pack's own check
    x = torch.randn(rows, 1, 48).bfloat16()  # a decoder step's (B, 1, d) input
    with torch.no_grad():
        got = layer(x)
        want = plain(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (rows, 1, 80)
    # Both round float32 sums to bfloat16: at most a step of 2^-8 apart.
    assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    assert onednn_rows_seen == [onednn_rows(rows)]
    x.requires_grad_()
    assert layer(x).requires_grad  # autograd on: the plain product
    assert onednn_rows_seen == [onednn_rows(rows)]


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_bf16_decoder_steps_equal_those_without_the_packs(
    rows: int, onednn_rows_seen: list[int]
) -> None:
    model = packing_model().to(torch.bfloat16)
    acceleration = accelerate(model, "decode", precision="bf16")
    assert acceleration.packed == len(linear_layers(model))
    packs = {m: m.pack for m in model.modules() if isinstance(m, CpuLinear)}
    for layer in packs:
        layer.pack = None
    onednn_rows_seen.clear()  # the packs' own checks
    want = step_log_probs(model, rows)
    assert onednn_rows_seen == []
    for layer, layer_pack in packs.items():
        layer.pack = layer_pack
    got = step_log_probs(model, rows)
    assert onednn_rows_seen
    assert got.dtype == want.dtype == torch.float32
    assert_close(got, want, rtol=0.0, atol=0.04)  # a bfloat16 step of the logits at most


@needs_bf16
def test_a_bf16_pack_that_disagrees_with_the_plain_product_is_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = linear_module._onednn_linear

    def wrong_from_31_rows(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        out = real(x, packed, bias)
        return out + 0.5 if x.numel() // x.shape[-1] >= 31 else out

    monkeypatch.setattr(linear_module, "_onednn_linear", wrong_from_31_rows)
    assert pack(nn.Linear(16, 24).to(torch.bfloat16)) is None


@needs_bf16
def test_translator_in_bf16_packs_for_onednn() -> None:
    from aiayn.inference.translator import Translator

    model = packing_model()
    translator = Translator(model, LetterTokenizer(), precision="bf16")  # type: ignore[arg-type]
    linears = linear_layers(model)
    assert all(isinstance(m, CpuLinear) and m.pack is not None for m in linears)
    assert all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert len(translator.translate(["hello", "", "abc"])) == 3
