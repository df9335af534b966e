"""CPU speed for aiayn's models, applied by one explicit call.

The network in :mod:`aiayn.model` is the paper's, in plain PyTorch. On the CPU,
:func:`accelerate` swaps some of its modules for faster ones with the same parameters, state
dict and the plain model's results (bit for bit in fp32 without dropout, packed weights or
beam steps over many sentences; the same dropout distribution from other draws; packed
weights, which decoding uses by default on x86 CPUs other than Intel's, attention by
products and bfloat16 to the tolerances that ``tests/accel`` states), and raises the
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
                                                         :class:`Float32Attention` (decode:
                                                         its subclass :class:`StepAttention`)
beam steps attended by       decode, 32+ (sentence,      ``MultiHeadAttention`` →
products                     head) pairs, 2-16 beams     :class:`StepAttention`
padded bfloat16 rows         bf16 (train and decode)     ``nn.Linear`` → :class:`CpuLinear`
packed weights               decode: bf16 (oneDNN);      ``nn.Linear`` → :class:`CpuLinear` with
                             fp32 where oneDNN packs     a pack of its weight
                             them (non-Intel CPUs), or
                             with ``pack_weights``
one buffer per decode        decode                      ``Transformer`` →
                                                         :class:`BufferedDecoding`
compiled decoder step        decode, fp32, up to 16      ``BufferedDecoding.compiled_step``,
                             rows, greedy decodes and     ``compiled_batch_step``,
                             beam 4 searches of more,     ``compiled_beam_step`` (set by
                             once compiled on the         :func:`.compiled.use_compiled_step`)
                             machine (``Translator``)
fused projection + loss      train (fp32, bf16)          ``fused_loss``: the Trainer takes
                                                         :func:`.loss.projected_label_smoothed_nll`
mapped weights handed back   decode (weights mapped      the pages of each weight a oneDNN
                             from a checkpoint)          pack replaces, and of embedding
                                                         tables (then read a row at a time)
compiled step's weights      decode, with a compiled     views of the library's file
read from its file           step (Linux)                (:mod:`.library_constants`); the
                                                         loader's copy freed
idle memory handed back      decode, with a compiled     the heap's free blocks before small
at each switch               step                        decodes that follow a large one, the
                                                         library's pages before large ones
aiayn's AVX2 product         decode, fp32, x86 CPUs      the step's products packed into
(panels)                     other than Intel's with     panels (:mod:`.panels`), also in the
                             AVX2 and no AVX-512, once   compiled step's libraries (there the
                             built with the compiled     feed-forward's ReLU in its first
                             step                        product); the encoder's stay oneDNN's;
                                                         over 16 rows, work in chunks
aiayn's AVX2 kernels         decode, fp32, where the     the step's log-softmax in place, greedy's
                             panels' file is loaded      choice (:mod:`.panels`); the encoder's
                                                         ``MultiHeadAttention`` →
                                                         :class:`PanelAttention`
ReLU in the product          decode, feed-forward        ``PositionwiseFeedForward`` →
                             layers whose first product  :class:`~.linear.ReluInProduct`
                             has a oneDNN pack
PyTorch's code pages         decode, at the end of the   the pages of PyTorch's libraries
handed back                  call (Linux)                (:func:`.memory.release_library_pages`)
malloc thresholds            train, decode               process-wide, see :mod:`.memory`
===========================  ==========================  =======================================

On other devices it changes nothing. :class:`aiayn.training.trainer.Trainer` and
:class:`aiayn.inference.translator.Translator` call it on the CPU. What each lever gives:
docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.accel import memory, panels
from aiayn.accel.attention import Float32Attention, PanelAttention, StepAttention
from aiayn.accel.compiled import library_products, step_products
from aiayn.accel.cpu import cpu_has_bfloat16
from aiayn.accel.decoding import BufferedDecoding
from aiayn.accel.dropout import GridDropout, GridResidual
from aiayn.accel.linear import (
    CpuLinear,
    ReluInProduct,
    fp32_pack_library,
    pack,
    unwatch_optimizer_steps,
    watch_optimizer_steps,
)
from aiayn.model.attention import MultiHeadAttention
from aiayn.model.feedforward import PositionwiseFeedForward
from aiayn.model.layers import Residual
from aiayn.model.transformer import Transformer

__all__ = [
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
_SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Dropout: GridDropout,
    Residual: GridResidual,
    MultiHeadAttention: Float32Attention,
    nn.Linear: CpuLinear,
    Transformer: BufferedDecoding,
}


_UNSET = object()

# PyTorch's shared libraries (libtorch_cpu and the rest).
TORCH_LIBRARIES = Path(torch.__file__).resolve().parent / "lib"


@dataclass
class Acceleration:
    """What :func:`accelerate` did to a model, and the way back (:meth:`undo`)."""

    mode: Mode
    precision: Precision
    levers: list[str] = field(default_factory=list)
    packed: int = 0  # linear layers whose weight is packed
    # Bytes of weights mapped from a file whose pages were advised out (decode; what the
    # kernel does with them: accel.memory.page_out): those a oneDNN pack replaced, and
    # embedding tables read a row at a time.
    handed_back: int = 0
    # Bytes of PyTorch's library pages (code that loading ran) handed back at the end of a
    # decode acceleration (accel.memory.release_library_pages).
    library_pages: int = 0
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
    # Mapped embedding tables advised to be read a page at a time.
    _tables: list[torch.Tensor] = field(default_factory=list, repr=False)

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
        for table in self._tables:  # read ahead again, as products that read it whole do
            memory.read_by_rows(table, undo=True)
        self._tables.clear()
        self.release_memory()
        if self._watching:
            unwatch_optimizer_steps()
            self._watching = False
        self.levers.clear()
        self.packed = 0
        self.handed_back = 0
        self.library_pages = 0
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
            self.levers.append(lever)

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
    (:mod:`~aiayn.accel.memory`) and, for ``"decode"``, hands back the pages of PyTorch's
    libraries that loading ran (:func:`~aiayn.accel.memory.release_library_pages`: the
    process's RSS, not the page cache). By default (False) nothing outside the model changes:
    what is handed back is only the model's own (pages of its weights mapped from a file).

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
    fp32_library = fp32_pack_library()
    if pack_weights is None:
        pack_weights = mode == "decode" and fp32_library == "onednn"
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
    decoder = getattr(model, "decoder", None)
    if mode == "decode" and fp32_library == "onednn" and isinstance(decoder, nn.Module):
        # Measured to pay on an AMD EPYC; on an Intel Xeon beam batches were slower with it.
        lever = "beam steps attended by products"
        acceleration._swap(decoder, [MultiHeadAttention], lever, StepAttention)
    if bf16:  # the rest (StepAttention is a Float32Attention)
        acceleration._swap(model, [MultiHeadAttention])
        if any(issubclass(fast, Float32Attention) for _, _, fast in acceleration._swapped):
            acceleration.levers.append("attention in float32")
    if before_packing is not None:
        before_packing(acceleration)
    encoder = getattr(model, "encoder", None)
    if mode == "decode" and not bf16 and panels.loaded() and isinstance(encoder, nn.Module):
        lever = "encoder attention by aiayn's kernel"
        acceleration._swap(encoder, [MultiHeadAttention], lever, PanelAttention)
    # The products the compiled steps hold: not packed, their weights' pages handed back.
    held = _hand_back_library_products(model, acceleration) if mode == "decode" else []
    if bf16 or pack_weights:
        acceleration._swap(model, [nn.Linear])
        # Every CpuLinear, also those an earlier call swapped in: calls add up.
        linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
        if bf16:
            unpadded = [layer for layer in linears if not layer.pad_bf16_rows]
            for layer in unpadded:
                acceleration._set(layer, "pad_bf16_rows", True)
            if unpadded:
                acceleration.levers.append("padded bfloat16 rows")
        if mode == "decode":
            made: list[str] = []  # for each new pack: the library it is packed for
            mappings = memory.file_mappings()
            handed = {id(m.weight) for m in held}  # weights whose pages were handed back
            unpacked = {id(m) for m in held}
            # Where the panels' product is loaded (by the compiled step's loader, before
            # packing), it multiplies the step's products; the encoder's stay oneDNN's.
            use_panels = fp32_library == "onednn" and not bf16 and panels.loaded()
            stepwise = {id(m) for m in step_products(model)} if use_panels else set()
            for layer in linears:
                if id(layer) in unpacked or layer.pack_serves():
                    continue
                new = pack(layer, "panels" if id(layer) in stepwise else fp32_library)
                if new is not None:
                    acceleration._set(layer, "pack", new)
                    made.append(new.kind)
                    if new.whole and id(layer.weight) not in handed:
                        # Every product goes through the pack from now on: the pages of a
                        # weight mapped from a file go back one layer at a time.
                        handed.add(id(layer.weight))
                        acceleration.handed_back += memory.page_out(layer.weight, mappings)
            acceleration.packed = sum(layer.pack_serves() for layer in linears)
            if made:
                watch_optimizer_steps()
                acceleration._watching = True
                names = {"mkl": "MKL", "onednn": "oneDNN", "panels": "aiayn's AVX2 panels"}
                library = " and ".join(names[kind] for kind in sorted(set(made)))
                acceleration.levers.append(f"packed weights ({library}, {len(made)})")
            _relu_in_products(model, acceleration)
    if mode == "decode":
        _tables_by_rows(model, acceleration)
    if mode == "decode" and process_settings and acceleration.levers:
        # Last, where this call changed the model: loading it, packing its weights and
        # loading its compiled step ran code that decoding does not run again.
        acceleration.library_pages = memory.release_library_pages(TORCH_LIBRARIES)
        if acceleration.library_pages:
            megabytes = acceleration.library_pages / (1 << 20)
            acceleration.levers.append(f"PyTorch's code pages handed back ({megabytes:.1f} MB)")
    if process_settings:
        acceleration._memory = memory.hold(memory.TRAIN if mode == "train" else memory.DECODE)
        if acceleration._memory is not None:
            acceleration.levers.append(f"malloc thresholds ({mode})")
    return acceleration


def _hand_back_library_products(model: nn.Module, acceleration: Acceleration) -> list[nn.Module]:
    """Hand back the pages of the weights the compiled steps hold (where the model has all of
    them: :func:`~aiayn.accel.compiled.library_products`), mapped from a file and read to
    name the libraries: every decode they serve reads the libraries' copies, packs or not.
    Return those products."""
    products = library_products(model)
    mappings = memory.file_mappings() if products else []
    weights = {id(m.weight): m.weight for m in products}
    for weight in weights.values():
        if isinstance(weight, torch.Tensor):
            acceleration.handed_back += memory.page_out(weight, mappings)
    return products


def _relu_in_products(model: nn.Module, acceleration: Acceleration) -> None:
    """The feed-forward layers whose first product goes through a oneDNN pack take their
    ReLU in it (:class:`~aiayn.accel.linear.ReluInProduct`)."""
    acceleration._swap(
        model,
        [PositionwiseFeedForward],
        "ReLU in the product",
        ReluInProduct,
        lambda m: m.activation is F.relu and isinstance(m.w1, CpuLinear) and m.w1.fully_packed(),
    )


def _tables_by_rows(model: nn.Module, acceleration: Acceleration) -> None:
    """Embedding tables mapped from a file (:func:`aiayn.inference.loading.load_model`) that
    no product reads whole (an unpacked tied projection would): the kernel is to read only the
    pages of the rows looked up, and the pages read so far (all of them: the compiled step's
    digest, the packs) are handed back, unless a oneDNN pack of the table (the tied
    projection's) had them handed back when it was made."""
    packed: set[int] = set()  # weights of oneDNN packs, handed back when packed
    products: set[int] = set()  # weights some product reads whole
    for m in model.modules():
        if isinstance(m, nn.Linear):
            onednn = isinstance(m, CpuLinear) and m.fully_packed()
            (packed if onednn else products).add(id(m.weight))
    mappings = memory.file_mappings()
    tables = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Embedding)}
    for key, table in tables.items():
        if key not in products and memory.read_by_rows(table, mappings):
            acceleration._tables.append(table)
            if key not in packed:
                acceleration.handed_back += memory.page_out(table, mappings)
    if acceleration.handed_back:
        megabytes = acceleration.handed_back / (1 << 20)
        acceleration.levers.append(
            f"mapped weights' pages handed back ({megabytes:.1f} MB advised)"
        )
