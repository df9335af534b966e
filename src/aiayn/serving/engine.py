"""The model side of the server: a :class:`Translator` and the cross-attention of one sentence.

Decoding and attention run on one thread only (the batcher's model thread): an accelerated
model reuses its step buffers, and the attention hooks are attached to the model itself, so
two calls at once would trample each other. Tokenising (:meth:`Engine.encode`) touches the
tokenizer alone and may run on any thread.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aiayn.accel import Precision
from aiayn.config import RunConfig
from aiayn.inference.attention_maps import attention_weights, token_labeler
from aiayn.inference.textio import one_line
from aiayn.inference.translator import Translation, Translator
from aiayn.model.transformer import count_parameters


@dataclass(frozen=True)
class DecodeKey:
    """The decoding settings of a request; requests with equal keys may share a batch."""

    beam: int
    alpha: float
    nbest: int


@dataclass(frozen=True)
class CrossAttention:
    """The best translation of one source and its encoder-decoder attention: ``weights[l]``
    is layer l's (heads, len(target_tokens), len(source_tokens)) tensor; both token lists end
    with ``</s>``; row i is the step that produced target token i."""

    translation: str
    source_tokens: list[str]
    target_tokens: list[str]
    weights: list[Tensor]


class Engine:
    """A translator with per-request beam, alpha and n-best, and the attention maps."""

    def __init__(
        self,
        translator: Translator,
        config: RunConfig,
        *,
        source: str = "",
        threads: int | None = None,
    ) -> None:
        self.translator = translator
        self.config = config
        self.source = source
        self.threads = threads
        self.parameters = count_parameters(translator.model)
        self._label: Callable[[int], str] = token_labeler(translator.tokenizer)
        self._source_label = token_labeler(translator.tokenizer, source=True)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        decode_overrides: Mapping[str, Any] | None = None,
        pack_weights: bool = False,
        precision: Precision = "fp32",
        threads: int | None = None,
    ) -> Engine:
        translator, config = Translator.from_checkpoint(
            path,
            device=device,
            decode_overrides=decode_overrides,
            pack_weights=pack_weights,
            precision=precision,
        )
        return cls(translator, config, source=str(path), threads=threads)

    @property
    def default_key(self) -> DecodeKey:
        decode = self.translator.decode
        return DecodeKey(decode.beam_size, decode.alpha, 1)

    @property
    def batch_tokens(self) -> int:
        return self.translator.decode.batch_tokens

    @property
    def max_source_tokens(self) -> int:
        """The most tokens a source may have (the model's positions less one for EOS)."""
        return self.translator.max_positions - 1

    def start_thread(self) -> None:
        """Called once on the model thread before its first batch."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)

    # -- any thread ---------------------------------------------------------------------------

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no EOS, not cut); a blank text gives ``[]``."""
        tokenizer = self.translator.tokenizer
        return [tokenizer.encode(text) if text.strip() else [] for text in texts]

    def describe(self) -> dict[str, Any]:
        """What ``GET /v1/model`` reports (plain JSON data)."""
        translator = self.translator
        weights = {str(p.dtype).removeprefix("torch.") for p in translator.model.parameters()}
        return {
            "checkpoint": self.source,
            "preset": self.config.preset,
            "config": asdict(self.config.model),
            "vocab_size": self.config.model.vocab_size,
            "parameters": self.parameters,
            "decode": asdict(translator.decode),
            "device": str(translator.device),
            "weights_dtype": sorted(weights),
            "accelerated": translator.acceleration is not None,
            "threads": torch.get_num_threads() if self.threads is None else self.threads,
        }

    # -- the model thread ---------------------------------------------------------------------

    def translate(
        self, key: DecodeKey, sources: Sequence[Sequence[int]]
    ) -> list[list[Translation]]:
        """Up to ``key.nbest`` translations per source, best first, in input order; an empty
        source gives ``[]``. Sorting by length and the token budget are the translator's."""
        view = self._view(key)
        results = view.search_ids(sources)
        decode = self.translator.tokenizer.decode
        return [
            [Translation(one_line(decode(h.tokens)), h.score, h.log_prob, h.tokens) for h in hyps]
            for hyps in results
        ]

    def cross_attention(self, key: DecodeKey, source: Sequence[int]) -> CrossAttention:
        """The best translation of ``source`` (non-empty, at most :attr:`max_source_tokens`)
        under ``key`` and the cross-attention of every layer over it."""
        [hyps] = self.translate(replace(key, nbest=1), [source])
        output = hyps[0].tokens if hyps else []
        _, _, cross = attention_weights(self.translator.model, source, output)
        label = self._label
        return CrossAttention(
            translation=hyps[0].text if hyps else "",
            source_tokens=[self._source_label(i) for i in source] + ["</s>"],
            target_tokens=[label(i) for i in output] + ["</s>"],
            weights=cross,
        )

    def _view(self, key: DecodeKey) -> Translator:
        """The translator with ``key``'s settings: a shallow copy that shares the model, its
        acceleration and the tokenizer, so no state of the shared one changes."""
        view = copy.copy(self.translator)
        view.decode = replace(self.translator.decode, beam_size=key.beam, alpha=key.alpha)
        view.nbest = key.nbest
        return view
