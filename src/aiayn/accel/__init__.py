"""CPU speed for aiayn's models, applied by one explicit call.

The network in :mod:`aiayn.model` is the paper's, in plain PyTorch. On the CPU,
:func:`accelerate` swaps some of its modules for faster ones with the same parameters, state
dict and results (bit for bit, or to the tolerances that ``tests/accel`` states), and raises the
process's ``malloc`` thresholds; :meth:`Acceleration.undo` puts everything back::

    acceleration = accelerate(model, mode="train", precision="bf16")
    ...
    acceleration.undo()

===========================  ==========================  =======================================
lever                        applied in                  what changes
===========================  ==========================  =======================================
grid dropout (one random    train and decode (where     ``nn.Dropout`` → :class:`GridDropout`,
draw per four elements)      it is a cheaper identity)   ``Residual`` → :class:`GridResidual`
attention in float32         bf16 (train and decode)     ``MultiHeadAttention`` →
                                                         :class:`Float32Attention`
padded bfloat16 rows         bf16 (train and decode)     ``nn.Linear`` → :class:`CpuLinear`
packed weights               decode: bf16 (oneDNN), and  ``nn.Linear`` → :class:`CpuLinear` with
                             fp32 with ``pack_weights``  a pack of its weight
                             (MKL)
one buffer per decode        decode                      ``Transformer`` →
                                                         :class:`BufferedDecoding`
fused projection + loss      train (fp32, bf16)          ``fused_loss``: the Trainer takes
                                                         :func:`.loss.projected_label_smoothed_nll`
malloc thresholds            train, decode               process-wide, see :mod:`.memory`
===========================  ==========================  =======================================

On other devices it changes nothing. :class:`aiayn.training.trainer.Trainer` and
:class:`aiayn.inference.translator.Translator` call it on the CPU. What each lever gives:
docs/performance.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from aiayn.accel import memory
from aiayn.accel.attention import Float32Attention
from aiayn.accel.cpu import cpu_has_bfloat16
from aiayn.accel.decoding import BufferedDecoding
from aiayn.accel.dropout import GridDropout, GridResidual
from aiayn.accel.linear import CpuLinear, pack, unwatch_optimizer_steps, watch_optimizer_steps
from aiayn.model.attention import MultiHeadAttention
from aiayn.model.layers import Residual
from aiayn.model.transformer import Transformer

__all__ = [
    "Acceleration",
    "BufferedDecoding",
    "CpuLinear",
    "Float32Attention",
    "GridDropout",
    "GridResidual",
    "Precision",
    "accelerate",
    "cpu_has_bfloat16",
]

Mode = Literal["train", "decode"]
Precision = Literal["fp32", "bf16", "fp16"]
MODES = ("train", "decode")
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Each swap: the plain class (matched exactly, not its subclasses) and its faster subclass.
_SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Dropout: GridDropout,
    Residual: GridResidual,
    MultiHeadAttention: Float32Attention,
    nn.Linear: CpuLinear,
    Transformer: BufferedDecoding,
}


@dataclass
class Acceleration:
    """What :func:`accelerate` did to a model, and the way back (:meth:`undo`)."""

    mode: Mode
    precision: Precision
    levers: list[str] = field(default_factory=list)
    packed: int = 0  # linear layers whose weight is packed
    # Training: fuse the pre-softmax projection and the loss (aiayn.accel.loss).
    fused_loss: bool = False
    _swapped: list[tuple[nn.Module, type[nn.Module]]] = field(default_factory=list, repr=False)
    _memory: int | None = field(default=None, repr=False)
    _watching: bool = field(default=False, repr=False)

    def undo(self) -> None:
        """Put the plain modules back, drop the packs and release the process settings."""
        for module, plain in reversed(self._swapped):
            for name in ("pack", "pad_bf16_rows"):
                module.__dict__.pop(name, None)
            module.__class__ = plain
        self._swapped.clear()
        memory.release(self._memory)
        self._memory = None
        if self._watching:
            unwatch_optimizer_steps()
            self._watching = False
        self.levers.clear()
        self.packed = 0
        self.fused_loss = False

    def __enter__(self) -> Acceleration:
        return self

    def __exit__(self, *_: Any) -> None:
        self.undo()

    def _swap(self, model: nn.Module, plain: list[type[nn.Module]], lever: str) -> list[nn.Module]:
        """Swap every module of exactly a ``plain`` class for its faster subclass; ``lever``
        is recorded if any was."""
        swapped = [m for m in model.modules() if type(m) in plain]
        for module in swapped:
            self._swapped.append((module, type(module)))
            module.__class__ = _SWAPS[type(module)]
        if swapped:
            self.levers.append(lever)
        return swapped


def accelerate(
    model: nn.Module,
    mode: Mode = "train",
    *,
    precision: Precision = "fp32",
    pack_weights: bool = False,
    memory_settings: bool = True,
) -> Acceleration:
    """Make ``model`` faster on the CPU for ``mode`` (see the module docstring).

    ``precision`` is what the model runs at: for ``"train"``, the autocast dtype the trainer
    uses (``"fp32"``: none); for ``"decode"``, its weights' dtype (convert the model first).
    ``pack_weights`` packs float32 weights for MKL (decoding only; bfloat16 weights are always
    packed, for oneDNN). ``memory_settings`` raises the process's malloc thresholds while the
    acceleration lives. A model that is not on the CPU is left as it is.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if precision not in PRECISION_DTYPES:
        raise ValueError(
            f"precision must be one of {', '.join(PRECISION_DTYPES)}, got {precision!r}"
        )
    if pack_weights and mode != "decode":
        raise ValueError("pack_weights is for decoding: packed weights serve no gradient")
    acceleration = Acceleration(mode, precision)
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
    acceleration._swap(model, [nn.Dropout, Residual], "grid dropout")
    if mode == "train":
        acceleration.fused_loss = True
        acceleration.levers.append("fused projection + loss")
    if mode == "decode":
        acceleration._swap(model, [Transformer], "one buffer per decode")
    if bf16:
        acceleration._swap(model, [MultiHeadAttention], "attention in float32")
    if bf16 or pack_weights:
        lever = "padded bfloat16 rows" if bf16 else "linear layers for packing"
        linears = [
            m for m in acceleration._swap(model, [nn.Linear], lever) if isinstance(m, CpuLinear)
        ]
        for layer in linears:
            layer.pad_bf16_rows = bf16
        if mode == "decode":
            for layer in linears:
                layer.pack = pack(layer)
                acceleration.packed += layer.pack is not None
            if acceleration.packed:
                watch_optimizer_steps()
                acceleration._watching = True
                library = "oneDNN" if bf16 else "MKL"
                acceleration.levers.append(f"packed weights ({library}, {acceleration.packed})")
    if memory_settings:
        acceleration._memory = memory.hold(memory.TRAIN if mode == "train" else memory.DECODE)
        if acceleration._memory is not None:
            acceleration.levers.append(f"malloc thresholds ({mode})")
    return acceleration
