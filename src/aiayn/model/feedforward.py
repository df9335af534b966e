"""Position-wise feed-forward network (§3.3): FFN(x) = max(0, xW1 + b1)W2 + b2.

The ReLU is the paper's; GELU and Swish (SiLU) are options for models trained elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # the exact (erf) form
    "swish": F.silu,
}


class PositionwiseFeedForward(nn.Module):
    """Two linear transformations with a ReLU in between; ``relu_dropout`` (not in the paper,
    0 by default) drops out the ReLU's output."""

    def __init__(
        self, d_model: int, d_ff: int, relu_dropout: float = 0.0, activation: str = "relu"
    ) -> None:
        super().__init__()
        self.activation = ACTIVATIONS[activation]
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(relu_dropout)
        # Deviation: the paper does not state an initialisation; Xavier-uniform weights and
        # zero biases, as tensor2tensor and fairseq do.
        for layer in (self.w1, self.w2):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.dropout(self.activation(self.w1(x))))  # (B, T, d_ff) between
