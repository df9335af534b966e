"""Text from a decoder-only language model: a prompt in, its continuation out.

The prompt ``BOS + tokens`` goes through the KV cache one position at a time, then one of the
searches of :mod:`aiayn.inference.search` continues it from its last token: greedy, beam, or
sampling with temperature, top-k and top-p. PAD and BOS are never generated; the continuation
ends at EOS (the end of a line of the training text) or after ``max_new_tokens``.

Greedy search and sampling can hand each new piece of text to a callback as soon as its token
is chosen (``aiayn generate`` prints it: streaming); beam search knows its best continuation
only at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from aiayn.data.collate import BOS_ID, EOS_ID
from aiayn.devices import inference_attention
from aiayn.errors import UserError
from aiayn.inference.loading import load_model
from aiayn.inference.search import (
    Hypothesis,
    beam_search,
    greedy_search,
    never_pad_or_bos,
    sample,
)
from aiayn.inference.translator import TextTokenizer, check_alpha
from aiayn.model.cache import DecoderCache
from aiayn.model.families import DecoderOnlyLM
from aiayn.model.patterns import check_decodable

Strategy = Literal["greedy", "beam", "sample"]


@dataclass(frozen=True)
class GenerateOptions:
    """How to continue a prompt; ``seed`` makes sampling repeatable."""

    max_new_tokens: int = 100
    strategy: Strategy = "sample"
    beam_size: int = 4
    alpha: float = 0.6
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.strategy not in ("greedy", "beam", "sample"):
            raise UserError(f"strategy must be greedy, beam or sample, not {self.strategy!r}")
        if self.beam_size < 1:
            raise UserError(f"beam size must be at least 1, got {self.beam_size}")
        check_alpha(self.alpha)
        if not 0 < self.temperature < math.inf:  # NaN fails too
            raise UserError(f"temperature must be a positive number, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top-k must be 0 (off) or more, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # what torch takes
            raise UserError(f"seed must be from -2**63 to 2**64 - 1, got {self.seed}")


@dataclass(frozen=True)
class Generation:
    """A continuation: its text (spaced as it follows the prompt), its token ids, and its
    log-probability under the model (temperature 1, no filtering)."""

    text: str
    tokens: list[int]
    log_prob: float
    finished: bool  # ended with EOS (else: max_new_tokens, or the model's positions, ran out)


class TextGenerator:
    """A decoder-only LM and its tokenizer, ready to continue prompts."""

    def __init__(
        self, model: DecoderOnlyLM, tokenizer: TextTokenizer, device: torch.device | str = "cpu"
    ) -> None:
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: torch.device | str = "cpu") -> TextGenerator:
        loaded = load_model(path, device, tasks=("lm",))
        assert isinstance(loaded.model, DecoderOnlyLM)
        check_decodable(loaded.config.model.decoder_attention, loaded.path)
        return cls(loaded.model, loaded.tokenizer, device)

    def prompt_ids(self, prompt: str) -> list[int]:
        """``BOS + tokens`` of the prompt, the context the model continues."""
        return [BOS_ID, *self.tokenizer.encode(prompt)]

    def checked_prompt_ids(self, prompt: str) -> list[int]:
        """:meth:`prompt_ids`, refused (UserError) where the model has no position left to
        continue it."""
        context = self.prompt_ids(prompt)
        limit = self.model.config.max_positions
        if len(context) >= limit:
            raise UserError(
                f"the prompt has {len(context)} tokens with BOS; the model reads at most {limit}"
            )
        return context

    @torch.no_grad()
    def generate(
        self,
        prompt: str,
        options: GenerateOptions | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        """Continue ``prompt``. With ``on_text`` (greedy and sampling), each new piece of text
        is passed to it as soon as it is known; the pieces add up to ``Generation.text``."""
        if not isinstance(prompt, str):
            raise TypeError(
                f"generate continues one prompt (a string), not {type(prompt).__name__}: "
                "call it once for each"
            )
        options = options or GenerateOptions()
        options.validate()
        context = self.checked_prompt_ids(prompt)
        limit = self.model.config.max_positions
        new = min(options.max_new_tokens, limit - len(context))
        beams = options.beam_size if options.strategy == "beam" else 1
        cache = self.model.init_cache(beams, len(context) + new, beam_size=beams)
        prefix = torch.tensor([context[:-1]], device=self.device).expand(beams, -1)
        step = never_pad_or_bos(self.model.log_probs_step, self.model.config.bos_output)
        if on_text is not None and options.strategy != "beam":
            step = _Streamer(step, self.tokenizer, context[1:], on_text)
        with inference_attention(self.device):
            self.model.prefill(prefix, cache)
            found = self._search(step, cache, context[-1], new, options)
        text = _continuation(self.tokenizer, context[1:], found.tokens)
        if isinstance(step, _Streamer):
            step.finish(text)
        finished = len(found.tokens) < new
        return Generation(text, list(found.tokens), float(found.log_prob), finished)

    def _search(
        self,
        step: Callable[[Tensor, DecoderCache], Tensor],
        cache: DecoderCache,
        last: int,
        new: int,
        options: GenerateOptions,
    ) -> Hypothesis:
        common = {"max_len": new, "bos_id": last, "eos_id": EOS_ID, "device": self.device}
        if options.strategy == "greedy":
            return greedy_search(step, cache, 1, **common)[0]  # type: ignore[arg-type]
        if options.strategy == "beam":
            hyps = beam_search(
                step,
                cache,
                1,
                beam_size=options.beam_size,
                alpha=options.alpha,
                **common,  # type: ignore[arg-type]
            )
            return hyps[0][0]
        generator = None
        if options.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(options.seed)
        return sample(
            step,
            cache,
            1,
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            generator=generator,
            **common,  # type: ignore[arg-type]
        )[0]


def _continuation(tokenizer: TextTokenizer, prompt: Sequence[int], new: Sequence[int]) -> str:
    """The text that ``new`` adds after ``prompt``: decoded together (so that the first new
    word is spaced as it follows the prompt), minus the prompt's own text."""
    before = tokenizer.decode(list(prompt))
    after = tokenizer.decode([*prompt, *new])
    if after.startswith(before):
        return after[len(before) :]
    return (" " if before else "") + tokenizer.decode(list(new))


class _Streamer:
    """A ``step_fn`` wrapper that sees each chosen token (the search feeds it back as the next
    step's input) and passes the text it adds to ``on_text``."""

    def __init__(
        self,
        step: Callable[[Tensor, DecoderCache], Tensor],
        tokenizer: TextTokenizer,
        prompt: Sequence[int],
        on_text: Callable[[str], None],
    ) -> None:
        self.step = step
        self.tokenizer = tokenizer
        self.prompt = list(prompt)
        self.on_text = on_text
        self.tokens: list[int] = []
        self.shown = ""
        self.started = False

    def __call__(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        if self.started:  # the first input is the prompt's last token
            self.tokens.append(int(tokens[0]))
            self._show(_continuation(self.tokenizer, self.prompt, self.tokens))
        self.started = True
        return self.step(tokens, cache)

    def _show(self, text: str) -> None:
        # A piece that changes what was shown (a partial character of byte fallback) waits.
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.on_text(text[len(self.shown) :])
            self.shown = text

    def finish(self, text: str) -> None:
        """Show the rest of the final text (its last token is never fed back)."""
        self._show(text)
