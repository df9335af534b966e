"""CPU speed for aiayn's models, applied by one explicit call.

The network in :mod:`aiayn.model` is the paper's, in plain PyTorch. On the CPU,
:func:`accelerate` swaps some of its modules for faster ones with the same parameters, state
dict and the plain model's results (bit for bit in fp32 without dropout, packed weights or
beam steps over many sentences; the same dropout distribution from other draws; packed
weights, which decoding uses by default on x86 CPUs other than Intel's, attention by
products and bfloat16 to the tolerances that ``tests/accel`` states); asked
(``process_settings=True``, as aiayn's commands ask), it also raises the process's ``malloc``
thresholds. :meth:`Acceleration.undo` puts everything back::

    acceleration = accelerate(model, mode="train", precision="bf16")
    ...
    acceleration.undo()

The levers, each with when it applies, what it swaps and how it is undone, are listed once in
:data:`aiayn.accel.levers.LEVERS`; ``accelerate(..., disable={name})`` leaves any of them out.

On other devices it changes nothing. :class:`aiayn.training.trainer.Trainer` and
:class:`aiayn.inference.translator.Translator` call it on the CPU. What each lever gives:
the table ``make bench-levers`` writes (benchmarks/results/levers-<host>.md), which
docs/performance.md shows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from aiayn.accel import compiled, memory, panels
from aiayn.accel.attention import Float32Attention, PanelAttention, StepAttention
from aiayn.accel.compiled import CompiledStep, library_products, step_products
from aiayn.accel.cpu import cpu_has_bfloat16, private_ops_unverified
from aiayn.accel.decoding import BufferedDecoding
from aiayn.accel.dropout import GridDropout, GridResidual
from aiayn.accel.levers import LEVERS, disabled_levers
from aiayn.accel.linear import (
    CpuLinear,
    fp32_pack_library,
    onednn_for_float32,
    pack,
    unwatch_optimizer_steps,
    watch_optimizer_steps,
)
from aiayn.model.attention import MultiHeadAttention
from aiayn.model.layers import Residual
from aiayn.model.transformer import Transformer

__all__ = [
    "LEVERS",
    "Acceleration",
    "BufferedDecoding",
    "CpuLinear",
    "Float32Attention",
    "GridDropout",
    "GridResidual",
    "PanelAttention",
    "Precision",
    "StepAttention",
    "accelerate",
    "cpu_has_bfloat16",
    "use_compiled_step",
]

Mode = Literal["train", "decode"]
Precision = Literal["fp32", "bf16", "fp16"]
MODES = ("train", "decode")
PRECISION_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}

# Each swap: the plain class (matched exactly, not its subclasses) and its faster subclass.
# A swap changes a module's class in place (Acceleration._swap, and back in undo): the model
# the caller holds, its submodules, their hooks and an optimizer's parameters stay the same
# objects, which a module built anew in its place would not be. (The compiled step's copy of
# the model, which nobody else holds, is built anew: accel.compiled._rebuild.)
_SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Dropout: GridDropout,
    Residual: GridResidual,
    MultiHeadAttention: Float32Attention,
    nn.Linear: CpuLinear,
    Transformer: BufferedDecoding,
}


_UNSET = object()
_NAMES = frozenset(lever.name for lever in LEVERS)


@dataclass
class Acceleration:
    """What :func:`accelerate` did to a model, and the way back (:meth:`undo`)."""

    mode: Mode
    precision: Precision
    # The names (aiayn.accel.levers.LEVERS) of the levers this call applied, in its order;
    # their counts (packs, bytes) in ``details``.
    levers: list[str] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)
    # The levers the call was asked to leave out (with those that need them).
    disabled: frozenset[str] = frozenset()
    packed: int = 0  # linear layers whose weight is packed
    # Training: fuse the pre-softmax projection and the loss (aiayn.accel.loss).
    fused_loss: bool = False
    # (module, its plain class, the class it was given)
    _swapped: list[tuple[nn.Module, type[nn.Module], type[nn.Module]]] = field(
        default_factory=list, repr=False
    )
    # (module, attribute, its value before, or _UNSET): what this call set on CpuLinear layers
    _attributes: list[tuple[nn.Module, str, object]] = field(default_factory=list, repr=False)
    _memory: int | None = field(default=None, repr=False)
    _watching: bool = field(default=False, repr=False)

    def undo(self) -> None:
        """Put back what this call changed: the attributes it set, the plain classes of the
        modules it swapped (unless something has swapped them again since), the packs; and
        release its process settings."""
        for module, name, before in reversed(self._attributes):
            if before is _UNSET:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, before)
        self._attributes.clear()
        for module, plain, fast in reversed(self._swapped):
            if type(module) is fast:
                for name in ("pack", "pad_bf16_rows"):
                    module.__dict__.pop(name, None)
                module.__class__ = plain
        self._swapped.clear()
        self.release_memory()
        if self._watching:
            unwatch_optimizer_steps()
            self._watching = False
        self.levers.clear()
        self.details.clear()
        self.packed = 0
        self.fused_loss = False

    def release_memory(self) -> None:
        """Release the malloc setting only (the model stays accelerated)."""
        memory.release(self._memory)
        self._memory = None

    def __enter__(self) -> Acceleration:
        return self

    def __exit__(self, *_: Any) -> None:
        self.undo()

    def _swap(
        self,
        model: nn.Module,
        plain: list[type[nn.Module]],
        lever: str = "",
        to: type[nn.Module] | None = None,
        where: Callable[[Any], bool] | None = None,
    ) -> None:
        """Swap every module of exactly a ``plain`` class (that ``where`` accepts, if given)
        for its faster subclass (``to``, or the one :data:`_SWAPS` names); ``lever`` is
        recorded if any was."""
        swapped = [m for m in model.modules() if type(m) in plain and (where is None or where(m))]
        for module in swapped:
            fast = to or _SWAPS[type(module)]
            self._swapped.append((module, type(module), fast))
            module.__class__ = fast
        if swapped and lever:
            self.use(lever)

    def wants(self, lever: str) -> bool:
        """Whether the call may apply ``lever`` (not disabled)."""
        return lever not in self.disabled

    def use(self, lever: str, detail: str = "") -> None:
        """Record ``lever`` as applied (once), with a detail (a count, a size)."""
        assert lever in _NAMES, lever
        if lever not in self.levers:
            self.levers.append(lever)
        if detail:
            self.details[lever] = detail

    def _set(self, module: nn.Module, name: str, value: object) -> None:
        self._attributes.append((module, name, module.__dict__.get(name, _UNSET)))
        setattr(module, name, value)


def accelerate(
    model: nn.Module,
    mode: Mode = "train",
    *,
    precision: Precision = "fp32",
    pack_weights: bool | None = None,
    process_settings: bool = False,
    disable: Iterable[str] = (),
    before_packing: Callable[[Acceleration], object] | None = None,
) -> Acceleration:
    """Make ``model`` faster on the CPU for ``mode`` (see the module docstring).

    ``precision`` is what the model runs at: for ``"train"``, the autocast dtype the trainer
    uses (``"fp32"``: none); for ``"decode"``, its weights' dtype (convert the model first).
    ``pack_weights`` packs float32 weights for decoding, for the library
    :func:`~aiayn.accel.linear.fp32_pack_library` names (MKL on Intel CPUs, else oneDNN);
    None, the default, packs them where that library is oneDNN, whose packed products are
    faster at every row count there; False packs no float32 weight. bfloat16 weights are
    always packed, for oneDNN. A model that is not on the CPU is left as it is.

    ``process_settings`` is for the program that owns the process (aiayn's commands pass it):
    True also raises the process's malloc thresholds while the acceleration lives
    (:mod:`~aiayn.accel.memory`). By default (False) nothing outside the model changes.

    ``disable``: names of levers (:data:`~aiayn.accel.levers.LEVERS`) to leave out, and with
    them those that need them; an unknown name raises ValueError.

    ``before_packing`` is called with the acceleration once the modules are swapped and
    before any weight is packed: what it loads does not meet the packs in memory
    (:class:`~aiayn.inference.translator.Translator` loads the compiled decoder step there,
    whose loading briefly holds two copies of the decoder's weights).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if precision not in PRECISION_DTYPES:
        raise ValueError(
            f"precision must be one of {', '.join(PRECISION_DTYPES)}, got {precision!r}"
        )
    if pack_weights and mode != "decode":
        raise ValueError("pack_weights is for decoding: packed weights serve no gradient")
    acceleration = Acceleration(mode, precision, disabled=disabled_levers(disable))
    wants = acceleration.wants
    fp32_library = fp32_pack_library()
    if pack_weights is None:
        pack_weights = mode == "decode" and fp32_library == "onednn"
    first = next(model.parameters(), None)
    if first is not None and first.device.type != "cpu":
        return acceleration
    if precision == "fp16":
        raise ValueError("fp16 needs a CUDA device; on the CPU, use bf16")
    if mode == "decode":
        weights = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if weights - {PRECISION_DTYPES[precision]}:
            raise ValueError(
                f"decoding at {precision} needs the model's weights in "
                f"{PRECISION_DTYPES[precision]}, not {sorted(map(str, weights))}"
            )
    bf16 = precision == "bf16"
    if mode == "decode" and (bf16 or pack_weights or onednn_for_float32()):
        _say_once(private_ops_unverified())  # where decoding would pack weights
    if wants("grid dropout"):
        acceleration._swap(model, [nn.Dropout, Residual], "grid dropout")
    if mode == "train" and wants("fused projection + loss"):
        acceleration.fused_loss = True
        acceleration.use("fused projection + loss")
    if mode == "decode" and wants("one buffer per decode"):
        acceleration._swap(model, [Transformer], "one buffer per decode")
    decoder = getattr(model, "decoder", None)
    steps_by_products = wants("beam steps attended by products") and (
        not bf16 or wants("attention in float32")  # a StepAttention is a Float32Attention
    )
    if mode == "decode" and fp32_library == "onednn" and isinstance(decoder, nn.Module):
        # Where oneDNN packs float32 (make bench-levers measures it: docs/performance.md).
        if steps_by_products:
            lever = "beam steps attended by products"
            acceleration._swap(decoder, [MultiHeadAttention], lever, StepAttention)
    if bf16 and wants("attention in float32"):  # the rest (StepAttention is a Float32Attention)
        acceleration._swap(model, [MultiHeadAttention])
        if any(issubclass(fast, Float32Attention) for _, _, fast in acceleration._swapped):
            acceleration.use("attention in float32")
    if before_packing is not None:
        before_packing(acceleration)
    encoder = getattr(model, "encoder", None)
    if (
        mode == "decode"
        and not bf16
        and panels.loaded()
        and isinstance(encoder, nn.Module)
        and wants("encoder attention by aiayn's kernel")
    ):
        lever = "encoder attention by aiayn's kernel"
        acceleration._swap(encoder, [MultiHeadAttention], lever, PanelAttention)
    # The products the compiled steps hold: not packed (their weights are in the libraries).
    held = library_products(model) if mode == "decode" else []
    packing = mode == "decode" and wants("packed weights") and (bf16 or pack_weights)
    padding = bf16 and wants("padded bfloat16 rows")
    if packing or padding:
        acceleration._swap(model, [nn.Linear])
        # Every CpuLinear, also those an earlier call swapped in: calls add up.
        linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
        if padding:
            unpadded = [layer for layer in linears if not layer.pad_bf16_rows]
            for layer in unpadded:
                acceleration._set(layer, "pad_bf16_rows", True)
            if unpadded:
                acceleration.use("padded bfloat16 rows")
        if packing:
            made: list[str] = []  # for each new pack: the library it is packed for
            unpacked = {id(m) for m in held}
            # Where the panels' product is loaded (by the compiled step's loader, before
            # packing), it multiplies the step's products; the encoder's stay oneDNN's.
            use_panels = (
                fp32_library == "onednn"
                and not bf16
                and panels.loaded()
                and wants("aiayn's AVX2 panels")
            )
            stepwise = {id(m) for m in step_products(model)} if use_panels else set()
            for layer in linears:
                if id(layer) in unpacked or layer.pack_serves():
                    continue
                new = pack(layer, "panels" if id(layer) in stepwise else fp32_library)
                if new is not None:
                    acceleration._set(layer, "pack", new)
                    made.append(new.kind)
            acceleration.packed = sum(layer.pack_serves() for layer in linears)
            if made:
                watch_optimizer_steps()
                acceleration._watching = True
                names = {"mkl": "MKL", "onednn": "oneDNN", "panels": "aiayn's AVX2 panels"}
                library = " and ".join(names[kind] for kind in sorted(set(made)))
                acceleration.use("packed weights", f"{library}, {len(made)}")
                if "panels" in made:
                    acceleration.use("aiayn's AVX2 panels", str(made.count("panels")))
    if process_settings and wants("malloc thresholds"):
        acceleration._memory = memory.hold(memory.TRAIN if mode == "train" else memory.DECODE)
        if acceleration._memory is not None:
            acceleration.use("malloc thresholds", mode)
    return acceleration


_said: set[str] = set()


def use_compiled_step(
    model: nn.Module,
    acceleration: Acceleration,
    build: bool,
    warn: Callable[[str], None],
) -> CompiledStep | None:
    """Give the accelerated ``model`` (a :class:`BufferedDecoding`) its compiled steps, tuned
    for few rows (``compiled_step``), for many (``compiled_batch_step``) and for beam searches
    over many (``compiled_beam_step``), those compiled on this machine before or (``build``)
    compiled now, and return the first of them it has, or None (:mod:`aiayn.accel.compiled`).
    What goes wrong is told to ``warn`` (a failed load or compile always; a model the step
    does not serve with ``build``), and the decodes the step would have served stay eager.
    :meth:`Acceleration.undo` takes the steps away."""
    if not acceleration.wants("compiled decoder step"):  # left out (accelerate's disable)
        return None
    reason = compiled.unsupported(model)
    if reason is None and not isinstance(model, BufferedDecoding):
        reason = "the compiled step serves the accelerated model (accelerated=False)"
    if reason is not None:
        if build:
            warn(f"compiled step: {reason}; decoding without it")
        return None
    assert isinstance(model, BufferedDecoding)
    return compiled.attach_steps(model, acceleration, build, warn)


def _say_once(reason: str | None) -> None:
    """Warn once a process with ``reason`` (a lever that is off), where there is one."""
    if reason is not None and reason not in _said:
        _said.add(reason)
        warnings.warn(reason, RuntimeWarning, stacklevel=3)
