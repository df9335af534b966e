"""Decoder steps that write their logits and log-probabilities into one buffer per decode.

A step's (rows, V) logits and their log-softmax are the largest tensors of a decode. A
:class:`BufferedDecoding` model keeps one float32 buffer with each cache
(:class:`BufferedCache`, a :class:`~aiayn.accel.linear.LogitsBuffer` sized for the batch's
full row count, as the compiled step's caches are), projects into it with ``mm(out=)``
(:func:`~aiayn.accel.linear.logits_into`) and takes the log-softmax in place, so that no step
allocates a vocabulary-sized matrix (figures: docs/performance.md). The result is valid until
the next step on that cache, which is how search uses it.

With a compiled step (:mod:`aiayn.accel.compiled`, :func:`~aiayn.accel.use_compiled_step`),
decodes of up to :data:`~aiayn.accel.compiled.MAX_ROWS` rows, greedy decodes of more and beam
searches of :data:`~aiayn.accel.compiled.BEAM` beams over more go through it instead.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from aiayn.accel import panels
from aiayn.accel.compiled import BEAM, MAX_ROWS, CompiledBeamCache, CompiledCache, CompiledStep
from aiayn.accel.linear import LogitsBuffer, logits_into
from aiayn.accel.memory import release_file_pages
from aiayn.model.cache import DecoderCache
from aiayn.model.transformer import Transformer


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
    (:func:`aiayn.accel.use_compiled_step` sets them)."""

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
        for step in (few, many, beams):
            if (
                step is not None
                and step is not chosen
                and not step.idle
                and step.constants is not None
            ):
                # The path that serves now reads other weights (the packs, the other
                # library's): this library's pages go back until it serves again (read from
                # its file then).
                step.idle = True
                release_file_pages(step.path, cached=True)
        if chosen is not None:
            chosen.idle = False
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
