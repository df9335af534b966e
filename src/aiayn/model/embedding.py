"""Token embeddings scaled by √d_model (§3.4) plus positional encodings (§3.5)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoid_table(n_positions: int, d_model: int, layout: str = "interleaved") -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).

    Interleaved: even dimensions hold sines, odd dimensions cosines, as §3.5 writes it. With
    ``layout="halves"`` the same sines fill the first half and the cosines the second: Hugging
    Face's ``MarianSinusoidalPositionalEmbedding``, which ``aiayn import-marian`` reads models
    of. Both keep §3.5's frequencies 10000^(−2i/d_model), i = 0 … d_model/2 − 1.
    tensor2tensor's ``get_timing_signal_1d``, fairseq's ``SinusoidalPositionalEmbedding`` and
    Marian's C++ (``sinusoidalPositionEmbeddings``) also put the sines before the cosines, but
    with the frequencies 10000^(−i/(d_model/2 − 1)): their table is neither of these.
    Computed in float64.
    """
    if d_model % 2 != 0:
        raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (P, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d/2,)
    angle = position / torch.pow(10000.0, two_i / d_model)  # (P, d/2)
    if layout == "halves":
        return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).float()
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


class PositionalEncoding(nn.Module):
    """Positions 0..P-1 as fixed sinusoids (default) or learned vectors (Table 3 row E)."""

    def __init__(
        self, max_positions: int, d_model: int, learned: bool, layout: str = "interleaved"
    ) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.learned: nn.Parameter | None
        if learned:
            # Deviation: the paper does not say how learned positions are initialised;
            # normal(0, d_model^-0.5) like the token embeddings.
            self.learned = nn.Parameter(torch.randn(max_positions, d_model) * d_model**-0.5)
            self.register_buffer("table", None, persistent=False)
        else:
            self.learned = None
            table = sinusoid_table(max_positions, d_model, layout)
            self.register_buffer("table", table, persistent=False)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        """Encodings of positions offset .. offset+length-1: (length, d_model)."""
        if offset + length > self.max_positions:
            raise ValueError(
                f"sequence of {offset + length} positions exceeds model.max_positions="
                f"{self.max_positions}"
            )
        table = self.learned if self.learned is not None else self.get_buffer("table")
        return table[offset : offset + length]


class Embeddings(nn.Module):
    """Dropout(Embedding(ids) · √d_model + PE): the input of both stacks (§3.4, §3.5, §5.4).

    ``token`` may be shared with the other stack and the pre-softmax projection.
    """

    def __init__(self, token: nn.Embedding, positions: PositionalEncoding, dropout: float) -> None:
        super().__init__()
        self.token = token
        self.positions = positions
        self.scale = math.sqrt(token.embedding_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: Tensor, offset: int = 0) -> Tensor:
        x = self.token(ids) * self.scale  # (B, T, d_model)
        x = x + self.positions(ids.size(1), offset).to(x.dtype)
        return self.dropout(x)


def token_embedding(vocab_size: int, d_model: int) -> nn.Embedding:
    """A token embedding, normal with standard deviation d_model^-0.5.

    Deviation: the paper does not state an initialisation; this is tensor2tensor's, so that
    after the √d_model scale of §3.4 the inputs have unit variance."""
    token = nn.Embedding(vocab_size, d_model)
    nn.init.normal_(token.weight, mean=0.0, std=d_model**-0.5)
    return token


def output_projection(token: nn.Embedding, tied: bool, bias: bool = False) -> nn.Linear:
    """The pre-softmax linear transformation (§3.4), without bias (the paper's) or with a zero
    one: with ``tied`` its weight is the very same Parameter as ``token``'s, else its own,
    initialised like an embedding."""
    vocab_size, d_model = token.weight.shape
    out_proj = nn.Linear(d_model, vocab_size, bias=bias)
    if out_proj.bias is not None:
        nn.init.zeros_(out_proj.bias)
    if tied:
        out_proj.weight = token.weight
    else:
        nn.init.normal_(out_proj.weight, mean=0.0, std=d_model**-0.5)
    return out_proj
