"""The CPU dropout of aiayn.accel.dropout: one 64-bit draw per four elements, and the modules
that accelerate() swaps in with it."""

from __future__ import annotations

import math

import pytest
import torch

import aiayn.accel.dropout as dropout_module
from aiayn.accel.dropout import (
    GridDropout,
    GridResidual,
    drop_probability,
    dropout,
    dropout_add,
    keep_mask,
)
from aiayn.model.layers import Residual

CPU = torch.device("cpu")


def within(observed: float, expected: float, n: int, sigmas: float = 5.0) -> bool:
    """A frequency over n Bernoulli(expected) trials within `sigmas` standard deviations."""
    return abs(observed - expected) <= sigmas * math.sqrt(expected * (1 - expected) / n)


def test_identity_when_not_training_or_p_zero() -> None:
    x = torch.randn(8, 5)
    assert dropout(x, 0.1, training=False) is x
    assert dropout(x, 0.0, training=True) is x


def test_drop_probability_is_p_on_a_2_to_16_grid() -> None:
    assert drop_probability(0.1) == 6554 / 65536
    assert drop_probability(0.5) == 0.5
    assert abs(drop_probability(0.3) - 0.3) <= 2**-17
    # Never 1 for a valid p < 1, so the scale of the kept elements stays finite.
    assert drop_probability(0.999999) == 1 - 2**-16


def test_threshold_drops_exactly_the_realised_level(monkeypatch: pytest.MonkeyPatch) -> None:
    # Feed keep_mask every 16-bit value once: exactly drop_probability(p) · 2¹⁶ are dropped.
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int64).to(torch.int16)
    words = every.view(torch.int64)  # 16,384 words, four quarters each

    def fake_randint(low: int, high: int, size: tuple[int, ...], device: object) -> torch.Tensor:
        assert size == (words.numel(),)
        return words.clone()

    monkeypatch.setattr(dropout_module.torch, "randint", fake_randint)
    for p in (1e-3, 0.1, 0.3, 0.5, 0.9, 0.999999):
        dropped = int((~keep_mask(torch.Size([1 << 16]), p, CPU)).sum())
        assert dropped == round(drop_probability(p) * (1 << 16))


def test_p_far_from_the_grid_uses_exact_dropout() -> None:
    # 1e-5 would become 1.53e-5 on the 2⁻¹⁶ grid: F.dropout draws it exactly instead.
    torch.manual_seed(4)
    n = 1 << 22
    y = dropout(torch.ones(n), 1e-5, training=True)
    assert within((y == 0).double().mean().item(), 1e-5, n)
    assert torch.isfinite(dropout(torch.ones(1000), 0.999999, training=True)).all()


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_drop_rate_matches_p(p: float) -> None:
    torch.manual_seed(0)
    n = 1 << 22
    dropped = (~keep_mask(torch.Size([n]), p, CPU)).double().mean().item()
    assert within(dropped, drop_probability(p), n)


def test_the_four_elements_of_one_draw_are_independent() -> None:
    # Elements 4k .. 4k+3 come from one 64-bit draw: each lane has the drop rate p, and
    # every pair of lanes drops together with probability p², not more or less.
    torch.manual_seed(1)
    p, words = 0.3, 1 << 20
    lanes = (~keep_mask(torch.Size([words * 4]), p, CPU)).view(words, 4).double()
    q = drop_probability(p)
    for i in range(4):
        assert within(lanes[:, i].mean().item(), q, words)
        for j in range(i + 1, 4):
            both = (lanes[:, i] * lanes[:, j]).mean().item()
            assert within(both, q * q, words)
    # ... and consecutive draws are independent too (lane 3 of one word, lane 0 of the next).
    both = (lanes[:-1, 3] * lanes[1:, 0]).mean().item()
    assert within(both, q * q, words - 1)


def test_kept_elements_are_scaled_and_the_mean_is_kept() -> None:
    torch.manual_seed(2)
    p = 0.1
    q = drop_probability(p)
    x = torch.rand(1 << 20) + 0.5  # no zeros of its own
    y = dropout(x, p, training=True)
    kept = y != 0
    scale = 1.0 / (1.0 - q)
    torch.testing.assert_close(y[kept], x[kept] * scale, rtol=0, atol=0)
    n = x.numel()
    assert within(1.0 - kept.double().mean().item(), q, n)
    ones = dropout(torch.ones(n), p, training=True)
    # mean of (scale × Bernoulli(1 - q)) is 1; its standard deviation is scale·√(q(1-q)/n).
    bound = 5 * scale * math.sqrt(q * (1 - q) / n)
    assert abs(ones.double().mean().item() - 1.0) <= bound


def test_gradient_is_the_scaled_mask() -> None:
    torch.manual_seed(3)
    x = torch.randn(64, 33, requires_grad=True)
    y = dropout(x, 0.25, training=True)
    y.backward(torch.ones_like(y))
    assert x.grad is not None
    kept = y.detach() != 0
    expected = kept.float() / (1.0 - drop_probability(0.25))
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_a_float_mask_is_the_bool_mask_written_as_0_and_1() -> None:
    torch.manual_seed(5)
    as_bool = keep_mask(torch.Size([3, 1001]), 0.1, CPU)
    torch.manual_seed(5)
    as_float = keep_mask(torch.Size([3, 1001]), 0.1, CPU, torch.float32)
    assert as_float.dtype == torch.float32 and as_float.shape == (3, 1001)
    assert torch.equal(as_float, as_bool.float())


def test_odd_sizes_and_shapes() -> None:
    for shape in [(1,), (3,), (5, 7), (2, 3, 5)]:
        mask = keep_mask(torch.Size(shape), 0.5, CPU)
        assert mask.shape == shape and mask.dtype == torch.bool


@pytest.mark.parametrize("p", [0.1, 0.3, 0.005])  # 0.005: the F.dropout fallback
def test_dropout_add_is_the_residual_sum_with_the_same_mask_and_gradients(p: float) -> None:
    """dropout_add(x, y) is x + dropout(y) for the same random state: same values (exactly),
    same gradients."""
    x1 = torch.randn(6, 7, 33, requires_grad=True)
    y1 = torch.randn(6, 7, 33, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y2 = y1.detach().clone().requires_grad_()
    grad = torch.randn(6, 7, 33)
    torch.manual_seed(11)
    want = x1 + dropout(y1, p, training=True)
    want.backward(grad)
    torch.manual_seed(11)
    got = dropout_add(x2, y2, p, training=True)
    got.backward(grad)
    assert torch.equal(got, want)
    assert x2.grad is not None and x1.grad is not None and torch.equal(x2.grad, x1.grad)
    assert y2.grad is not None and y1.grad is not None and torch.equal(y2.grad, y1.grad)
    assert 0 < int((got == x2).sum()) < got.numel()  # some elements of y dropped, not all


def test_dropout_add_without_dropout_is_the_sum() -> None:
    x, y = torch.randn(4, 9), torch.randn(4, 9)
    assert torch.equal(dropout_add(x, y, 0.1, training=False), x + y)
    assert torch.equal(dropout_add(x, y, 0.0, training=True), x + y)


def test_the_modules_are_the_functions() -> None:
    x, y = torch.randn(64, 48), torch.randn(64, 48)
    layer = torch.nn.Dropout(0.1)
    layer.__class__ = GridDropout
    residual = Residual(0.1)
    residual.__class__ = GridResidual
    torch.manual_seed(5)
    want_dropout, want_add = dropout(y, 0.1, True), dropout_add(x, y, 0.1, True)
    torch.manual_seed(5)
    assert torch.equal(layer(y), want_dropout)
    assert torch.equal(residual(x, y), want_add)
    layer.eval()
    residual.eval()
    assert layer(y) is y and torch.equal(residual(x, y), x + y)
