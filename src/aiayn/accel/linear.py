"""Linear layers for the CPU: weights packed once for inference, bfloat16 rows padded.

:class:`CpuLinear` is ``nn.Linear`` (the same parameters and state dict) with two levers
(figures: docs/performance.md):

- **Packed weights** (:func:`pack`). MKL's ``sgemm`` copies the weight into the blocked layout
  its kernels read at every call; a decoder step has one row per sentence or beam, and there
  that copy is a large part of each product. A pack makes the copy once. A float32 weight is
  packed for the library :func:`fp32_pack_library` names: MKL on an Intel CPU
  (``torch.ops.mkl._mkl_reorder_linear_weight``; products over :data:`MIN_PACKED_ROWS` to
  :data:`MAX_PACKED_ROWS` rows use it, ``_mkl_linear``), oneDNN on other x86 CPUs, where
  MKL's float32 products are the slower (they run one-row products on one thread, and do
  not split them between cores). A bfloat16 weight is always packed for oneDNN
  (``torch.ops.mkldnn._reorder_linear_weight``). oneDNN packs serve every row count. Packs
  serve inference only: not with autograd or autocast on, and
  never with a weight that changed since (another tensor or storage, a write through autograd's
  version counter, or any optimizer step; writes that bypass all three, such as ``weight.data``
  or NumPy views, are not noticed: pack again after them). A copied or pickled layer carries no
  pack. PyTorch's own ``_mkl_linear`` uses a pack only for the row count it was made for; here
  the actual row count is passed, which relies on MKL's packed layout not depending on it, so
  :func:`pack` checks every MKL pack against ``F.linear`` at several row counts and keeps only
  those that agree; a oneDNN pack, whose product takes any row count, is checked at the one it
  is made for (each row count multiplied leaves kernels in the process), so a pack wrong at
  other row counts only would not be caught on the user's CPU (the tests multiply packs at 1
  to 1,000 rows on theirs).
- **Padded bfloat16 rows.** oneDNN builds and keeps a kernel for every row count of a bfloat16
  product, and token batches bring a new row count nearly every update, so
  bfloat16 products on the CPU run over rows padded with zeros (:data:`BF16_ROW_MULTIPLE`;
  :func:`onednn_rows` for every oneDNN packed product, float32 too), cut off again after.
"""

from __future__ import annotations

import platform
import weakref
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from aiayn.accel import memory, panels
from aiayn.accel.cpu import cpu_vendor, private_ops_unverified

# Float32 products over this many rows use an MKL pack: a decoder step over 1 to 32 sentences
# with beam 4, or 4 to 128 greedily. Fewer and more rows are as fast or faster unpacked.
# oneDNN packs serve every row count.
MIN_PACKED_ROWS = 4
MAX_PACKED_ROWS = 128
# MKL and oneDNN choose their packed blocking for a row count: the decoder's typical one.
PACK_FOR_ROWS = 64
# bfloat16 products over more rows than this are padded to a multiple of it.
BF16_ROW_MULTIPLE = 64
_CHECK_ROWS = (MIN_PACKED_ROWS, 5, 13, 31, 63, PACK_FOR_ROWS, 65, 100, 127, MAX_PACKED_ROWS)
# A oneDNN pack is checked at the row count it is made for (tests/accel/test_linear_onednn.py
# multiplies packs at 1 to 1,000 rows). Every row count multiplied leaves kernels of its own in
# the process, so each row count checked costs memory for as long as the process lives.
_CHECK_ROWS_ONEDNN = (PACK_FOR_ROWS,)
# The panels' product at 64 rows: ten blocks of six rows and one of four.
_CHECK_ROWS_PANELS = (PACK_FOR_ROWS,)
_CHECK_COLUMNS = 64
FP32_LIBRARIES = ("mkl", "onednn", "panels")
# Above a packed projection's matrix, the mmap threshold a decode holds: room for malloc's
# own header and the allocator's alignment.
HEAP_MARGIN = 1 << 20


def packing_available() -> bool:
    """Whether this PyTorch has MKL and its packed-linear operators (float32), and is one
    they were verified with (:func:`~aiayn.accel.cpu.private_ops_unverified`)."""
    if not torch.backends.mkl.is_available() or private_ops_unverified() is not None:
        return False
    ops = torch.ops.mkl
    return hasattr(ops, "_mkl_reorder_linear_weight") and hasattr(ops, "_mkl_linear")


def onednn_packing_available() -> bool:
    """Whether this PyTorch has oneDNN and its packed-linear operators, and is one they were
    verified with (:func:`~aiayn.accel.cpu.private_ops_unverified`)."""
    if not torch.backends.mkldnn.is_available() or private_ops_unverified() is not None:
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def fp32_pack_library() -> str | None:
    """The library float32 weights are packed for: ``"onednn"`` on an x86 CPU whose vendor is
    known and not Intel (MKL's fast float32 kernels are Intel's; elsewhere oneDNN's one-row
    product is the faster at two threads, docs/performance.md), else ``"mkl"``; the
    other where only one is there; None where neither is. (Where it is oneDNN, a decode packs
    its step's products into :mod:`aiayn.accel.panels`' panels instead where that product is
    loaded: :func:`aiayn.accel.accelerate`.)"""
    mkl, onednn = packing_available(), onednn_packing_available()
    if onednn and (not mkl or onednn_for_float32()):
        return "onednn"
    return "mkl" if mkl else None


def onednn_for_float32() -> bool:
    """Whether float32 weights are oneDNN's to pack here, where both libraries are there: an
    x86 CPU whose vendor is known and not Intel (:func:`fp32_pack_library`)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return x86 and cpu_vendor() not in ("", "GenuineIntel")


# -- optimizer steps make every pack stale ---------------------------------------------------
#
# Fused Adam writes the weights without bumping their version counters, so a pack also
# remembers how many optimizer steps had run when it was made. The hook that counts them is
# registered while some acceleration holds packs (:func:`watch_optimizer_steps`).

_optimizer_steps = 0
_hook: RemovableHandle | None = None
_watchers = 0


def _count_step(*_: object) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def watch_optimizer_steps() -> None:
    """Count optimizer steps (a process-wide optimizer hook) until the matching
    :func:`unwatch_optimizer_steps`."""
    global _hook, _watchers
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_count_step)
    _watchers += 1


def unwatch_optimizer_steps() -> None:
    global _hook, _watchers
    _watchers = max(0, _watchers - 1)
    if _watchers == 0 and _hook is not None:
        _hook.remove()
        _hook = None


def optimizer_hook_registered() -> bool:
    """Whether the optimizer-step hook is in place (for tests and diagnostics)."""
    return _hook is not None


class Pack:
    """A packed copy of a weight, and what identifies the weight it was made from."""

    __slots__ = ("data_ptr", "dtype", "kind", "packed", "steps", "version", "weight_id")

    def __init__(self, packed: Tensor, weight: Tensor, kind: str) -> None:
        self.packed = packed
        self.kind = kind  # the library it is packed for: one of FP32_LIBRARIES
        self.dtype = weight.dtype  # the inputs it multiplies
        # id, not a weak reference: a weakly referenced tensor cannot be swapped in place
        # (torch.utils.swap_tensors).
        self.weight_id = id(weight)
        self.data_ptr = weight.data_ptr()
        self.version = weight._version
        self.steps = _optimizer_steps

    @property
    def whole(self) -> bool:
        """Whether the pack serves every row count (oneDNN's, the panels), not some only
        (MKL's)."""
        return self.kind != "mkl"

    def matches(self, weight: Tensor) -> bool:
        return (
            self.steps == _optimizer_steps
            and id(weight) == self.weight_id
            and weight._version == self.version
            and weight.data_ptr() == self.data_ptr
        )


def _onednn_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.no_grad()
def pack(layer: nn.Linear, fp32_library: str | None = None) -> Pack | None:
    """A checked pack of ``layer``'s weight (float32 for ``fp32_library``, by default
    :func:`fp32_pack_library`'s; bfloat16 for oneDNN), or None where it cannot be made or
    disagrees with ``F.linear``."""
    weight = layer.weight.detach()
    # An inference tensor has no version counter to tell whether it changed after packing.
    if weight.device.type != "cpu" or not weight.is_contiguous() or layer.weight.is_inference():
        return None
    if weight.dtype == torch.bfloat16:
        # Both round their float32 sums to bfloat16: a step of 2^-8 apart at most.
        return _onednn_pack(layer, tolerance=1e-2)
    if weight.dtype != torch.float32:
        return None
    library = fp32_library or fp32_pack_library()
    if library not in FP32_LIBRARIES:
        return None
    if library == "onednn":
        return _onednn_pack(layer, tolerance=1e-4)
    if library == "panels":
        return _panels_pack(layer)
    if not packing_available():
        return None
    generator = torch.Generator().manual_seed(0)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_FOR_ROWS)
    for rows in _CHECK_ROWS:
        x = torch.randn(rows, weight.size(1), generator=generator)
        got = torch.ops.mkl._mkl_linear(x, packed, weight, layer.bias, rows)
        want = F.linear(x, weight, layer.bias)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            return None
    return Pack(packed, layer.weight, "mkl")


def _onednn_pack(layer: nn.Linear, tolerance: float) -> Pack | None:
    """A pack of ``layer``'s weight for oneDNN (its own dtype), checked against ``F.linear``
    at :data:`_CHECK_ROWS_ONEDNN` rows to ``tolerance`` (:func:`_agrees_on_columns`)."""
    if not onednn_packing_available():
        return None
    weight = layer.weight.detach()
    try:  # a CPU without the instructions oneDNN's bfloat16 kernels need refuses here
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        product = partial(_onednn_linear, packed=packed, bias=layer.bias)
        if not _agrees_on_columns(layer, product, _CHECK_ROWS_ONEDNN, tolerance):
            return None
    except RuntimeError:
        return None
    return Pack(packed, layer.weight, "onednn")


def _panels_pack(layer: nn.Linear) -> Pack | None:
    """A pack of ``layer``'s float32 weight into :mod:`aiayn.accel.panels`' panels, checked
    as :func:`_onednn_pack` checks its packs (float32 rounding)."""
    if not panels.loaded():
        return None
    packed = panels.pack(layer.weight.detach())
    bias = None if layer.bias is None else layer.bias.detach()
    product = partial(panels.linear, panels=packed, out_features=layer.out_features, bias=bias)
    if not _agrees_on_columns(layer, product, _CHECK_ROWS_PANELS, 1e-4):
        return None
    return Pack(packed, layer.weight, "panels")


def _agrees_on_columns(
    layer: nn.Linear, product: Callable[[Tensor], Tensor], rows: Sequence[int], tolerance: float
) -> bool:
    """Whether ``product`` (x → x W^T + b through a pack) agrees with ``F.linear`` at each
    row count in ``rows`` to ``tolerance`` (relative, and of the largest output), on
    :data:`_CHECK_COLUMNS` output columns drawn at random and the last 16: the reference
    product of the whole weight would leave MKL's buffers for it in the process (as large as
    the weight), and a pack in the wrong layout is wrong in nearly every column."""
    weight = layer.weight.detach()
    generator = torch.Generator().manual_seed(0)
    drawn = torch.randperm(weight.size(0), generator=generator)[:_CHECK_COLUMNS]
    columns = torch.cat([drawn, torch.arange(weight.size(0))[-16:]]).unique()
    bias = None if layer.bias is None else layer.bias.detach()[columns]
    for n in rows:
        x = torch.randn(n, weight.size(1), generator=generator).to(weight.dtype)
        got = product(x).float()[:, columns]
        want = F.linear(x, weight[columns], bias).float()
        limit = tolerance * float(want.abs().max())
        if not torch.allclose(got, want, rtol=tolerance, atol=limit):
            return False
    return True


# -- rows -------------------------------------------------------------------------------------


def round_up(rows: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``rows``."""
    return -(-rows // multiple) * multiple


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN packed product over ``rows`` rows runs at: up to 16 rows,
    ``rows`` (padding would cost one-sentence steps more than it saves); up to 64, the next
    multiple of 16; above, of 64. A decode then meets a few dozen row counts, not hundreds."""
    if rows <= 16:
        return rows
    return round_up(rows, 16 if rows <= BF16_ROW_MULTIPLE else BF16_ROW_MULTIPLE)


def rows_of(x: Tensor) -> int:
    """The number of rows of x (..., width) as a product sees them."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def on_padded_rows(fn: Callable[[Tensor], Tensor], x: Tensor, padded: int) -> Tensor:
    """``fn(x)`` for a row-wise ``fn``, run over x's rows padded with zeros to ``padded``;
    the padding rows are cut off again (autograd sees them get no gradient)."""
    rows = rows_of(x)
    if padded == rows:
        return fn(x)
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))
    return fn(flat)[:rows].view(*x.shape[:-1], -1)


def bf16_padded_rows(x: Tensor, weight: Tensor) -> int | None:
    """The row count to pad ``x`` to for a bfloat16 product with ``weight`` on the CPU (under
    bfloat16 autocast, or on bfloat16 inputs), or None to leave it as it is."""
    # The cheapest test first: float32 outside autocast ends here.
    autocast = torch.is_autocast_enabled("cpu")
    if not autocast and x.dtype is not torch.bfloat16:
        return None
    if autocast and torch.get_autocast_dtype("cpu") is not torch.bfloat16:
        return None
    if x.device.type != "cpu" or x.dim() < 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    rows = rows_of(x)
    padded = round_up(rows, BF16_ROW_MULTIPLE)
    return padded if padded != rows and rows > BF16_ROW_MULTIPLE else None


class CpuLinear(nn.Linear):
    """``nn.Linear`` with the CPU levers of this module: the products through :attr:`pack`
    where it serves, and bfloat16 products over padded rows. Built by swapping the class of
    an ``nn.Linear`` (:func:`aiayn.accel.accelerate`), so it has the very same parameters."""

    pack: Pack | None = None
    pad_bf16_rows = False  # set where bfloat16 products run (train.precision=bf16, decoding)

    def forward(self, x: Tensor) -> Tensor:
        if self.pack is not None:
            out = self.packed_product(x)
            if out is not None:
                return out
        if self.pad_bf16_rows:
            padded = bf16_padded_rows(x, self.weight)
            if padded is not None:
                return on_padded_rows(super().forward, x, padded)
        return F.linear(x, self.weight, self.bias)

    def pack_serves(self) -> bool:
        """Whether the layer has a pack of its current weight."""
        return self.pack is not None and self.pack.matches(self.weight)

    def serving_pack(self, x: Tensor) -> Pack | None:
        """:attr:`pack` where it serves the product of ``x``, else None."""
        pack = self.pack
        if pack is None or not x.dim():
            return None
        width = x.shape[-1]
        if width != self.in_features or torch.is_grad_enabled():
            return None
        rows = rows_of(x)
        if pack.whole:
            if x.dtype is not pack.dtype or x.dim() < 2 or not rows:
                return None
        elif (
            x.dtype is not torch.float32
            or not MIN_PACKED_ROWS <= rows <= MAX_PACKED_ROWS
            or not x.is_contiguous()
        ):
            return None
        weight = self._parameters["weight"]  # one lookup, not nn.Module.__getattr__'s
        # autocast: the packed product would skip it
        if torch.is_autocast_enabled("cpu") or weight is None or not pack.matches(weight):
            return None
        return pack

    def packed_product(self, x: Tensor) -> Tensor | None:
        """The product through :attr:`pack`, or None where the pack does not serve ``x``
        (:meth:`serving_pack`)."""
        pack = self.serving_pack(x)
        return None if pack is None else self.product_through(pack, x)

    def product_through(self, pack: Pack, x: Tensor) -> Tensor:
        """The product of ``x`` through ``pack``, one :meth:`serving_pack` has returned."""
        parameters = self._parameters
        weight, bias = parameters["weight"], parameters["bias"]
        rows = rows_of(x)
        if pack.kind == "panels":
            return panels.linear(x, pack.packed, self.out_features, bias)
        if pack.kind == "onednn":
            product = partial(_onednn_linear, packed=pack.packed, bias=bias)
            return on_padded_rows(product, x, onednn_rows(rows))
        return torch.ops.mkl._mkl_linear(x, pack.packed, weight, bias, rows)

    def __getstate__(self) -> dict[str, object]:
        # A copied or pickled layer multiplies without a pack (packed buffers stay put).
        state: dict[str, object] = super().__getstate__()
        state.pop("pack", None)
        return state


class LogitsBuffer:
    """For a decode's cache: one float32 (rows, V) buffer that its steps' logits are written
    into (:func:`logits_into`) and their log-softmax taken in place, so that no step allocates
    a vocabulary-sized matrix (figures: docs/performance.md). The result of a step is valid
    until the next step on the cache, which is how search uses it.

    A packed product writes a matrix of its own at every step. Where that matrix is above
    malloc's mmap threshold in force, the cache holds that threshold above it while the
    cache lives (:meth:`keep_in_heap`): each step's matrix then comes from the heap, reused,
    instead of being mapped afresh and faulted in page by page (figures:
    docs/performance.md)."""

    _logits: Tensor | None = None
    _heap_hold: tuple[int, int | None] | None = None  # (bytes, memory.hold's token)

    def rows_buffer(self, rows: int, width: int, device: torch.device) -> Tensor:
        """The first ``rows`` rows of the (rows, ``width``) float32 buffer, made at the first
        step's row count (a decode's rows only become fewer)."""
        buffer = self._logits
        if buffer is None or buffer.size(1) != width or buffer.size(0) < rows:
            buffer = torch.empty(rows, width, dtype=torch.float32, device=device)
            self._logits = buffer
        return buffer[:rows]

    def keep_in_heap(self, nbytes: int) -> None:
        """Have blocks of ``nbytes`` served from malloc's heap while this cache lives: the
        mmap threshold held above them and the trim threshold above two of them, where an
        acceleration already holds the thresholds
        raised (:mod:`aiayn.accel.memory`). Held also where another hold covers them now: that
        one may end first. Nothing where malloc is left alone."""
        held = self._heap_hold
        if held is not None and held[0] >= nbytes:
            return
        in_force = memory.in_force()
        if in_force is None:
            return
        # The trim threshold too: freed, the block lies at the top of the heap, which malloc
        # hands back to the kernel above that threshold, and the next step's is faulted in
        # afresh (BASE beam 4 over 64 sentences: 274,000 page faults a batch, 56,000 with).
        block = nbytes + HEAP_MARGIN
        token = memory.hold((block, max(in_force[1], 2 * block)))
        if held is not None:
            memory.release(held[1])
        self._heap_hold = (nbytes, token)
        if token is not None:
            weakref.finalize(self, memory.release, token)


def logits_into(out_proj: nn.Module, hidden: Tensor, owner: LogitsBuffer) -> Tensor | None:
    """A decoder step's pre-softmax projection of ``hidden`` (rows, d_model): a float32
    product written into ``owner``'s buffer; a pack's own product where one serves; the
    module's output in its dtype otherwise. None where ``out_proj`` is no plain linear layer
    without bias and hooks (int8, a final-logits bias) or autocast is on (which ``mm(out=)``
    would skip): the caller's own step."""
    if (
        torch.is_autocast_enabled(hidden.device.type)
        or type(out_proj) not in (nn.Linear, CpuLinear)  # int8: its own module
        or out_proj.bias is not None
        or out_proj._forward_hooks
        or out_proj._forward_pre_hooks
    ):
        return None
    pack = out_proj.serving_pack(hidden) if isinstance(out_proj, CpuLinear) else None
    if pack is not None:
        rows = rows_of(hidden)
        made = onednn_rows(rows) if pack.kind == "onednn" else rows  # the rows it writes
        owner.keep_in_heap(made * out_proj.out_features * hidden.element_size())
        return out_proj.product_through(pack, hidden)
    weight = out_proj.weight
    if hidden.dtype == weight.dtype == torch.float32:
        buffer = owner.rows_buffer(hidden.size(0), weight.size(0), hidden.device)
        return torch.mm(hidden, weight.t(), out=buffer)
    return out_proj(hidden)
