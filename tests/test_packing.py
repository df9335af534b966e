"""MKL pre-packed weights (aiayn.model.packing): the same products as the plain layers, used
only where they should be, and never with a weight that changed after packing."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from aiayn.config import ModelConfig
from aiayn.inference.search import beam_search, greedy_search
from aiayn.model import packing
from aiayn.model.packing import (
    MAX_PACKED_ROWS,
    MIN_PACKED_ROWS,
    is_packed,
    linear,
    pack_for_inference,
    unpack,
    uses_packed,
)
from aiayn.model.transformer import Transformer
from decode_helpers import step_log_probs

pytestmark = pytest.mark.skipif(
    not packing.packing_available(), reason="PyTorch without MKL's packed-linear operators"
)


def _model(vocab: int = 50) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=vocab, d_model=32, d_ff=64, n_heads=4, n_layers=2, dropout=0.0)
    return Transformer(config).eval()


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


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


def _pack(model: nn.Module, calls: list[int]) -> int:
    """pack_for_inference, forgetting the products of its own check."""
    count = pack_for_inference(model)
    calls.clear()
    return count


def test_every_float_linear_is_packed_and_unpack_drops_them() -> None:
    model = _model()
    linears = _linears(model)
    # Encoder: QKV, Wo, two FFN per layer; decoder: QKV, Wo, Wq, W_kv, Wo, two FFN; the
    # output projection.
    assert len(linears) == 2 * 4 + 2 * 7 + 1
    assert pack_for_inference(model) == len(linears)
    assert all(is_packed(m) for m in linears)
    unpack(model)
    assert not any(is_packed(m) for m in linears)


@pytest.mark.parametrize("rows", [1, 3, MIN_PACKED_ROWS, 64, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1])
def test_linear_equals_the_module_and_is_packed_only_in_the_row_range(
    rows: int, packed_calls: list[int]
) -> None:
    torch.manual_seed(1)
    layer = nn.Linear(48, 80)
    _pack(layer, packed_calls)
    x = torch.randn(rows, 1, 48)  # a decoder step's (B, 1, d) input
    with torch.no_grad():
        got = linear(layer, x)
        want = layer(x)
    assert_close(got, want, rtol=1e-5, atol=1e-5)
    in_range = MIN_PACKED_ROWS <= rows <= MAX_PACKED_ROWS
    assert packed_calls == ([rows] if in_range else [])
    assert got.shape == (rows, 1, 80)


def test_not_with_autograd_non_contiguous_input_or_a_layer_without_a_pack(
    packed_calls: list[int],
) -> None:
    layer, other = nn.Linear(16, 24), nn.Linear(16, 24)
    _pack(layer, packed_calls)
    x = torch.randn(8, 16, requires_grad=True)
    out = linear(layer, x)  # autograd on: the module itself, with a gradient
    assert out.requires_grad
    with torch.no_grad():
        linear(layer, torch.randn(16, 8).t())  # non-contiguous
        linear(other, torch.randn(8, 16))
    assert packed_calls == []
    with torch.no_grad():
        linear(layer, torch.randn(8, 16))
    assert packed_calls == [8]


def _step_log_probs(model: Transformer, rows: int) -> Tensor:
    return step_log_probs(model, rows)[0]


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_decoder_steps_equal_the_unpacked_model(rows: int, packed_calls: list[int]) -> None:
    model = _model()
    want = _step_log_probs(model, rows)
    assert packed_calls == []
    _pack(model, packed_calls)
    got = _step_log_probs(model, rows)
    assert_close(got, want, rtol=1e-5, atol=1e-5)
    if rows >= MIN_PACKED_ROWS:
        assert rows in packed_calls  # the step's products (and the projection) went packed
    else:
        assert rows not in packed_calls


def _search(model: Transformer, search: Callable[..., list]) -> list:
    torch.manual_seed(3)
    src = torch.randint(4, 50, (6, 7))
    src_pad = torch.zeros_like(src, dtype=torch.bool)
    with torch.inference_mode():
        memory = model.encode(src, src_pad)
        if search is beam_search:
            cache = model.init_cache(memory, src_pad, max_len=12, beam_size=4)
            hyps = beam_search(model.log_probs_step, cache, 6, beam_size=4, max_len=11, alpha=0.6)
            return [[h.tokens for h in sentence] for sentence in hyps]
        cache = model.init_cache(memory, src_pad, max_len=12)
        return [h.tokens for h in greedy_search(model.log_probs_step, cache, 6, max_len=11)]


@pytest.mark.parametrize("search", [beam_search, greedy_search])
def test_search_finds_the_same_hypotheses(
    search: Callable[..., list], packed_calls: list[int]
) -> None:
    model = _model()
    want = _search(model, search)
    _pack(model, packed_calls)
    assert _search(model, search) == want
    assert packed_calls


def test_a_weight_changed_after_packing_is_never_multiplied_stale(
    packed_calls: list[int],
) -> None:
    model = _model()
    pack_for_inference(model)
    layer = model.decoder.layers[0].ffn.w1
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place, as load_state_dict or copy_ would
    got = _step_log_probs(model, 6)
    assert not is_packed(layer)  # encode / init_cache dropped the stale copy
    assert is_packed(model.decoder.layers[0].ffn.w2)
    unpack(model)
    assert_close(got, _step_log_probs(model, 6), rtol=1e-5, atol=1e-5)

    # A new weight tensor (load_state_dict(assign=True), .to()) is caught the same way.
    pack_for_inference(model)
    layer.weight = nn.Parameter(layer.weight.detach().clone() + 1.0)
    got = _step_log_probs(model, 6)
    assert not is_packed(layer)
    unpack(model)
    assert_close(got, _step_log_probs(model, 6), rtol=1e-5, atol=1e-5)


def test_a_copied_model_is_not_packed_and_decodes_the_same() -> None:
    model = _model()
    pack_for_inference(model)
    twin = copy.deepcopy(model)
    assert not any(is_packed(m) for m in _linears(twin))
    assert_close(_step_log_probs(twin, 6), _step_log_probs(model, 6), rtol=1e-5, atol=1e-5)
    state = twin.state_dict()
    assert set(state) == set(model.state_dict())  # nothing of the packing in a checkpoint


def test_what_is_not_packed() -> None:
    model = _model().double()
    assert pack_for_inference(model) == 0  # float64
    with torch.inference_mode():
        inference_layer = nn.Linear(8, 8)  # no version counter to detect changes
    assert pack_for_inference(inference_layer) == 0
    with torch.no_grad():
        quantized = torch.ao.quantization.quantize_dynamic(_model(), {nn.Linear}, dtype=torch.qint8)
    assert pack_for_inference(quantized) == 0


def test_uses_packed_matches_what_linear_does(packed_calls: list[int]) -> None:
    layer = nn.Linear(16, 16)
    _pack(layer, packed_calls)
    with torch.no_grad():
        for rows in (1, MIN_PACKED_ROWS, MAX_PACKED_ROWS + 1):
            x = torch.randn(rows, 16)
            before = len(packed_calls)
            linear(layer, x)
            assert uses_packed(layer, x) == (len(packed_calls) == before + 1)


def test_an_optimizer_step_drops_the_packed_copies() -> None:
    """Fused Adam (the trainer's CPU optimizer) changes weights without bumping their version
    counter: packed copies must not survive a step."""
    from aiayn.config import TrainConfig
    from aiayn.training.optim import build_optimizer

    model = _model().train()
    optimizer = build_optimizer(model, TrainConfig())
    pack_for_inference(model)
    assert all(is_packed(m) for m in _linears(model))
    src = torch.randint(4, 50, (3, 5))
    model(src, None, src).logsumexp(-1).mean().backward()
    optimizer.step()
    assert not any(is_packed(m) for m in _linears(model))
    model.eval()
    got = _step_log_probs(model, 6)
    unpack(model)
    assert_close(got, _step_log_probs(model, 6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("entry", ["init_cache", "decode"])
def test_every_entry_point_drops_stale_copies(entry: str) -> None:
    model = _model()
    pack_for_inference(model)
    layer = model.decoder.layers[1].self_attn.qkv_proj
    with torch.no_grad():
        layer.weight.add_(0.5)
        memory = torch.randn(2, 3, 32)
        if entry == "init_cache":
            model.init_cache(memory, None, max_len=2)
        else:
            model.decode(torch.randint(4, 50, (2, 2)), memory, None)
        x = torch.randn(8, 32)
        # linear() trusts the table: the stale copy must be gone from it, the others not.
        assert not uses_packed(layer, x)
        assert uses_packed(model.decoder.layers[0].self_attn.qkv_proj, x)


def test_the_layer_itself_where_packing_would_change_behaviour(
    packed_calls: list[int],
) -> None:
    layer = nn.Linear(16, 24)
    _pack(layer, packed_calls)
    with torch.no_grad():
        with pytest.raises(RuntimeError):  # the wrong width fails as nn.Linear fails
            linear(layer, torch.randn(8, 20))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert linear(layer, torch.randn(8, 16)).dtype == torch.bfloat16
        seen: list[int] = []
        handle = layer.register_forward_hook(lambda m, args, out: seen.append(out.size(0)))
        linear(layer, torch.randn(8, 16))
        handle.remove()
        assert seen == [8]
        assert linear(layer, torch.randn(8, 0, 16)).shape == (8, 0, 24)  # no rows
    assert packed_calls == []


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
    assert pack_for_inference(nn.Linear(16, 24)) == 0


def test_translator_packs_on_request_and_says_when_it_cannot() -> None:
    from aiayn.inference.translator import Translator

    class Letters:
        vocab_size = 50

        def encode(self, text: str) -> list[int]:
            return [4 + (ord(c) % 40) for c in text]

        def decode(self, ids: list[int]) -> str:
            return "".join(chr(97 + i % 26) for i in ids)

    model = _model()
    warnings: list[str] = []
    Translator(model, Letters(), warn=warnings.append)  # type: ignore[arg-type]
    assert not any(is_packed(m) for m in _linears(model))
    Translator(model, Letters(), pack_weights=True, warn=warnings.append)  # type: ignore[arg-type]
    assert all(is_packed(m) for m in _linears(model)) and warnings == []
    Translator(model.double(), Letters(), pack_weights=True, warn=warnings.append)  # type: ignore[arg-type]
    assert len(warnings) == 1 and "nothing to pack" in warnings[0]


@pytest.mark.parametrize(("rows", "seen"), [(70, 128), (128, 128), (64, 64), (40, 40)])
def test_bf16_products_on_the_cpu_see_rows_padded_to_a_multiple_of_64(rows: int, seen: int):
    # oneDNN compiles a kernel per new row count of a bfloat16 product: row counts above 64
    # are padded to a multiple of 64, and the padding is cut off again (values and gradients).
    layer = nn.Linear(16, 8)
    sizes: list[int] = []
    layer.register_forward_pre_hook(lambda _, args: sizes.append(args[0].numel() // 16))
    x = torch.randn(rows, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear(layer, x.view(1, rows, 16))
        want = layer(x.view(1, rows, 16))
    assert sizes == [seen, rows] and got.shape == want.shape == (1, rows, 8)
    assert_close(got, want, rtol=1e-2, atol=1e-2)
    grad = torch.randn(1, rows, 8)
    (first,) = torch.autograd.grad(got, x, grad)
    (second,) = torch.autograd.grad(want, x, grad)
    assert_close(first, second, rtol=1e-2, atol=1e-2)
    sizes.clear()
    linear(layer, torch.randn(rows, 16))  # float32 outside autocast: as it is
    assert sizes == [rows]
