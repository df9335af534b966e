"""Position-wise feed-forward network (§3.3): FFN(x) = max(0, xW1 + b1)W2 + b2."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class PositionwiseFeedForward(nn.Module):
    """Two linear transformations with a ReLU in between; ``relu_dropout`` (not in the paper,
    0 by default) drops out the ReLU's output."""

    def __init__(self, d_model: int, d_ff: int, relu_dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(relu_dropout)
        # Deviation: the paper does not state an initialisation; Xavier-uniform weights and
        # zero biases, as tensor2tensor and fairseq do.
        for layer in (self.w1, self.w2):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.dropout(F.relu(self.w1(x))))  # (B, T, d_ff) between
