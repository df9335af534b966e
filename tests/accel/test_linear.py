"""Packed float32 weights (aiayn.accel.linear, MKL): the same products as the plain layers, used
only where they should be, and never with a weight that changed after packing."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from aiayn.accel import accelerate
from aiayn.accel import linear as linear_module
from aiayn.accel.linear import (
    MAX_PACKED_ROWS,
    MIN_PACKED_ROWS,
    optimizer_hook_registered,
    pack,
    packing_available,
)
from aiayn.inference.search import beam_search, greedy_search
from tests.helpers import (
    LetterTokenizer,
    linear_layers,
    packed_flags,
    packing_model,
    search_tokens,
    step_log_probs,
)

pytestmark = [
    pytest.mark.skipif(
        not packing_available(), reason="PyTorch without MKL's packed-linear operators"
    ),
    pytest.mark.usefixtures("intel_cpu"),  # float32 packs are MKL's on Intel CPUs
]


@pytest.fixture
def packed_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Row counts of the products that went through the packed operator."""
    calls: list[int] = []
    real = torch.ops.mkl._mkl_linear

    def spy(x: Tensor, packed: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> Tensor:
        calls.append(rows)
        return real(x, packed, weight, bias, rows)

    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", spy)
    return calls


def _accelerate(model: nn.Module, calls: list[int]) -> int:
    """Accelerate for decoding with packed weights, forgetting the products of the check."""
    count = accelerate(model, "decode", pack_weights=True).packed
    calls.clear()
    return count


def test_every_float_linear_is_packed_and_undo_drops_them() -> None:
    model = packing_model()
    linears = linear_layers(model)
    # Encoder: QKV, Wo, two FFN per layer; decoder: QKV, Wo, Wq, W_kv, Wo, two FFN; the
    # output projection.
    assert len(linears) == 2 * 4 + 2 * 7 + 1
    acceleration = accelerate(model, "decode", pack_weights=True)
    assert acceleration.packed == len(linears) and all(packed_flags(model))
    assert optimizer_hook_registered()
    watchers = linear_module._watchers
    acceleration.undo()
    assert all(type(m) is nn.Linear and "pack" not in m.__dict__ for m in linears)
    assert linear_module._watchers == watchers - 1  # the hook goes with the last one


@pytest.mark.parametrize("rows", [1, 3, MIN_PACKED_ROWS, 64, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1])
def test_products_equal_the_plain_layer_and_are_packed_only_in_the_row_range(
    rows: int, packed_calls: list[int]
) -> None:
    torch.manual_seed(1)
    layer = nn.Linear(48, 80)
    x = torch.randn(rows, 1, 48)  # a decoder step's (B, 1, d) input
    with torch.no_grad():
        want = layer(x)
        _accelerate(layer, packed_calls)
        got = layer(x)
    assert_close(got, want, rtol=1e-5, atol=1e-5)
    in_range = MIN_PACKED_ROWS <= rows <= MAX_PACKED_ROWS
    assert packed_calls == ([rows] if in_range else [])
    assert got.shape == (rows, 1, 80)


def test_not_with_autograd_or_a_non_contiguous_input(packed_calls: list[int]) -> None:
    layer = nn.Linear(16, 24)
    _accelerate(layer, packed_calls)
    x = torch.randn(8, 16, requires_grad=True)
    assert layer(x).requires_grad  # autograd on: the plain product, with a gradient
    with torch.no_grad():
        layer(torch.randn(16, 8).t())  # non-contiguous
    assert packed_calls == []
    with torch.no_grad():
        layer(torch.randn(8, 16))
    assert packed_calls == [8]


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_decoder_steps_equal_the_plain_model(rows: int, packed_calls: list[int]) -> None:
    model = packing_model()
    want = step_log_probs(model, rows)
    assert packed_calls == []
    _accelerate(model, packed_calls)
    got = step_log_probs(model, rows)
    assert_close(got, want, rtol=1e-5, atol=1e-5)
    if rows >= MIN_PACKED_ROWS:
        assert rows in packed_calls  # the step's products (and the projection) went packed
    else:
        assert rows not in packed_calls


@pytest.mark.parametrize("search", [beam_search, greedy_search])
def test_search_finds_the_same_hypotheses(
    search: Callable[..., list], packed_calls: list[int]
) -> None:
    model = packing_model()
    want = search_tokens(model, search is beam_search)
    _accelerate(model, packed_calls)
    assert search_tokens(model, search is beam_search) == want
    assert packed_calls


def test_a_weight_changed_after_packing_is_never_multiplied_stale(
    packed_calls: list[int],
) -> None:
    model = packing_model()
    plain = copy.deepcopy(model)
    _accelerate(model, packed_calls)
    layer = model.decoder.layers[0].ffn.w1
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place, as load_state_dict or copy_ would
        plain.decoder.layers[0].ffn.w1.weight.mul_(2.0)
    got = step_log_probs(model, 6)
    assert packed_flags(model).count(False) == 1  # that layer's pack no longer serves
    assert packed_calls  # the others' still do
    assert_close(got, step_log_probs(plain, 6), rtol=1e-5, atol=1e-5)

    # A new weight tensor (load_state_dict(assign=True), .to()) is caught the same way.
    layer = model.decoder.layers[1].ffn.w2
    layer.weight = nn.Parameter(layer.weight.detach().clone() + 1.0)
    plain.decoder.layers[1].ffn.w2.weight = nn.Parameter(layer.weight.detach().clone())
    assert packed_flags(model).count(False) == 2
    assert_close(step_log_probs(model, 6), step_log_probs(plain, 6), rtol=1e-5, atol=1e-5)


def test_a_copied_model_carries_no_pack_and_decodes_the_same() -> None:
    model = packing_model()
    accelerate(model, "decode", pack_weights=True)
    twin = copy.deepcopy(model)
    assert not any(packed_flags(twin))
    assert_close(step_log_probs(twin, 6), step_log_probs(model, 6), rtol=1e-5, atol=1e-5)
    assert set(twin.state_dict()) == set(
        packing_model().state_dict()
    )  # nothing of it in a checkpoint


def test_what_is_not_packed() -> None:
    model = packing_model().double()
    assert pack(nn.Linear(8, 8).double()) is None  # float64
    with torch.inference_mode():
        inference_layer = nn.Linear(8, 8)  # no version counter to detect changes
    assert pack(inference_layer) is None
    with pytest.raises(ValueError, match="float32"):  # a float64 model is not fp32
        accelerate(model, "decode", pack_weights=True)


def test_an_optimizer_step_makes_every_pack_stale() -> None:
    """Fused Adam (the trainer's CPU optimizer) changes weights without bumping their version
    counter: packs must not serve after a step."""
    from aiayn.config import TrainConfig
    from aiayn.training.optim import build_optimizer

    model = packing_model()
    plain = copy.deepcopy(model).train()
    acceleration = accelerate(model, "decode", pack_weights=True)
    assert all(packed_flags(model))
    model.train()
    src = torch.randint(4, 50, (3, 5))
    for net in (model, plain):
        optimizer = build_optimizer(net, TrainConfig())
        net(src, None, src).logsumexp(-1).mean().backward()
        optimizer.step()
        net.eval()
    assert not any(packed_flags(model))
    assert_close(step_log_probs(model, 6), step_log_probs(plain, 6), rtol=1e-5, atol=1e-5)
    acceleration.undo()


def test_the_layer_behaves_as_nn_linear_where_a_pack_would_not(packed_calls: list[int]) -> None:
    layer = nn.Linear(16, 24)
    _accelerate(layer, packed_calls)
    with torch.no_grad():
        with pytest.raises(RuntimeError):  # the wrong width fails as nn.Linear fails
            layer(torch.randn(8, 20))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(torch.randn(8, 16)).dtype == torch.bfloat16
        assert layer(torch.randn(8, 0, 16)).shape == (8, 0, 24)  # no rows
    assert packed_calls == []
    seen: list[int] = []  # hooks see the packed product like any other
    handle = layer.register_forward_hook(lambda m, args, out: seen.append(out.size(0)))
    with torch.no_grad():
        layer(torch.randn(8, 16))
    handle.remove()
    assert seen == [8] and packed_calls == [8]


def test_a_pack_that_disagrees_with_the_plain_product_is_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = torch.ops.mkl._mkl_linear

    def wrong_from_13_rows(
        x: Tensor, packed: Tensor, weight: Tensor, bias: Tensor | None, rows: int
    ) -> Tensor:
        out = real(x, packed, weight, bias, rows)
        return out + 1e-2 if rows >= 13 else out

    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", wrong_from_13_rows)
    assert pack(nn.Linear(16, 24)) is None


def test_translator_packs_on_request_and_says_when_it_cannot() -> None:
    from aiayn.inference.translator import Translator

    warnings: list[str] = []
    model = packing_model()
    Translator(model, LetterTokenizer(), warn=warnings.append)  # type: ignore[arg-type]
    assert not any(packed_flags(model))
    model = packing_model()
    Translator(model, LetterTokenizer(), pack_weights=True, warn=warnings.append)  # type: ignore[arg-type]
    assert all(packed_flags(model)) and warnings == []
    Translator(
        packing_model().double(),
        LetterTokenizer(),
        pack_weights=True,
        accelerated=False,
        warn=warnings.append,
    )  # type: ignore[arg-type]
    assert len(warnings) == 1 and "nothing to pack" in warnings[0]


@pytest.mark.parametrize(("rows", "seen"), [(70, 128), (128, 128), (64, 64), (40, 40)])
def test_bf16_products_on_the_cpu_see_rows_padded_to_a_multiple_of_64(
    rows: int, seen: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # oneDNN compiles a kernel per new row count of a bfloat16 product: row counts above 64
    # are padded to a multiple of 64, and the padding is cut off again (values and gradients).
    layer = nn.Linear(16, 8)
    plain = copy.deepcopy(layer)
    accelerate(layer, "train", precision="bf16")
    sizes: list[int] = []
    real = torch.nn.functional.linear

    def spy(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        sizes.append(x.numel() // x.size(-1))
        return real(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    x = torch.randn(rows, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x.view(1, rows, 16))
        want = plain(x.view(1, rows, 16))
    assert sizes == [seen, rows] and got.shape == want.shape == (1, rows, 8)
    assert_close(got, want, rtol=1e-2, atol=1e-2)
    grad = torch.randn(1, rows, 8)
    (first,) = torch.autograd.grad(got, x, grad)
    (second,) = torch.autograd.grad(want, x, grad)
    assert_close(first, second, rtol=1e-2, atol=1e-2)
    sizes.clear()
    layer(torch.randn(rows, 16))  # float32 outside autocast: as it is
    assert sizes == [rows]
