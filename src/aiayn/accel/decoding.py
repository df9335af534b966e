"""Decoder steps that write their logits and log-probabilities into one buffer per decode.

A step's (rows, V) logits and their log-softmax are the largest tensors of a decode. A
:class:`BufferedDecoding` model keeps one float32 buffer with each cache
(:class:`BufferedCache`, a :class:`~aiayn.accel.linear.LogitsBuffer` sized for the batch's
full row count, as the compiled step's caches are), projects into it with ``mm(out=)``
(:func:`~aiayn.accel.linear.logits_into`) and takes the log-softmax in place, so that no step
allocates a vocabulary-sized matrix (figures: docs/performance.md). The result is valid until
the next step on that cache, which is how search uses it.

With a compiled step (:mod:`aiayn.accel.compiled`, :func:`use_compiled_step`),
decodes of up to :data:`~aiayn.accel.compiled.MAX_ROWS` rows, greedy decodes of more and beam
searches of :data:`~aiayn.accel.compiled.BEAM` beams over more go through it instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from aiayn.accel import panels
from aiayn.accel.compiled import (
    BEAM,
    MAX_ROWS,
    CompiledBeamCache,
    CompiledCache,
    CompiledStep,
    compiled_steps,
    unsupported,
)
from aiayn.accel.linear import LogitsBuffer, logits_into
from aiayn.model.cache import DecoderCache
from aiayn.model.transformer import Transformer

if TYPE_CHECKING:
    from aiayn.accel import Acceleration


@dataclass
class BufferedCache(DecoderCache, LogitsBuffer):
    """A :class:`~aiayn.model.cache.DecoderCache` with the decode's (rows, V) buffer."""


class BufferedDecoding(Transformer):
    """:class:`~aiayn.model.transformer.Transformer` whose ``log_probs_step`` writes into its
    cache's buffer: float32 logits with ``mm(out=)``, a bfloat16 or float16 model's in its
    dtype, then the log-softmax into the buffer. With autograd or autocast on, on an int8
    model, or with a plain cache, the plain step.

    ``compiled_step``, ``compiled_batch_step`` and ``compiled_beam_step``: the model's compiled
    decoder step tuned for few rows, for many and for beam searches over many, which serve,
    without autograd and while the model's parameters are those they were compiled from,
    decodes of up to :data:`~aiayn.accel.compiled.MAX_ROWS` rows, greedy decodes of more and
    beam searches of :data:`~aiayn.accel.compiled.BEAM` beams over more
    (:func:`use_compiled_step` sets them)."""

    compiled_step: CompiledStep | None = None
    compiled_batch_step: CompiledStep | None = None
    compiled_beam_step: CompiledStep | None = None

    def init_cache(  # type: ignore[override]
        self, memory: Tensor, src_pad: Tensor | None, max_len: int, beam_size: int = 1
    ) -> DecoderCache | CompiledCache:
        few, many, beams = self.compiled_step, self.compiled_batch_step, self.compiled_beam_step
        rows = memory.size(0) * beam_size
        if rows <= MAX_ROWS:
            chosen = few
        elif beam_size == 1:
            chosen = many
        else:
            chosen = beams if beam_size == BEAM else None
        if chosen is not None and (torch.is_grad_enabled() or not chosen.serves(self, memory)):
            chosen = None
        if chosen is not None:
            return chosen.init_cache(self, memory, src_pad, max_len, beam_size)
        cache = super().init_cache(memory, src_pad, max_len, beam_size)
        return BufferedCache(**{f.name: getattr(cache, f.name) for f in fields(cache)})

    def step_hidden(self, tokens: Tensor, cache: DecoderCache | CompiledCache) -> Tensor:
        if isinstance(cache, (CompiledCache, CompiledBeamCache)):
            raise TypeError(
                "a compiled decoder step's cache gives log-probabilities only "
                "(log_probs_step); decode with compiled_step=None on the model for the rest"
            )
        return super().step_hidden(tokens, cache)

    def log_probs_step(self, tokens: Tensor, cache: DecoderCache | CompiledCache) -> Tensor:
        if isinstance(cache, (CompiledCache, CompiledBeamCache)):
            assert cache.step is not None
            return cache.step.log_probs_step(tokens, cache)
        if not isinstance(cache, BufferedCache) or torch.is_grad_enabled():
            return super().log_probs_step(tokens, cache)
        hidden = self.step_hidden(tokens, cache)  # (rows, d_model)
        logits = logits_into(self.out_proj, hidden, cache)
        if logits is None:  # (int8, a final-logits bias, autocast): the model's own projection
            return torch.log_softmax(self.project(hidden), dim=-1, dtype=torch.float32)
        if logits.dtype == torch.float32:  # the buffer, or a new matrix of a packed product
            return panels.log_softmax_(logits)
        buffer = cache.rows_buffer(logits.size(0), logits.size(1), logits.device)
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32, out=buffer)


def use_compiled_step(
    model: nn.Module,
    acceleration: Acceleration,
    build: bool,
    warn: Callable[[str], None],
) -> CompiledStep | None:
    """Give the accelerated ``model`` (a :class:`BufferedDecoding`) its compiled steps
    (:func:`~aiayn.accel.compiled.compiled_steps`), those compiled on this machine before or
    (``build``) compiled now, and return the first of them it has, or None. What goes wrong
    is told to ``warn`` (a failed load or compile always; a model the step does not serve with
    ``build``), and the decodes the step would have served stay eager.
    :meth:`Acceleration.undo` takes the steps away."""
    if not acceleration.wants("compiled decoder step"):  # left out (accelerate's disable)
        return None
    reason = unsupported(model)
    if reason is None and not isinstance(model, BufferedDecoding):
        reason = "the compiled step serves the accelerated model (accelerated=False)"
    if reason is not None:
        if build:
            warn(f"compiled step: {reason}; decoding without it")
        return None
    assert isinstance(model, BufferedDecoding)
    steps = compiled_steps(model, build, warn)
    for name, step in steps.items():
        acceleration._set(model, name, step)
    if steps:
        acceleration.use("compiled decoder step")
    return next(iter(steps.values()), None)
