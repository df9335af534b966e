"""The model side of the server: a translator and the cross-attention of one sentence.

The translator is any :class:`~aiayn.inference.translator.TextTranslator`: the PyTorch
engine's :class:`Translator`, or another engine's (``aiayn serve --engine ctranslate2`` passes
:class:`aiayn.interop.ct2_translator.Ct2Translator`), with per-request beam, alpha and n-best
either way. The attention maps need the PyTorch model: with another engine,
:attr:`Engine.attention_available` is False and :meth:`Engine.cross_attention` refuses.

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
from aiayn.config import ModelConfig, RunConfig
from aiayn.inference.attention_maps import attention_weights, token_labeler
from aiayn.inference.constrained import tokens_needed
from aiayn.inference.steering import Steering
from aiayn.inference.translator import TextTranslator, Translation, Translator
from aiayn.model.families import TranslationModel, build_model
from aiayn.model.transformer import count_parameters


class AttentionUnavailable(RuntimeError):
    """The attention maps cannot be drawn: the engine decodes without the PyTorch model, or
    the model's cross-attention does not weigh source tokens."""


@dataclass(frozen=True)
class DecodeKey:
    """The decoding settings of a request; requests with equal keys may share a batch.
    ``word_scores``: the hypotheses' tokens are scored one by one (one more decoder pass)."""

    beam: int
    alpha: float
    nbest: int
    word_scores: bool = False


@dataclass(frozen=True)
class CrossAttention:
    """The best translation of one source and its encoder-decoder attention: ``weights[l]``
    is layer l's (heads, len(target_tokens), len(source_tokens)) tensor; both token lists end
    with ``</s>``; row i is the step that produced target token i."""

    translation: str
    source_tokens: list[str]
    target_tokens: list[str]
    weights: list[Tensor]


def parameters_of(config: ModelConfig) -> int:
    """The parameter count of a translation model with ``config``, without its weights (built on
    PyTorch's meta device): for an engine that decodes without the PyTorch model."""
    with torch.device("meta"):
        return count_parameters(build_model(config))


class Engine:
    """A translator with per-request beam, alpha and n-best, and the attention maps (with
    the PyTorch engine's :class:`Translator`). ``threads`` sets PyTorch's threads on the
    model thread (the PyTorch engine; another engine takes its threads when it is made)."""

    def __init__(
        self,
        translator: TextTranslator,
        config: RunConfig,
        *,
        source: str = "",
        threads: int | None = None,
    ) -> None:
        self.translator = translator
        self.config = config
        self.source = source
        self.threads = threads
        # The PyTorch model, which the attention maps need; None with another engine.
        self.model: TranslationModel | None = (
            translator.model if isinstance(translator, Translator) else None
        )
        self.parameters = (
            count_parameters(self.model) if self.model is not None else parameters_of(config.model)
        )
        self._label: Callable[[int], str] = token_labeler(translator.tokenizer)
        self._source_label = token_labeler(translator.tokenizer, source=True)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        decode_overrides: Mapping[str, Any] | None = None,
        pack_weights: bool | None = None,
        precision: Precision = "fp32",
        threads: int | None = None,
        compiled_step: bool | None = None,
        mmap: bool = True,
        process_settings: bool = False,
    ) -> Engine:
        """The PyTorch engine for a checkpoint file or run directory (the settings are
        :meth:`Translator.from_checkpoint`'s). Another engine's translator, such as the int8
        one of ``aiayn serve --quantize int8`` (``Ct2Translator.from_checkpoint(path,
        quantize="int8")``), is served by ``Engine(translator, config)``."""
        translator, config = Translator.from_checkpoint(
            path,
            device=device,
            decode_overrides=decode_overrides,
            pack_weights=pack_weights,
            precision=precision,
            compiled_step=compiled_step,
            mmap=mmap,
            process_settings=process_settings,
        )
        return cls(translator, config, source=str(path), threads=threads)

    @property
    def name(self) -> str:
        """The engine's name, as ``--engine`` spells it."""
        return self.translator.engine_name

    @property
    def attention_available(self) -> bool:
        """Whether :meth:`cross_attention` can answer: the PyTorch engine, with a model whose
        cross-attention weights fall on source tokens (not on Linformer's projected rows)."""
        return self.attention_unavailable is None

    @property
    def attention_unavailable(self) -> str | None:
        """Why :meth:`cross_attention` cannot answer, or None."""
        if self.model is None:
            return (
                f"attention maps need --engine torch: this server decodes with {self.name}, "
                "without the PyTorch model"
            )
        if self.config.model.cross_attention == "linformer":
            return (
                "attention maps are not drawn for this model: its cross-attention "
                "(model.cross_attention = linformer) weighs projected rows, not source tokens"
            )
        return None

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
        if self.threads is not None and self.model is not None:
            torch.set_num_threads(self.threads)

    # -- any thread ---------------------------------------------------------------------------

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no EOS, not cut); a blank text gives ``[]``."""
        tokenizer = self.translator.tokenizer
        return [tokenizer.encode(text) if text.strip() else [] for text in texts]

    def describe(self) -> dict[str, Any]:
        """What ``GET /v1/model`` reports (plain JSON data): the model, the decoding
        defaults, the engine's own details (:meth:`TextTranslator.engine_details`: its name,
        device, and the PyTorch engine's weight dtypes or CTranslate2's compute type) and
        whether the attention maps are available."""
        threads = {} if self.model is None else {"threads": self.threads or torch.get_num_threads()}
        return {
            "checkpoint": self.source,
            "preset": self.config.preset,
            "config": asdict(self.config.model),
            "vocab_size": self.config.model.vocab_size,
            "parameters": self.parameters,
            "decode": asdict(self.translator.decode),
            **self.translator.engine_details(),
            **threads,
            "attention": self.attention_available,
        }

    # -- the model thread ---------------------------------------------------------------------

    def translate(
        self,
        key: DecodeKey,
        sources: Sequence[Sequence[int]],
        steering: Sequence[Steering] | None = None,
    ) -> list[list[Translation]]:
        """Up to ``key.nbest`` translations per source, best first, in input order; an empty
        source gives ``[]``. ``steering``: one per source (the PyTorch engine meets
        constraints; both engines take a prefix), or None. With ``key.word_scores`` each
        translation has its ``token_log_probs``. Sorting by length and the token budget are
        the translator's."""
        view = self._view(key)
        results = view.translations(view.search_ids(sources, steering))
        if key.word_scores:
            results = view.with_word_scores(sources, results)
        return results

    @property
    def constraints_unavailable(self) -> str | None:
        """Why this engine cannot meet terminology constraints, or None."""
        if self.model is None:
            return (
                f"this server decodes with {self.name}, which has no constrained search: "
                "constraints need --engine torch"
            )
        return None

    def encode_target(self, text: str) -> list[int]:
        """Target-side token ids of a phrase or prefix (no BOS or EOS); ``[]`` for a blank
        text."""
        return self.translator.encode_target(text) if text.strip() else []

    def room_after_prefix(self, source_tokens: int, steering: Steering) -> int | None:
        """The output tokens ``steering``'s constraints need beyond what a source of
        ``source_tokens`` tokens may have, or None where they fit (the limit as
        :meth:`TextTranslator.output_limit` sets it)."""
        if not steering.constraints or not source_tokens:
            return None
        limit = self.translator.output_limit(source_tokens, len(steering.prefix))
        needed = tokens_needed(steering)
        return needed - limit if needed > limit else None

    def token_labels(self, tokens: Sequence[int]) -> list[str]:
        """The pieces of output ``tokens``, then ``</s>`` (what word scores are given for)."""
        return [self._label(i) for i in tokens] + ["</s>"]

    def cross_attention(self, key: DecodeKey, source: Sequence[int]) -> CrossAttention:
        """The best translation of ``source`` (non-empty, at most :attr:`max_source_tokens`)
        under ``key`` and the cross-attention of every layer over it;
        :class:`AttentionUnavailable` without the PyTorch model, or for a model whose
        cross-attention weights are not over source tokens (:attr:`attention_unavailable`)."""
        if self.model is None:
            raise AttentionUnavailable(
                f"the attention maps need the PyTorch model; the {self.name} engine decodes "
                "without it"
            )
        if self.attention_unavailable is not None:
            raise AttentionUnavailable(self.attention_unavailable)
        [hyps] = self.translate(replace(key, nbest=1), [source])
        output = hyps[0].tokens if hyps else []
        _, _, cross = attention_weights(self.model, source, output)
        label = self._label
        return CrossAttention(
            translation=hyps[0].text if hyps else "",
            source_tokens=[self._source_label(i) for i in source] + ["</s>"],
            target_tokens=[label(i) for i in output] + ["</s>"],
            weights=cross,
        )

    def _view(self, key: DecodeKey) -> TextTranslator:
        """The translator with ``key``'s settings: a shallow copy that shares the model (or
        the engine), its acceleration and the tokenizer, so no state of the shared one
        changes."""
        view = copy.copy(self.translator)
        view.decode = replace(self.translator.decode, beam_size=key.beam, alpha=key.alpha)
        view.nbest = key.nbest
        return view
