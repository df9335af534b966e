"""The decoder step compiled ahead of time: one shared library per model and CPU.

An eager decoder step runs some 150 PyTorch operations, each a Python call and a kernel
launch, and its matrix products go through a general library (MKL, oneDNN) whose per-call
overhead is larger than the product itself at one or a few rows. For one sentence at a time
that overhead is most of the step (figures: docs/performance.md). Here the step of a
:class:`~aiayn.model.transformer.Transformer` (the target embedding, every decoder layer and
the final norm) is exported (``torch.export``) and compiled by AOTInductor into a shared
library, with the decoder layers' weights frozen in and each matrix product either generated
for its weight (Inductor's C++ GEMM template) or ATen's on the weight packed for oneDNN,
whichever measured faster at compile time (or, where aiayn's own AVX2 product is loaded,
:mod:`aiayn.accel.panels`, that product, called through AOTInductor's custom-operator call:
:func:`extern_calls`), once tuned for a few rows (one sentence, its beams),
once for many (a greedy batch) and once for beam searches over many (:class:`BeamDecoderStep`).
The embedding table is an input and the pre-softmax projection and log-softmax run outside,
through the model's own modules, so that the library holds no copy of the model's largest
matrix. The step is the model's own: :class:`DecoderStep` calls the decoder layers'
``step`` with a cache of static shape (:class:`StaticLayerCache`), so that the graph has no
Python in it and one graph serves every row count, source length and output length (the
cache's positions grow as the output does: :attr:`CompiledCache.capacity`).

Compiling is slow (the longer, the larger the model), so a library is kept in the user's
cache directory (:func:`~aiayn.accel.store.compiled_dir`), named after a digest of the weights, the
configuration, the code that is compiled, the rows it is tuned for, aiayn's and PyTorch's
versions, the thread count and the CPU (:func:`step_key`), so that it is built once and
found again by any later process (:func:`load_compiled_step`). It is native code: it is only
ever loaded from that cache, and only from a file and directory that belong to the user and
that nobody else may write (:func:`~aiayn.accel.store.trusted`). It is a bare shared
library rather than a ``.pt2`` package, whose loader holds about twice the weights' size
more. Its weights are read from the file in place (:mod:`aiayn.accel.library_constants`,
through an index of them written beside it), not from the copy AOTInductor's loader makes,
which is freed. A library that fails to load or to compile leaves decoding eager, with a warning
(:func:`aiayn.accel.use_compiled_step`).

:class:`CompiledCache` is the incremental decoder's state for the first, with the
interface search uses (``reorder``, ``keep``): one row of keys and values per beam, gathered
when beams are reordered, which is cheap at the row counts they serve beams
(:data:`MAX_ROWS`). :class:`CompiledBeamCache` is the other two's: keys and values
position-major, of which each step reads the positions decoded so far and no more, and for
beams the eager cache's lineage, so that a reorder moves no keys. Beam searches of other
sizes over more rows decode eagerly.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

import aiayn
from aiayn.accel import panels
from aiayn.accel.cpu import cpu_flags, unverified
from aiayn.accel.library_constants import index_path, map_constants, write_index
from aiayn.accel.linear import LogitsBuffer, logits_into
from aiayn.accel.memory import release_file_pages
from aiayn.accel.store import compiled_dir, require_trusted, trusted
from aiayn.config import ModelConfig
from aiayn.model.attention import MultiHeadAttention, attention_mask
from aiayn.model.cache import DecoderCache, LayerCache, keep_rows, row_moves
from aiayn.model.layers import DecoderLayer
from aiayn.model.transformer import Transformer, check_cache_size

if TYPE_CHECKING:
    from aiayn.accel import Acceleration

# A model has three libraries, the same step tuned for three row counts (Inductor's GEMM
# kernels are generated for the rows they are tuned with): FEW_ROWS serves decodes of up to
# MAX_ROWS rows (sentences × beam), MANY_ROWS greedy decodes of more. Not beam searches over
# more: there a reorder would gather every row's keys, where the eager cache moves a lineage
# index only, and the library measured slower there (docs/performance.md). The
# library for many rows keeps its keys and values position-major, as the beams' does (below):
# each step reads the positions decoded so far and no more, which measured faster than a
# cache that doubles (docs/performance.md).
MAX_ROWS = 16
FEW_ROWS = 4
MANY_ROWS = 64
# A third library serves beam searches of BEAM beams over more than MAX_ROWS rows, tuned for
# BEAM_ROWS rows: its cache keeps one set of keys and values per sentence with its beams side
# by side and a lineage, as the eager one does (model/cache.py), so that a reorder moves no
# keys and the beams read their sentence's memory together; faster than the eager step at
# these rows (docs/performance.md). Other beam sizes over MAX_ROWS rows decode eagerly.
BEAM = 4
BEAM_ROWS = 256
# The libraries of a model, by the rows each is tuned for, and the attributes of the
# accelerated model (BufferedDecoding) that hold them.
LIBRARIES = (FEW_ROWS, MANY_ROWS, BEAM_ROWS)
_ATTRIBUTES = ("compiled_step", "compiled_batch_step", "compiled_beam_step")


def beam_of(rows: int) -> int:
    """The beams a sentence of the library tuned for ``rows`` rows: :data:`BEAM` for
    :data:`BEAM_ROWS`, else 1 (a set of keys and values a row)."""
    return BEAM if rows == BEAM_ROWS else 1


def position_major(rows: int) -> bool:
    """Whether the library tuned for ``rows`` rows reads its keys and values position-major
    (:class:`BeamDecoderStep`, :class:`CompiledBeamCache`): those for many rows; the one for
    few reads them row-major (:class:`DecoderStep`, :class:`CompiledCache`)."""
    return rows != FEW_ROWS


# The source length and cache length the step is exported and tuned with, beside its rows
# (at most the model's positions).
_EXAMPLE_LENGTHS = (24, 32)
# A cache starts with this many positions and doubles when it is full (up to its max_len):
# the library attends over every position it is given, so a cache sized for the longest
# output (max_len: the source's length + 50 by default) would cost each step attention over
# that many positions, the unwritten ones masked.
FIRST_SLOTS = 16
# Inductor's setting of the compiler's target (-march).
MARCH_VAR = "TORCHINDUCTOR_CPP_MARCH"
_INDUCTOR = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "aot_inductor.force_mmap_weights": True,
    "aot_inductor.package": False,
}
# What the library is compiled from: a change to any of these compiles it again.
_SOURCES = (
    *("accel/compiled.py", "model/attention.py", "model/layers.py", "model/embedding.py"),
    *("model/feedforward.py", "model/transformer.py"),
)


def unsupported(model: nn.Module) -> str | None:
    """Why ``model``'s decoder step cannot be compiled here, or None when it can."""
    if not isinstance(model, Transformer):
        return _NOT_THE_TRANSFORMER
    reason = config_unsupported(model.config)
    if reason is not None:
        return reason
    params = list(model.parameters())
    if any(p.device.type != "cpu" for p in params):
        return "the compiled step runs on the CPU"
    if any(p.dtype is not torch.float32 for p in params if p.is_floating_point()):
        return "the compiled step is float32"
    if any(type(m).__module__.startswith("torch.ao") for m in model.modules()):
        return "the compiled step is not for a quantized model"
    return _runtime_missing()


_NOT_THE_TRANSFORMER = "only the Transformer's decoder step is compiled"


def config_unsupported(config: ModelConfig) -> str | None:
    """Why no model of ``config`` has a compiled decoder step, or None (before a model is
    built: :func:`unsupported` checks the model itself)."""
    if config.task != "translation" or config.arch != "transformer":
        return _NOT_THE_TRANSFORMER
    if config.decoder_attention != "full" or config.cross_attention != "full":
        return "the compiled step has full attention only"
    return None


def _runtime_missing() -> str | None:
    """Why this PyTorch cannot run a compiled step, or None."""
    aoti = getattr(torch._C, "_aoti", None)
    if aoti is None or not hasattr(aoti, "AOTIModelContainerRunnerCpu"):
        return "this PyTorch has no AOTInductor"
    # The step is loaded through AOTInductor's runner (torch._C._aoti) and reads its weights
    # through the library's C interface (library_constants): internals, used with the
    # releases they were verified with only. Its worth: one sentence 1.3-1.6x faster
    # (benchmarks/results/levers-<host>.md).
    return unverified("the compiled step uses PyTorch internals")


def cannot_build() -> str | None:
    """Why a decoder step cannot be compiled on this machine (whatever the model), or None."""
    if panels.compiler() is None:
        return "no C++ compiler here (apt-get install g++)"
    return _runtime_missing()


class StaticLayerCache:
    """One decoder layer's keys and values for :class:`DecoderStep`, in the shape of
    :class:`~aiayn.model.cache.LayerCache` with one beam slot per row: ``write`` puts the
    step's keys at ``position`` (a tensor, so that one graph serves every step; ``slot`` is
    not used) and ``keys_values`` gives all ``max_len`` slots (the step's mask hides those not
    yet written)."""

    def __init__(
        self, self_k: Tensor, self_v: Tensor, cross_k: Tensor, cross_v: Tensor, position: Tensor
    ) -> None:
        self.self_k, self.self_v = self_k, self_v  # (rows, H, max_len, Dh)
        self.cross_k, self.cross_v = cross_k, cross_v  # (rows, H, S, Dh)
        self.position = position  # (1,) int64

    def write(self, slot: int, k: Tensor, v: Tensor) -> None:
        self.self_k.index_copy_(2, self.position, k)  # k, v: (rows, H, 1, Dh)
        self.self_v.index_copy_(2, self.position, v)

    def keys_values(self, length: int) -> tuple[Tensor, Tensor]:
        return self.self_k, self.self_v


class BeamLayerCache:
    """One decoder layer's keys and values for :class:`BeamDecoderStep`, position-major:
    (positions, sentences, H, beam, Dh), a sentence's beams side by side at each position, so
    that the positions decoded so far are a contiguous prefix, which is what the step is given.
    ``write`` puts the step's keys at ``position`` (a tensor, the last one given);
    ``keys_values`` gives (sentences, H, positions, beam, Dh): flattened, key ``j * beam + b``
    beam slot b's at position j, as :class:`~aiayn.model.cache.LayerCache` gives them (the
    step's mask keeps each beam to its lineage). :class:`OneQueryAttention` flattens them for
    Inductor's loops (a copy of every key at every step); the panels' kernel reads them in
    place."""

    def __init__(
        self, self_k: Tensor, self_v: Tensor, cross_k: Tensor, cross_v: Tensor, position: Tensor
    ) -> None:
        self.self_k, self.self_v = self_k, self_v
        self.cross_k, self.cross_v = cross_k, cross_v  # (sentences, H, S, Dh)
        self.position = position

    def write(self, slot: int, k: Tensor, v: Tensor) -> None:
        self.self_k.index_copy_(0, self.position, k.unsqueeze(0))  # k, v: (sentences, H, beam, Dh)
        self.self_v.index_copy_(0, self.position, v.unsqueeze(0))

    def keys_values(self, length: int) -> tuple[Tensor, Tensor]:
        return self.self_k.permute(1, 2, 0, 3, 4), self.self_v.permute(1, 2, 0, 3, 4)


class OneQueryAttention(MultiHeadAttention):
    """The attention the step is compiled with: each row attends from one query position (a
    sentence's beams from one each). In the libraries for many rows, where the panels' file is
    loaded (:attr:`through_kernel`), through its kernel (:func:`aiayn.accel.panels.attend`,
    called out of the library): each query over only the keys its mask lets it attend, a beam's
    its own lineage's, read in place (figures: docs/performance.md). Otherwise
    ``softmax(q·kᵀ/√d_k)·v`` written as products and sums over the key positions, which Inductor
    fuses into loops of the library. ``F.scaled_dot_product_attention`` there is a call out of
    the library to ATen's kernel per attention, which at a few rows costs more than the
    attention itself (docs/performance.md). Both add in another order than SDPA's, within float32
    rounding of it. A row that may attend to no position gets NaN here (SDPA gives zeros); the
    step has none: each row attends to its own first position and to its source's EOS. Keys and
    values may come as (B, H, positions, beam, Dh), key ``j * beam + b`` at (j, b)
    (:class:`BeamLayerCache`)."""

    # Whether it attends through the panels' kernel (set where the step is compiled).
    through_kernel = False

    def scaled_dot_product(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool
    ) -> Tensor:
        if causal or self.training:
            return super().scaled_dot_product(q, k, v, mask, causal)
        scale = 1.0 / math.sqrt(q.size(-1))
        if self.through_kernel and q.dtype is torch.float32:
            return panels.attend(q, k, v, mask, scale)
        if k.dim() == 5:
            k, v = k.flatten(2, 3), v.flatten(2, 3)
        if q.size(-2) == 1:
            # q (B, H, 1, Dk), k (B, H, S, Dk), v (B, H, S, Dv)
            scores = (q * k).sum(-1) * scale  # (B, H, S)
            if mask is not None:  # (B or 1, 1, 1, S): boolean (True = attend) or additive
                mask = mask.squeeze(-2)
        else:  # a sentence's beams: q (B, H, beam, Dk)
            scores = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) * scale  # (B, H, beam, S)
        if mask is not None:  # (B or 1, 1, beam or 1, S) for the beams
            scores = (
                scores.masked_fill(~mask, float("-inf"))
                if mask.dtype == torch.bool
                else scores + mask
            )
        weights = scores.softmax(dim=-1)
        if q.size(-2) == 1:
            return (weights.unsqueeze(-1) * v).sum(-2, keepdim=True)  # (B, H, 1, Dv)
        return (weights.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)  # (B, H, beam, Dv)


class DecoderStep(nn.Module):
    """A Transformer's decoder step as a function of tensors only (what is exported): the
    decoder's output (rows, d_model) for ``tokens`` (rows,) at ``position`` (1,), embedded
    from ``token_table`` (the target embedding's weight, an input rather than a frozen
    constant, so the library holds no copy of it); writes their keys and values into
    ``self_k``/``self_v`` (a list per layer of (rows, H, max_len, Dh)). ``cross_mask``
    (rows, 1, 1, S) is True where the memory is attended to. The layers and norms are the
    model's own modules. The pre-softmax projection is not in it: :class:`CompiledStep` runs
    the model's own (its packed weight, where it has one), so that the library holds no copy
    of that matrix either, the largest of the model (figures: docs/performance.md)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.scale = model.tgt_embed.scale
        self.positions = model.tgt_embed.positions
        self.decoder = model.decoder

    def forward(
        self,
        tokens: Tensor,
        position: Tensor,
        token_table: Tensor,
        self_k: list[Tensor],
        self_v: list[Tensor],
        cross_k: list[Tensor],
        cross_v: list[Tensor],
        cross_mask: Tensor,
    ) -> Tensor:
        x = self.embed(tokens, position, token_table)
        slots = self_k[0].size(2)
        self_mask = (torch.arange(slots, device=position.device) <= position).view(1, 1, 1, -1)
        caches = zip(self_k, self_v, cross_k, cross_v, strict=True)
        for layer, (sk, sv, ck, cv) in zip(self.decoder.layers, caches, strict=True):
            cache: Any = StaticLayerCache(sk, sv, ck, cv, position)  # a LayerCache to .step
            x = layer.step(x, cache, 0, 0, self_mask, cross_mask)
        return self.output(x)

    def embed(self, tokens: Tensor, position: Tensor, token_table: Tensor) -> Tensor:
        """Embeddings.forward at a position given as a tensor (its dropout is off in eval)."""
        positions = self.positions
        table = (
            positions.learned if positions.learned is not None else positions.get_buffer("table")
        )
        return token_table[tokens[:, None]] * self.scale + table.index_select(0, position)

    def output(self, x: Tensor) -> Tensor:
        if self.decoder.final_norm is not None:
            x = self.decoder.final_norm(x)
        return x[:, 0]


class BeamDecoderStep(DecoderStep):
    """:class:`DecoderStep` over keys and values position-major (:class:`BeamLayerCache`),
    for ``beam`` beams a sentence (1: a greedy decode): ``tokens`` (sentences × beam,) at
    ``position``, ``self_k`` and ``self_v`` per layer (position + 1, sentences, H, beam, Dh),
    the positions decoded so far and this one, ``cross_k`` and ``cross_v`` (sentences, H, S,
    Dh), ``cross_mask`` (sentences, 1, 1, S) True where attended, and with more than one beam
    ``self_mask`` (sentences, 1, beam, (position + 1) × beam), 0 where a beam attends (the
    slots of its lineage) and -inf elsewhere, the eager cache's
    (:meth:`~aiayn.model.cache.DecoderCache.self_attention_mask`); with one, a row attends to
    every position it is given. The beams of a sentence attend together, as in the eager step
    (``DecoderLayer.step``)."""

    def __init__(self, model: Transformer, beam: int) -> None:
        super().__init__(model)
        self.beam = beam

    def forward(
        self,
        tokens: Tensor,
        position: Tensor,
        token_table: Tensor,
        self_k: list[Tensor],
        self_v: list[Tensor],
        cross_k: list[Tensor],
        cross_v: list[Tensor],
        cross_mask: Tensor,
        self_mask: Tensor | None = None,
    ) -> Tensor:
        x = self.embed(tokens, position, token_table)
        caches = zip(self_k, self_v, cross_k, cross_v, strict=True)
        for layer, (sk, sv, ck, cv) in zip(self.decoder.layers, caches, strict=True):
            cache: Any = BeamLayerCache(sk, sv, ck, cv, position)
            x = layer.step(x, cache, 0, 0, self_mask, cross_mask, self.beam)
        return self.output(x)


@dataclass(eq=False)
class CompiledCache(LogitsBuffer):
    """The incremental state of a decode through a :class:`CompiledStep`: rows =
    sentences × ``beam_size``, each with its own keys and values, with room for
    :attr:`capacity` positions, which :meth:`grow` doubles up to ``max_len``."""

    step: CompiledStep
    self_k: list[Tensor]  # per layer (rows, H, capacity, Dh)
    self_v: list[Tensor]
    cross_k: list[Tensor]  # per layer (rows, H, S, Dh)
    cross_v: list[Tensor]
    cross_mask: Tensor  # (rows, 1, 1, S) bool, True = attend
    length: int
    max_len: int
    beam_size: int = 1
    # (2, layers, rows, H, capacity, Dh): the storage of every self_k and self_v, where the
    # key and value widths agree, so that a beam's reorder is one gather, not one per tensor.
    self_kv: Tensor | None = None

    @property
    def batch_size(self) -> int:
        """Decoder rows (sentences × beam_size)."""
        return self.self_k[0].size(0)

    @property
    def capacity(self) -> int:
        """The positions the keys and values have room for now."""
        return self.self_k[0].size(2)

    def grow(self) -> None:
        """Room for twice the positions (at most ``max_len``), the decoded ones copied; the
        others are zeros, as the step needs of the positions it masks (it multiplies them
        by a weight of 0)."""
        slots = min(2 * self.capacity, self.max_len)

        def grown(old: Tensor) -> Tensor:
            new = old.new_zeros(*old.shape[:-2], slots, old.size(-1))
            new[..., : self.length, :] = old[..., : self.length, :]
            return new

        if self.self_kv is not None:
            self.self_kv = grown(self.self_kv)
            self.self_k, self.self_v = list(self.self_kv[0]), list(self.self_kv[1])
        else:
            self.self_k = [grown(t) for t in self.self_k]
            self.self_v = [grown(t) for t in self.self_v]

    def step_inputs(self, tokens: Tensor, token_table: Tensor) -> list[Tensor]:
        """:class:`DecoderStep`'s arguments for the next step, flattened in their order (room
        made for its position first)."""
        if self.length == self.capacity:
            self.grow()
        position = torch.tensor([self.length])
        caches = [*self.self_k, *self.self_v, *self.cross_k, *self.cross_v]
        return [tokens.contiguous(), position, token_table, *caches, self.cross_mask]

    def reorder(self, rows: Tensor) -> None:
        """Row i becomes old row ``rows[i]`` (beams within their sentence: the memory stays).
        Only the positions decoded so far are moved, in place; nothing where every row stays,
        one row's where only one changes."""
        if rows.numel() != self.batch_size:
            raise ValueError(
                f"reorder expects {self.batch_size} row indices, got {rows.numel()}; "
                "use keep() to change the batch size"
            )
        order = rows.tolist()  # (on the CPU, where the step runs: no transfer)
        moved = [i for i, row in enumerate(order) if row != i]
        if not moved:
            return
        if self.self_kv is not None:
            buffers, dim = [self.self_kv], 2
        else:
            buffers, dim = [*self.self_k, *self.self_v], 0
        for buffer in buffers:
            filled = buffer.narrow(-2, 0, self.length)
            if len(moved) == 1:  # its source stays: one copy, a quarter of a beam's bytes
                filled.select(dim, moved[0]).copy_(filled.select(dim, order[moved[0]]))
            else:
                filled.copy_(filled.index_select(dim, rows))

    def keep(self, rows: Tensor) -> None:
        """Keep only ``rows`` (in that order), in place as the eager cache does
        (:func:`~aiayn.model.cache.keep_rows`): only the rows that change place are copied (of
        the keys and values, the positions decoded so far), and each tensor becomes its first
        ``len(rows)`` rows, still contiguous, as the library needs."""
        n = rows.numel()
        if n > self.batch_size:
            raise ValueError(f"keep got {n} rows for a batch of {self.batch_size}")
        moves = row_moves(rows)
        if self.self_kv is not None:
            if moves is not None:  # (rows are its third dimension)
                dst, src = moves
                filled = self.self_kv[..., : self.length, :]
                filled[:, :, dst] = filled[:, :, src]
            self.self_kv = self.self_kv.narrow(2, 0, n)
            self.self_k, self.self_v = list(self.self_kv[0]), list(self.self_kv[1])
        else:
            self.self_k = [keep_rows(t, moves, n, self.length) for t in self.self_k]
            self.self_v = [keep_rows(t, moves, n, self.length) for t in self.self_v]
        self.cross_k = [keep_rows(t, moves, n) for t in self.cross_k]
        self.cross_v = [keep_rows(t, moves, n) for t in self.cross_v]
        self.cross_mask = keep_rows(self.cross_mask, moves, n)


@dataclass(eq=False)
class CompiledBeamCache(DecoderCache, LogitsBuffer):
    """The incremental state of a decode through a step compiled position-major
    (:class:`BeamDecoderStep`): the eager cache (:class:`~aiayn.model.cache.DecoderCache`:
    keys and values per sentence, the beams side by side, a lineage that reorders move instead
    of keys where there are beams) with its layers' self-attention keys and values
    position-major, (max_len, sentences, H, beam, Dh), of which the step is given the
    positions decoded so far, and a cross-attention mask always (all True without padding).
    The lineage is given: the layers' first dimension is not the sentences'."""

    step: CompiledStep | None = None

    @property
    def batch_size(self) -> int:
        """Decoder rows (sentences × beam_size)."""
        return self.layers[0].self_k.size(1) * self.beam_size

    def step_inputs(self, tokens: Tensor, token_table: Tensor) -> list[Tensor]:
        """:class:`BeamDecoderStep`'s arguments for the next step, flattened in their order."""
        assert self.cross_mask is not None
        filled = self.length + 1
        layers = self.layers
        inputs = [tokens.contiguous(), torch.tensor([self.length]), token_table]
        inputs += [layer.self_k[:filled] for layer in layers]
        inputs += [layer.self_v[:filled] for layer in layers]
        inputs += [layer.cross_k for layer in layers if layer.cross_k is not None]
        inputs += [layer.cross_v for layer in layers if layer.cross_v is not None]
        mask = self.self_attention_mask()  # (sentences, 1, beam, (length + 1) × beam)
        return [*inputs, self.cross_mask] if mask is None else [*inputs, self.cross_mask, mask]

    def _select(self, sentences: Tensor) -> None:
        """Keep only ``sentences`` (:meth:`keep` checks the rows and moves the lineage). The
        cross-attention tensors move the rows that change place, as the eager cache's do; the
        positions decoded so far of the self-attention keys and values are gathered once and
        written back as a contiguous prefix of the same storage: a prefix of positions
        holding fewer sentences is no prefix of the old layout."""
        moves = row_moves(sentences)
        count = sentences.numel()
        for layer in self.layers:
            layer.self_k = _keep_sentences(layer.self_k, sentences, moves, count, self.length)
            layer.self_v = _keep_sentences(layer.self_v, sentences, moves, count, self.length)
            if layer.cross_k is not None and layer.cross_v is not None:
                layer.cross_k = keep_rows(layer.cross_k, moves, count)
                layer.cross_v = keep_rows(layer.cross_v, moves, count)
        if self.cross_mask is not None:
            self.cross_mask = self.cross_mask.index_select(0, sentences)


def _keep_sentences(
    buffer: Tensor, sentences: Tensor, moves: tuple[Tensor, Tensor] | None, n: int, length: int
) -> Tensor:
    """``buffer`` (positions, sentences, ...) with only ``sentences`` (their ``length``
    positions decoded so far), laid out contiguously for ``n`` sentences in its storage."""
    if moves is None and n == buffer.size(1):
        return buffer
    kept = buffer[:length].index_select(1, sentences)  # read whole before any write
    new = buffer.view(-1)[: buffer.size(0) * n * buffer[0, 0].numel()].view(
        buffer.size(0), n, *buffer.shape[2:]
    )
    new[:length] = kept
    return new


class CompiledStep:
    """A loaded compiled decoder step (:func:`load_compiled_step`, :func:`compile_step`) for
    one model: :meth:`init_cache` and :meth:`log_probs_step` stand in for the model's while
    the model's parameters are the ones it was made from (:meth:`serves`)."""

    def __init__(
        self, path: Path, model: Transformer, rows: int = FEW_ROWS, in_place: bool = True
    ) -> None:
        self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
        self.path = path
        # The beams of a sentence it decodes (one: a set of keys and values a row), and
        # whether it is a BeamDecoderStep (position-major) or a DecoderStep.
        self.beam = beam_of(rows)
        self.position_major = position_major(rows)
        # Whether another path decoded since this step last served, its file's pages handed
        # back then (BufferedDecoding).
        self.idle = False
        # The decoder layers' weights read from the library's file, not the loader's copy
        # (``in_place``, where the library was indexed when it was built and the index is the
        # user's): the lever "compiled weights read in place".
        index = index_path(path)
        trusted_index = in_place and index.is_file() and trusted(index)
        self.constants = map_constants(self.runner, path, index) if trusted_index else None
        self._parameters = _identity(model)
        # What the step takes from the model rather than holding a copy (DecoderStep).
        self.token_table = model.tgt_embed.token.weight.detach()  # its storage, once
        self.out_proj = model.out_proj
        if self.constants is not None:
            # The file's pages leave the process: the loader's mapping and the views' share
            # them, and MADV_PAGEOUT skips a page that two mappings hold.
            release_file_pages(path, cached=True)

    def serves(self, model: nn.Module, memory: Tensor) -> bool:
        """Whether this step is ``model``'s as it is now (the same parameter tensors,
        unchanged since) for a float32 ``memory`` on the CPU."""
        return (
            memory.device.type == "cpu"
            and memory.dtype is torch.float32
            and _identity(model) == self._parameters
        )

    def init_cache(
        self, model: Transformer, memory: Tensor, src_pad: Tensor | None, max_len: int, beam: int
    ) -> CompiledCache | CompiledBeamCache:
        if model.out_proj is not self.out_proj:
            raise ValueError("a compiled step decodes for the model it was loaded for")
        check_cache_size(model.config, max_len, beam)
        if self.position_major:
            if beam != self.beam:
                raise ValueError(f"this compiled step decodes with beam {self.beam}, not {beam}")
            return self._beam_cache(model, memory, src_pad, max_len)
        rows = memory.size(0) * beam
        slots = min(max_len, FIRST_SLOTS)
        layers = model.decoder.layers
        cross_k, cross_v = _cross_keys_values(layers, memory, beam)
        self_k, self_v = [], []
        self_kv = None
        if (width := _one_width(layer.self_attn for layer in layers)) is not None:
            self_kv = memory.new_zeros(2, len(layers), rows, width[0], slots, width[1])
            self_k, self_v = list(self_kv[0]), list(self_kv[1])
        else:
            for layer in layers:
                attn = layer.self_attn
                self_k.append(memory.new_zeros(rows, attn.n_heads, slots, attn.d_k))
                self_v.append(memory.new_zeros(rows, attn.n_heads, slots, attn.d_v))
        mask = attention_mask(src_pad)
        if mask is None:
            mask = torch.ones(memory.size(0), 1, 1, memory.size(1), dtype=torch.bool)
        mask = mask.repeat_interleave(beam, 0)
        return CompiledCache(
            self, self_k, self_v, cross_k, cross_v, mask, 0, max_len, beam, self_kv=self_kv
        )

    def _beam_cache(
        self, model: Transformer, memory: Tensor, src_pad: Tensor | None, max_len: int
    ) -> CompiledBeamCache:
        sentences, beam = memory.size(0), self.beam
        decoder_layers = model.decoder.layers
        cross_k, cross_v = _cross_keys_values(decoder_layers, memory)  # the memory once
        # Uninitialised: the step reads only the positions written before it.
        block = None
        if (width := _one_width(layer.self_attn for layer in decoder_layers)) is not None:
            n_heads, d_head = width
            block = memory.new_empty(
                2, len(decoder_layers), max_len, sentences, n_heads, beam, d_head
            )
        layers = []
        for i, layer in enumerate(decoder_layers):
            attn = layer.self_attn
            if block is not None:
                self_k, self_v = block[0, i], block[1, i]
            else:
                self_k = memory.new_empty(max_len, sentences, attn.n_heads, beam, attn.d_k)
                self_v = memory.new_empty(max_len, sentences, attn.n_heads, beam, attn.d_v)
            layers.append(LayerCache(self_k, self_v, cross_k[i], cross_v[i]))
        mask = attention_mask(src_pad)
        if mask is None:
            mask = torch.ones(sentences, 1, 1, memory.size(1), dtype=torch.bool)
        lineage = torch.zeros(sentences * beam, max_len, dtype=torch.long) if beam > 1 else None
        return CompiledBeamCache(layers, mask, 0, max_len, beam, lineage, step=self)

    def log_probs_step(self, tokens: Tensor, cache: CompiledCache | CompiledBeamCache) -> Tensor:
        if cache.length >= cache.max_len:
            raise ValueError(f"cache is full ({cache.max_len} positions)")
        (hidden,) = self.runner.run(cache.step_inputs(tokens, self.token_table))
        cache.length += 1
        with torch.no_grad():
            logits = logits_into(self.out_proj, hidden, cache)
            if logits is None:
                logits = self.out_proj(hidden)
            return panels.log_softmax_(logits)


# The caches keep every layer's keys and values in one block where the layers' widths agree:
# one allocation per kind the size of a batch, which malloc maps and gives back whole. Blocks
# per layer fall under its mmap threshold (16 MiB) at BASE's batches and, reused from its heap
# call after call, fragment it (figures: docs/performance.md).


def _one_width(attentions: Iterable[MultiHeadAttention]) -> tuple[int, int] | None:
    """(heads, head width) where every attention has the same and its keys and values are
    as wide; None otherwise."""
    shapes = {(a.n_heads, a.d_k, a.d_v) for a in attentions}
    if len(shapes) != 1 or (shape := shapes.pop())[1] != shape[2]:
        return None
    return shape[0], shape[1]


def _cross_keys_values(
    layers: Sequence[DecoderLayer], memory: Tensor, beam: int = 1
) -> tuple[list[Tensor], list[Tensor]]:
    """Each decoder layer's cross-attention keys and values of ``memory`` (B, S, d_model),
    (B × ``beam``, H, S, Dh), contiguous, a sentence's repeated for its ``beam`` rows."""
    attentions = []
    for layer in layers:
        assert layer.cross_attn is not None
        attentions.append(layer.cross_attn)
    width = _one_width(attentions)
    block = None
    if width is not None:
        sentences, length = memory.shape[:2]
        block = memory.new_empty(2, len(layers), sentences, beam, width[0], length, width[1])
    keys, values = [], []
    for i, attn in enumerate(attentions):
        if block is None:
            k, v = attn.project_kv(memory)  # (B, H, S, Dh)
            keys.append(k.repeat_interleave(beam, 0).contiguous())
            values.append(v.repeat_interleave(beam, 0).contiguous())
            continue
        # Views of the product, copied once, into the block (a subclass's may copy them first).
        k, v = MultiHeadAttention.project_kv(attn, memory)
        block[0, i].copy_(k.unsqueeze(1))
        block[1, i].copy_(v.unsqueeze(1))
        keys.append(block[0, i].flatten(0, 1))
        values.append(block[1, i].flatten(0, 1))
    return keys, values


def _identity(model: nn.Module) -> list[tuple[int, int, int]]:
    """Each parameter's identity, storage and version: what changes when a weight does."""
    return [(id(p), p.data_ptr(), p._version) for p in model.parameters()]


def step_keys(
    model: Transformer, rows: Sequence[int] = LIBRARIES, directory: Path | None = None
) -> dict[int, str]:
    """The digests that name a model's compiled steps, one for each row count in ``rows`` a
    step is tuned for: its weights and configuration, the sources and options it is compiled
    from (the rows among them), aiayn's and PyTorch's versions, the thread count (the
    library's kernels are built for it) and the CPU (architecture, the instruction sets
    PyTorch uses, /proc/cpuinfo's flags, the compiler's target where one is set). The weights
    are read once for all of them. Where aiayn's own product is in ``directory`` (the
    cache's by default) and not loaded yet, it is loaded first: the libraries built while it
    is loaded call it, and their keys say so."""
    _load_panels(directory or compiled_dir(), False, _warn)
    digest = hashlib.sha256()
    config = {k: str(v) for k, v in vars(model.config).items()}
    cpu = [platform.machine(), torch.backends.cpu.get_cpu_capability()]
    cpu.append("flags " + " ".join(sorted(cpu_flags())))
    # The compiler's target, where it is set (Inductor's cpp.march, TORCHINDUCTOR_CPP_MARCH by
    # default; else the host's own). Read from Inductor's config only where a compile has
    # imported it: the import adds to a decoding process's memory (docs/performance.md), and
    # until then the setting is the environment's.
    inductor = sys.modules.get("torch._inductor.config")
    march = os.environ.get(MARCH_VAR) if inductor is None else inductor.cpp.march
    cpu.append(f"march {march}")
    package = Path(aiayn.__file__).parent
    head = [aiayn.__version__, torch.__version__, str(torch.get_num_threads()), *cpu]
    head.append(f"panels {panels.loaded_name()}")  # the products' operator, where loaded
    head += [json.dumps(config), repr(_INDUCTOR), repr(_EXAMPLE_LENGTHS)]
    digest.update("\n".join(head).encode())
    for source in _SOURCES:
        digest.update((package / source).read_bytes())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy())
    keys = {}
    for n in rows:
        tuned = digest.copy()
        tuned.update(f"\nrows {n}{f' beam {beam_of(n)}' if beam_of(n) > 1 else ''}".encode())
        keys[n] = tuned.hexdigest()[:32]
    return keys


def step_key(model: Transformer, rows: int = FEW_ROWS) -> str:
    """The digest that names ``model``'s step tuned for ``rows`` rows (:func:`step_keys`)."""
    return step_keys(model, (rows,))[rows]


def step_paths(
    model: Transformer, directory: Path | None = None, rows: Sequence[int] = LIBRARIES
) -> dict[int, Path]:
    """Where ``model``'s compiled steps tuned for ``rows`` rows are kept (:func:`step_keys`)."""
    folder = directory or compiled_dir()
    keys = step_keys(model, rows, folder)
    return {n: folder / f"decoder-step-{key}.so" for n, key in keys.items()}


def step_path(model: Transformer, directory: Path | None = None, rows: int = FEW_ROWS) -> Path:
    return step_paths(model, directory, (rows,))[rows]


def load_compiled_step(
    model: Transformer, directory: Path | None = None, rows: int = FEW_ROWS
) -> CompiledStep | None:
    """The compiled step of ``model`` tuned for ``rows`` rows if it was compiled on this
    machine, else None. Raises ``PermissionError`` for a library that this user does not
    alone own (:func:`~aiayn.accel.store.trusted`)."""
    folder = directory or compiled_dir()
    if unsupported(model) is not None or not _any_compiled(folder):
        return None
    return _load(step_path(model, folder, rows), model, rows)


def _any_compiled(folder: Path) -> bool:
    """Whether any step was ever compiled into ``folder`` (where none was, no digest of the
    weights is made)."""
    return any(folder.glob("decoder-step-*.so"))


def _load(
    path: Path, model: Transformer, rows: int = FEW_ROWS, in_place: bool = True
) -> CompiledStep | None:
    if not path.is_file():
        return None
    require_trusted(path)
    if extern_calls(path).exists():  # the runner reads it where it is there
        require_trusted(extern_calls(path))
    return CompiledStep(path, model, rows, in_place)


def extern_calls(library: Path) -> Path:
    """Where AOTInductor's runner looks for the description of the operators ``library``
    calls outside PyTorch's own: ``<stem>.json`` beside it."""
    return library.with_suffix(".json")


def compile_step(
    model: Transformer,
    directory: Path | None = None,
    on_compile: Callable[[], None] | None = None,
    rows: int = FEW_ROWS,
) -> CompiledStep:
    """Compile ``model``'s decoder step tuned for ``rows`` rows (half a minute to a minute for
    a small model) into the cache directory, calling ``on_compile`` first, or load it if it
    is there already."""
    reason = unsupported(model)
    if reason is not None:
        raise ValueError(f"cannot compile the decoder step: {reason}")
    _load_panels(directory or compiled_dir(), True, _warn)
    return _load_or_compile(model, step_path(model, directory, rows), rows, on_compile)


def _load_panels(folder: Path, build: bool, warn: Callable[[str], None]) -> None:
    """Load aiayn's own product (:mod:`aiayn.accel.panels`) from ``folder`` where the CPU
    suits it (``build``: built there first where it is not), before a step's key is made:
    a library built while it is loaded calls it, and its key says so. What goes wrong is
    told to ``warn``, and the steps are built and found without it."""
    try:
        panels.load(folder, build)
    except Exception as error:  # a compiler that fails, a file that is not the user's
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        warn(f"panel product: {first[:300]}; packing for oneDNN")


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _load_or_compile(
    model: Transformer,
    path: Path,
    rows: int,
    on_compile: Callable[[], None] | None,
    in_place: bool = True,
) -> CompiledStep:
    step = _load(path, model, rows, in_place)
    if step is None:
        if on_compile is not None:
            on_compile()
        _export_and_compile(model, path, rows)
        step = CompiledStep(path, model, rows, in_place)
    return step


def attach_steps(
    model: Transformer,
    acceleration: Acceleration,
    build: bool,
    warn: Callable[[str], None],
) -> CompiledStep | None:
    """Give ``model``, an accelerated model the step serves (:func:`aiayn.accel.use_compiled_step`
    checks it), its compiled steps: those compiled on this machine before or (``build``)
    compiled now; return the first of them it has, or None. A library that fails to load or
    to compile is told to ``warn``, and the decodes it would have served stay eager."""
    said = False

    def say_compiling() -> None:
        nonlocal said
        if not said:
            warn("compiling the decoder step (once for this model on this machine)")
        said = True

    folder = compiled_dir()
    if not build and not _any_compiled(folder):
        return None
    _load_panels(folder, build, warn)  # the packs made after this call take it too
    steps: list[CompiledStep] = []
    in_place = acceleration.wants("compiled weights read in place")
    try:
        paths = step_paths(model, folder)  # the weights' digest, once for both
        for rows, name in zip(LIBRARIES, _ATTRIBUTES, strict=True):
            path = paths[rows]
            step = (
                _load_or_compile(model, path, rows, say_compiling, in_place)
                if build
                else _load(path, model, rows, in_place)
            )
            if step is not None:
                acceleration._set(model, name, step)
                steps.append(step)
    except Exception as error:  # a library that does not load, a compiler that fails
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        warn(f"compiled step: {first[:300]}; decoding without it")
    if steps:
        acceleration.use("compiled decoder step")
    if any(step.constants is not None for step in steps):
        acceleration.use("compiled weights read in place")
    return steps[0] if steps else None


def library_products(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' linear modules whose weights every library of ``model`` holds (all
    but the cross-attention keys' and values', which ``init_cache`` projects eagerly), where
    ``model`` has its three libraries; else none. Their products need no pack then: every
    float32 decode but a beam search of another size over more than :data:`MAX_ROWS` rows goes
    through a library, and those take the unpacked products, so that the weights are not in
    memory twice, a library's and a pack of them (figures: docs/performance.md)."""
    if not isinstance(model, Transformer) or any(
        vars(model).get(name) is None for name in _ATTRIBUTES
    ):
        return []
    return _decoder_products(model)


def step_products(model: nn.Module) -> list[nn.Module]:
    """The linear modules of a :class:`Transformer`'s decoder step whose rows are the step's
    own (a row a hypothesis): the decoder layers' (but the cross-attention keys' and values',
    which multiply the source's positions) and the pre-softmax projection; none for another
    model."""
    if not isinstance(model, Transformer):
        return []
    return [*_decoder_products(model), model.out_proj]


def _decoder_products(model: Transformer) -> list[nn.Module]:
    products: list[nn.Module] = []
    for layer in model.decoder.layers:
        products += [layer.self_attn.qkv_proj, layer.self_attn.out_proj]
        if layer.cross_attn is not None:
            products += [layer.cross_attn.q_proj, layer.cross_attn.out_proj]
        products += [layer.ffn.w1, layer.ffn.w2]
    return products


def _rebuild(root: nn.Module, build: Callable[[nn.Module], nn.Module | None]) -> None:
    """Put in place of each module under ``root`` the one ``build`` makes of it, where it
    makes one: a module's own modules first, so that what is built of it holds theirs."""
    for name, child in list(root.named_children()):
        _rebuild(child, build)
        new = build(child)
        if new is not None:
            setattr(root, name, new)


def _one_query(attention: MultiHeadAttention, through_kernel: bool) -> OneQueryAttention:
    """A :class:`OneQueryAttention` of ``attention``'s own projections."""
    new = OneQueryAttention(
        attention.out_proj.out_features,
        attention.n_heads,
        attention.d_k,
        attention.d_v,
        self_attention=attention.self_attention,
        dropout=attention.dropout,
        bias=attention.out_proj.bias is not None,
    )
    for name, child in attention.named_children():
        setattr(new, name, child)
    new.pattern = attention.pattern
    new.through_kernel = through_kernel
    return new


# Without autograd: freezing packs a product's weight for oneDNN only where the weight needs
# no gradient (with it, every product of the 64-row library is an unpacked addmm that packs
# its weight again at every call, and slower: docs/performance.md).
@torch.no_grad()
def _export_and_compile(model: Transformer, path: Path, rows: int) -> None:
    from torch.export import Dim

    # A copy: the accelerated model's packed products are not what Inductor should see
    # (a copied layer has no pack) and the step must not change the model. Not of the
    # steps it has already (a loaded library is not copied).
    loaded = {id(v): None for v in vars(model).values() if isinstance(v, CompiledStep)}
    plain = copy.deepcopy(model, memo=loaded).eval()
    beam, major = beam_of(rows), position_major(rows)
    # The panels' attention kernel for the libraries of many rows. At a few rows (one
    # sentence) each call out of the library costs more than Inductor's loops take.
    kernel = panels.loaded() and major
    products = {id(m) for m in _decoder_products(plain) if isinstance(m, nn.Linear)}
    use_panels = panels.loaded()  # the step's products through the panels' operator

    def compiled_form(module: nn.Module) -> nn.Module | None:
        if isinstance(module, MultiHeadAttention):  # not the accelerated one: not traced
            return _one_query(module, kernel)
        if use_panels and (ffn := panels.PanelFeedForward.of(module)) is not None:
            return ffn
        if use_panels and id(module) in products:
            assert isinstance(module, nn.Linear)
            return panels.to_panels(module)
        return None

    _rebuild(plain, compiled_form)
    step = (BeamDecoderStep(plain, beam) if major else DecoderStep(plain)).eval()
    positions = plain.config.max_positions
    rows, src, slots = (min(n, positions) for n in (rows, *_EXAMPLE_LENGTHS))
    layers = len(plain.decoder.layers)
    attn = plain.decoder.layers[0].self_attn
    heads, dk, dv = attn.n_heads, attn.d_k, attn.d_v
    s = Dim("source", min=1, max=positions)
    t = Dim("slots", min=1, max=positions)
    if not major:
        r = Dim("rows", min=1, max=4096)
        self_shape: tuple[int, ...] = (rows, heads, slots)
        n, tokens, mask_shape = rows, {0: r}, None
        self_dims = {0: r, 2: t}
    else:  # (positions, sentences, H, beam, Dh) keys and values, the mask's positions × beam
        n = max(1, rows // beam)
        r = Dim("sentences", min=1, max=4096 // beam)
        self_shape = (slots, n, heads, beam)
        tokens = {0: beam * r} if beam > 1 else {0: r}
        mask_shape = {0: r, 3: beam * t} if beam > 1 else None
        self_dims = {0: t, 1: r}
    args: tuple[Any, ...] = (
        torch.ones(n * beam, dtype=torch.long),
        torch.tensor([min(3, slots - 1)]),
        plain.tgt_embed.token.weight.detach(),
        [torch.zeros(*self_shape, dk) for _ in range(layers)],
        [torch.zeros(*self_shape, dv) for _ in range(layers)],
        [torch.randn(n, heads, src, dk) for _ in range(layers)],
        [torch.randn(n, heads, src, dv) for _ in range(layers)],
        torch.ones(n, 1, 1, src, dtype=torch.bool),
    )
    shapes: tuple[Any, ...] = (
        tokens,
        None,
        None,
        [self_dims] * layers,
        [self_dims] * layers,
        [{0: r, 2: s}] * layers,
        [{0: r, 2: s}] * layers,
        {0: r, 3: s},
    )
    if mask_shape is not None:  # the beams' self-attention mask, 0 or -inf
        args += (torch.zeros(n, 1, beam, slots * beam),)
        shapes += (mask_shape,)
    exported = torch.export.export(step, args, dynamic_shapes=shapes)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # AOTInductor writes its sources beside the library: a directory of its own, then only
    # the library is moved into place (atomically).
    work = Path(tempfile.mkdtemp(prefix=path.stem + ".", dir=path.parent))
    try:
        options = dict(_INDUCTOR) | {"aot_inductor.output_path": str(work / path.name)}
        built = torch._inductor.aot_compile(exported.module(), args, options=options)
        os.chmod(str(built), 0o700)
        # An index is only ever of the library beside it. It is made from the library in
        # place: the library's loader reads the weights from the path it was loaded from.
        index = index_path(path)
        index.unlink(missing_ok=True)
        # The description of the operators the library calls outside PyTorch's own (the
        # panels'), which its runner reads beside it: in place before the library.
        calls = extern_calls(path)
        calls.unlink(missing_ok=True)
        for description in work.glob("*.wrapper.json"):
            os.chmod(description, 0o600)
            os.replace(description, calls)
        os.replace(str(built), path)
        write_index(path, index)
    finally:
        shutil.rmtree(work, ignore_errors=True)
