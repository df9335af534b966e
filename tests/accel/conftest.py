"""Fixtures of the acceleration tests."""

import pytest
from torch import Tensor

from aiayn.accel import linear as linear_module


@pytest.fixture
def onednn_rows_seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Row counts of the products that went through oneDNN's packed operator."""
    calls: list[int] = []
    real = linear_module._onednn_linear

    def spy(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        calls.append(x.numel() // x.shape[-1])
        return real(x, packed, bias)

    monkeypatch.setattr(linear_module, "_onednn_linear", spy)
    return calls
