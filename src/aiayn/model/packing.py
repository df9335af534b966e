"""Pre-packed weight matrices for CPU inference: MKL's packed GEMM for float32 weights on few
rows, oneDNN's packed bfloat16 products at every row count.

At every call, MKL's ``sgemm`` first copies the weight matrix into the blocked layout its
kernels read. With many rows that copy is amortised; a decoder step has one row per sentence
(or beam), and there the copy is a large part of each product. :func:`pack_for_inference`
makes that copy once per ``nn.Linear`` (``torch.ops.mkl._mkl_reorder_linear_weight``); the
model's linear layers then call :func:`linear`, which multiplies with the packed copy
(``torch.ops.mkl._mkl_linear``) when all of these hold, and calls the module as usual
otherwise:

- autograd and CPU autocast are off (inference), and the input has :data:`MIN_PACKED_ROWS` to
  :data:`MAX_PACKED_ROWS` rows: fewer and more rows are as fast or faster without packing;
- the weight is still the one that was packed: :func:`refresh` (called by ``Transformer.encode``,
  ``decode`` and ``init_cache``) drops a copy whose weight is another tensor or storage or was
  changed in place through autograd's version counter (``load_state_dict``, ``.to()``,
  ``copy_``), and any optimizer step drops every packed copy (fused Adam does not bump the
  version counter). Writes that bypass both (``weight.data`` or NumPy views) are not noticed:
  call :func:`unpack` after them;
- the input is a contiguous float32 CPU tensor of the layer's width, and the layer has no
  forward hooks.

PyTorch's own ``_mkl_linear`` uses a packed matrix only for the row count it was packed for;
here the actual row count is passed instead, which relies on MKL's packed layout of the weight
operand not depending on the other operand's row count (CTranslate2 packs its weights the
same way). MKL does not document this, so :func:`pack_for_inference` checks every packed
matrix against ``F.linear`` at ten row counts from 4 to 128 and keeps only those that agree.
Memory: MKL reserves at least ~7.6 MB of address space per packed matrix and more than the
weight's size; measured resident memory grows by 1.25-1.8x the packed weights (the SMALL
benchmark model, 29 MB of weights: +44-52 MB; BASE, 241 MB: +302 MB). Packed copies are held in
a table keyed by module, not in the module: ``state_dict``, ``copy.deepcopy`` and pickling
never see them (MKL's packed buffers must not move in memory), and a copied model simply
multiplies without them.

A bfloat16 ``nn.Linear`` (a model decoding with ``precision="bf16"``) is packed for oneDNN
instead (``torch.ops.mkldnn._reorder_linear_weight``, multiplied by
``torch.ops.mkldnn._linear_pointwise``). On a CPU with AMX that is faster than the plain
bfloat16 product at every row count measured, 1 to 1,536 (1.5-2.4x up to 64 rows, level at
1,536: docs/performance.md), so it is used for any bfloat16 input under the same conditions
(inference, unchanged weight, no hooks; contiguity is not needed). oneDNN builds and keeps a
kernel for every row count it meets, so the rows are padded (:func:`onednn_rows`). Packing
checks the product against ``F.linear`` at seven row counts, to bfloat16's rounding.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

# Products over MIN_PACKED_ROWS to MAX_PACKED_ROWS rows use the packed copy: a decoder step
# over 1 to 32 sentences with beam 4, or 4 to 128 sentences greedily. Measured with 2 threads
# (docs/performance.md): at 2-3 rows the plain product is faster (the packed call has a few
# microseconds more overhead); from 4 rows MKL's plain product takes another, slower path (the
# (256, 8,000) projection: 151 us at 3 rows, 299 at 4; packed 166), and packed stays 8-60%
# faster up to 64 rows; at 128 rows 1-8%; level or slower from 256 rows.
MIN_PACKED_ROWS = 4
MAX_PACKED_ROWS = 128
# MKL chooses its packed blocking for a row count; the decoder's typical one.
PACK_FOR_ROWS = 64
_CHECK_ROWS = (MIN_PACKED_ROWS, 5, 13, 31, 63, PACK_FOR_ROWS, 65, 100, 127, MAX_PACKED_ROWS)
_CHECK_ROWS_BF16 = (1, 3, 4, 31, PACK_FOR_ROWS, 65, 200)


class _Packed:
    __slots__ = ("data_ptr", "onednn", "packed", "version", "weight_id")

    def __init__(self, packed: Tensor, weight: Tensor, onednn: bool = False) -> None:
        self.packed = packed
        self.onednn = onednn  # a bfloat16 weight packed for oneDNN, not a float32 one for MKL
        # id, not a weak reference: a weakly referenced tensor cannot be swapped in place
        # (torch.utils.swap_tensors); the storage pointer and version make the check.
        self.weight_id = id(weight)
        self.data_ptr = weight.data_ptr()
        self.version = weight._version

    def matches(self, weight: Tensor) -> bool:
        return (
            id(weight) == self.weight_id
            and weight.data_ptr() == self.data_ptr
            and weight._version == self.version
        )


_PACKED: weakref.WeakKeyDictionary[nn.Module, _Packed] = weakref.WeakKeyDictionary()
_hook: RemovableHandle | None = None


def _drop_all_after_step(*_: object) -> None:
    _PACKED.clear()


def packing_available() -> bool:
    """Whether this PyTorch has MKL and the packed-linear operators."""
    if not torch.backends.mkl.is_available():
        return False
    ops = torch.ops.mkl
    return hasattr(ops, "_mkl_reorder_linear_weight") and hasattr(ops, "_mkl_linear")


def onednn_packing_available() -> bool:
    """Whether this PyTorch has oneDNN and its packed-linear operators (for bfloat16)."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def _packable(module: nn.Module) -> bool:
    if type(module) is not nn.Linear:  # e.g. int8 dynamic quantization's own modules
        return False
    weight = module.weight
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype == torch.float32:
        return packing_available()
    return weight.dtype == torch.bfloat16 and onednn_packing_available()


def _onednn_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def onednn_rows(rows: int) -> int:
    """The row count a bfloat16 product over ``rows`` rows runs at: up to 16 rows, ``rows``
    (padding would cost one-sentence steps more than it saves); up to 64, the next multiple
    of 16; above, of 64. oneDNN builds (and keeps) a kernel for every row count it meets,
    ~1 ms each, and a decode meets hundreds (its batches and the shrinking row counts as
    sentences finish); padded, a few dozen."""
    if rows <= 16:
        return rows
    return round_up(rows, 16 if rows <= BF16_ROW_MULTIPLE else BF16_ROW_MULTIPLE)


def round_up(rows: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``rows``."""
    return -(-rows // multiple) * multiple


def _rows(x: Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _on_padded_rows(fn: Callable[[Tensor], Tensor], x: Tensor, padded: int) -> Tensor:
    """``fn(x)`` for a row-wise ``fn``, run over x's rows padded with zeros to ``padded``;
    the padding rows are cut off again (autograd sees them get no gradient)."""
    rows = _rows(x)
    if padded == rows:
        return fn(x)
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))
    return fn(flat)[:rows].view(*x.shape[:-1], -1)


@torch.no_grad()
def _pack(module: nn.Linear) -> _Packed | None:
    weight = module.weight.detach()
    # An inference tensor has no version counter to tell whether it changed after packing.
    if not weight.is_contiguous() or module.weight.is_inference():
        return None
    generator = torch.Generator().manual_seed(0)
    if weight.dtype == torch.bfloat16:
        try:  # a CPU without the instructions oneDNN's bfloat16 kernels need refuses here
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
            for rows in _CHECK_ROWS_BF16:
                x = torch.randn(rows, weight.size(1), generator=generator).bfloat16()
                got = _onednn_linear(x, packed, module.bias).float()
                want = F.linear(x, weight, module.bias).float()
                # Both round their float32 sums to bfloat16: a step of 2^-8 apart at most.
                if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max())):
                    return None
        except RuntimeError:
            return None
        return _Packed(packed, module.weight, onednn=True)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_FOR_ROWS)
    for rows in _CHECK_ROWS:
        x = torch.randn(rows, weight.size(1), generator=generator)
        got = torch.ops.mkl._mkl_linear(x, packed, weight, module.bias, rows)
        want = F.linear(x, weight, module.bias)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            return None
    return _Packed(packed, module.weight)


def pack_for_inference(model: nn.Module) -> int:
    """Packs the weight of every float32 CPU ``nn.Linear`` in ``model`` for MKL and of every
    bfloat16 one for oneDNN, for :func:`linear`; returns how many were packed (0 where the
    packed operators are missing).

    The packed copies take more memory than the weights (see the module docstring), for as
    long as the model lives or until :func:`unpack`. Call it once the weights are final."""
    global _hook
    if _hook is None:  # any optimizer step makes packed copies stale
        _hook = register_optimizer_step_post_hook(_drop_all_after_step)
    count = 0
    for module in model.modules():
        if _packable(module):
            assert isinstance(module, nn.Linear)
            packed = _pack(module)
            if packed is not None:
                _PACKED[module] = packed
                count += 1
    return count


def unpack(model: nn.Module) -> None:
    """Drops the packed copies of ``model``'s linear layers."""
    for module in model.modules():
        _PACKED.pop(module, None)


def is_packed(module: nn.Module) -> bool:
    """Whether ``module`` has a packed copy that still matches its weight."""
    packed = _PACKED.get(module)
    return packed is not None and isinstance(module, nn.Linear) and packed.matches(module.weight)


def refresh() -> None:
    """Drops every packed copy whose weight changed since packing (another tensor or storage,
    or modified in place). ``Transformer.encode``, ``decode`` and ``init_cache`` call it, so a
    decode never multiplies with a stale copy; :func:`linear` itself does not check (a
    microsecond per call, ~20 calls per decoder step)."""
    for module, packed in list(_PACKED.items()):
        if not (isinstance(module, nn.Linear) and packed.matches(module.weight)):
            _PACKED.pop(module, None)


def _usable(module: nn.Module, x: Tensor) -> _Packed | None:
    if not _PACKED:  # training ends here: an optimizer step drops every packed copy
        return None
    packed = _PACKED.get(module)
    if packed is None or not x.dim():
        return None
    width = x.shape[-1]
    if packed.onednn:  # bfloat16: packed is faster at every row count
        if x.dtype is not torch.bfloat16:
            return None
    elif (
        x.dtype is not torch.float32
        or not width
        or not MIN_PACKED_ROWS <= x.numel() // width <= MAX_PACKED_ROWS
        or not x.is_contiguous()
    ):
        return None
    if (
        torch.is_grad_enabled()
        or not isinstance(module, nn.Linear)
        or width != module.in_features
        or torch.is_autocast_enabled("cpu")  # the packed product would skip autocast
        or module._forward_hooks
        or module._forward_pre_hooks
    ):
        return None
    return packed


def uses_packed(module: nn.Module, x: Tensor) -> bool:
    """Whether :func:`linear` would multiply ``x`` with ``module``'s packed copy."""
    return _usable(module, x) is not None


def packed_product(module: nn.Module, x: Tensor) -> Tensor | None:
    """``module(x)`` through the packed copy of its weight, or None where :func:`linear` would
    call the module itself."""
    packed = _usable(module, x)
    if packed is None:
        return None
    assert isinstance(module, nn.Linear)
    if packed.onednn:
        product = partial(_onednn_linear, packed=packed.packed, bias=module.bias)
        return _on_padded_rows(product, x, onednn_rows(_rows(x)))
    rows = x.numel() // x.shape[-1]
    return torch.ops.mkl._mkl_linear(x, packed.packed, module.weight, module.bias, rows)


# bfloat16 on the CPU (autocast, train.precision=bf16): oneDNN compiles a kernel for every
# new row count of a product (~2 ms per product and direction, measured: a 256 -> 1,024
# layer's forward + backward takes 8.9 ms at a row count seen for the first time, 2.7 ms
# after), and token batches bring a new row count nearly every update. Row counts above this
# are padded with zeros up to a multiple of it, so that a run sees a few dozen row counts
# (at most this many below it). The packed bfloat16 products of decoding pad the same way
# above it and to a multiple of 16 from 17 rows (:func:`onednn_rows`).
BF16_ROW_MULTIPLE = 64


def _bf16_rows_padded(module: nn.Module, x: Tensor) -> int | None:
    """The row count to pad ``x`` to for a bfloat16 product on the CPU, or None."""
    # The cheapest test first: float32 outside autocast (training in fp32, decoding) ends here.
    autocast = torch.is_autocast_enabled("cpu")
    if not autocast and x.dtype is not torch.bfloat16:
        return None
    if autocast and torch.get_autocast_dtype("cpu") is not torch.bfloat16:
        return None
    if x.device.type != "cpu" or x.dim() < 2 or type(module) is not nn.Linear:
        return None
    if module.weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    rows = _rows(x)
    padded = round_up(rows, BF16_ROW_MULTIPLE)
    return padded if padded != rows and rows > BF16_ROW_MULTIPLE else None


def linear(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)``, through the packed copy of its weight where there is one and it serves
    (float32: ``MIN_PACKED_ROWS`` to ``MAX_PACKED_ROWS`` rows; bfloat16: any, padded by
    :func:`onednn_rows`; see the module docstring); otherwise, in bfloat16 on the CPU, more
    than :data:`BF16_ROW_MULTIPLE` rows are padded to a multiple of it."""
    out = packed_product(module, x)
    if out is not None:
        return out
    padded = _bf16_rows_padded(module, x)
    return module(x) if padded is None else _on_padded_rows(module, x, padded)
