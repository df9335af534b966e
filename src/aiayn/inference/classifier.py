"""Texts in, class probabilities out, from an encoder-only classifier (task ``classify``).

Each text becomes ``BOS + tokens + EOS`` (cut to the model's positions, as in training, with a
warning, as ``translate`` warns of a line it cuts), texts are sorted by length and batched by a
token budget, and the softmax of the class logits comes back in input order.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from aiayn.data.collate import BOS_ID, EOS_ID, PAD_ID, pad_sequences
from aiayn.devices import inference_attention
from aiayn.errors import UserError
from aiayn.inference.loading import load_model
from aiayn.inference.textio import checked_lines
from aiayn.inference.translator import TextTokenizer
from aiayn.model.families import EncoderOnly


@dataclass(frozen=True)
class Prediction:
    """The most probable class of a text, and every class's probability."""

    label: str
    probability: float
    probabilities: list[float]  # in the order of TextClassifier.labels


# Texts cut to the model's positions named one by one in a warning; more are counted.
_NAMED_CUTS = 3


def _print_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class TextClassifier:
    """An encoder-only classifier with its tokenizer and class names. ``warn`` receives the
    warnings (default: stderr), e.g. of a text cut to the model's positions."""

    def __init__(
        self,
        model: EncoderOnly,
        tokenizer: TextTokenizer,
        labels: Sequence[str],
        device: torch.device | str = "cpu",
        batch_tokens: int = 4096,
    ) -> None:
        if model.classifier is None:
            raise UserError("the model has no classification head (model.task is not classify)")
        if len(labels) != model.config.n_classes:
            raise UserError(f"{len(labels)} class names for {model.config.n_classes} classes")
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be positive, got {batch_tokens}")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.labels = list(labels)
        self.device = torch.device(device)
        self.batch_tokens = batch_tokens
        self.warn: Callable[[str], None] = _print_warning

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, device: torch.device | str = "cpu", batch_tokens: int = 4096
    ) -> TextClassifier:
        loaded = load_model(path, device, tasks=("classify",))
        assert isinstance(loaded.model, EncoderOnly)
        return cls(loaded.model, loaded.tokenizer, loaded.labels, device, batch_tokens)

    def inputs(self, text: str) -> list[int]:
        """``BOS + tokens + EOS``, the tokens cut to fit the model's positions."""
        room = self.model.config.max_positions - 2
        return [BOS_ID, *self.tokenizer.encode(text)[:room], EOS_ID]

    def probabilities(
        self, texts: Iterable[str], line_numbers: Sequence[int] | None = None
    ) -> torch.Tensor:
        """(len(texts), n_classes) class probabilities, float32, in input order. A text cut
        to the model's positions is warned of, by its number in ``line_numbers`` (default:
        its position among ``texts``, from 1)."""
        return self._probabilities(checked_lines(texts, "probabilities"), line_numbers)

    def _encoded(self, texts: list[str], line_numbers: Sequence[int] | None) -> list[list[int]]:
        """:meth:`inputs` of each text, with a warning for those cut."""
        room = self.model.config.max_positions - 2
        encoded, cut = [], []
        for i, text in enumerate(texts):
            tokens = self.tokenizer.encode(text)
            if len(tokens) > room:
                where = f"line {line_numbers[i]}" if line_numbers is not None else f"text {i + 1}"
                cut.append((where, len(tokens)))
            encoded.append([BOS_ID, *tokens[:room], EOS_ID])
        positions = self.model.config.max_positions
        for where, count in cut[:_NAMED_CUTS]:
            self.warn(
                f"{where}: {count} tokens (+ BOS, EOS) exceed the model's {positions} "
                f"positions; classifying the first {room}"
            )
        if len(cut) > _NAMED_CUTS:
            self.warn(
                f"{len(cut) - _NAMED_CUTS:,} more texts exceed the model's {positions} "
                f"positions; each is classified by its first {room} tokens"
            )
        return encoded

    @torch.no_grad()
    def _probabilities(
        self, texts: list[str], line_numbers: Sequence[int] | None = None
    ) -> torch.Tensor:
        """:meth:`probabilities` of texts already checked."""
        encoded = self._encoded(texts, line_numbers)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        out = torch.zeros(len(encoded), len(self.labels))
        start = 0
        while start < len(order):
            end = start + 1
            while (
                end < len(order)
                and len(encoded[order[end]]) * (end + 1 - start) <= self.batch_tokens
            ):
                end += 1
            rows = order[start:end]
            ids = pad_sequences([encoded[i] for i in rows]).to(self.device)
            with inference_attention(self.device):
                logits = self.model(ids, ids == PAD_ID)
            out[rows] = torch.softmax(logits.float(), dim=-1).cpu()
            start = end
        return out

    def predict(self, texts: Iterable[str]) -> list[Prediction]:
        """The most probable class of each text, with all probabilities."""
        probs = self._probabilities(checked_lines(texts, "predict"))
        best = probs.argmax(dim=-1).tolist()
        return [
            Prediction(self.labels[k], float(row[k]), row.tolist())
            for k, row in zip(best, probs, strict=True)
        ]
