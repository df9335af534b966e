"""Position-wise feed-forward network (§3.3): FFN(x) = max(0, xW1 + b1)W2 + b2."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.model.dropout import dropout
from aiayn.model.packing import linear


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, relu_dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        self.relu_dropout = relu_dropout
        # Deviation: the paper does not state an initialisation; Xavier-uniform weights and
        # zero biases, as tensor2tensor and fairseq do.
        for layer in (self.w1, self.w2):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        hidden = F.relu(linear(self.w1, x))  # (B, T, d_ff)
        if self.relu_dropout > 0.0:
            hidden = dropout(hidden, self.relu_dropout, self.training)
        return linear(self.w2, hidden)
