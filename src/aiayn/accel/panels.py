"""aiayn's own float32 product for decoding on x86 CPUs with AVX2 and without AVX-512.

On such a CPU (an AMD EPYC of the Zen 3 generation, for one) PyTorch's float32 products
reach oneDNN's ``brg_matmul`` kernels, which at a decoder step's shapes (64 rows × 256 by
256 × 8,000, say) run well below the core's rate; MKL's are slower still there. The product
in ``csrc/panel_gemm.cpp`` packs a weight once into panels of 16 output columns and multiplies
blocks of 6 rows by a panel with 12 accumulators held in registers (the layout of the
classic AVX2 kernels); bias and ReLU are applied as the result is written. The same file holds
three more kernels for decoding: the steps' log-softmax in place (:func:`log_softmax_`), greedy
search's choice of token (``aiayn_panels::first_argmax``, registered for search with
:func:`aiayn.native.register_first_argmax` once the file is loaded) and attention
(:func:`attend`): the encoder's, through :class:`aiayn.accel.attention.PanelAttention`, and
the compiled decoder step's, called out of its library
(:class:`aiayn.accel.compiled.OneQueryAttention`). Over 16 rows or more, each kernel hands its
work out in chunks, each thread taking the next when done with one, so that a core slowed for
a while by a busy host does less of it; the results do not depend on who took what.
Figures: docs/performance.md.

It is native code built on the machine (g++, PyTorch's headers), like the compiled decoder
step and at the same moment (:func:`aiayn.accel.use_compiled_step`: ``translate
--compiled-step``), into the same cache directory, named after a digest of its source,
PyTorch's version and the compiler's flags (:func:`library_path`), and only loaded from a
file and directory that are the user's alone. Once loaded into a process, float32 weights that
decoding would pack for oneDNN are packed into panels instead (:func:`aiayn.accel.linear.pack`),
where the CPU has AVX2 and FMA and no AVX-512 (:func:`cpu_suits`). On CPUs with AVX-512
oneDNN's own kernels are AVX-512 ones: measured against them on an AMD EPYC (Zen 4), this
file's kernels took a SMALL decode's time down and a BASE batch's up (docs/performance.md,
Limits), so they are not used there.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn import native as native_kernels
from aiayn.accel.cpu import cpu_flags
from aiayn.accel.store import compiled_dir, require_trusted
from aiayn.model.feedforward import PositionwiseFeedForward

SOURCE = Path(__file__).parent / "csrc" / "panel_gemm.cpp"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-w")
# The product's panels are this many columns wide (csrc/panel_gemm.cpp's NR).
PANEL = 16

_loaded: Path | None = None


@cache
def cpu_suits() -> bool:
    """Whether this CPU is one the product is for: x86-64 with AVX2 and FMA, without AVX-512
    (PyTorch's kernels for it are AVX2's: ``torch.backends.cpu.get_cpu_capability``)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    return {"avx2", "fma"} <= cpu_flags() and not any(f.startswith("avx512") for f in cpu_flags())


def compiler() -> str | None:
    """The C++ compiler found here (``g++``, else ``c++``), or None."""
    return shutil.which("g++") or shutil.which("c++")


def _command(compiler: str, output: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch.compiled_with_cxx11_abi())
    command = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    for folder in cpp_extension.include_paths():
        command += ["-I", folder]
    command += [str(SOURCE), "-o", str(output)]
    for folder in cpp_extension.library_paths():
        command += ["-L", folder, f"-Wl,-rpath,{folder}"]
    return [*command, "-lc10", "-ltorch_cpu"]


def library_path(directory: Path | None = None) -> Path:
    """Where the built product is kept: the compiled steps' directory, named after a digest
    of its source, PyTorch's version and the flags it is built with."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update("\n".join([torch.__version__, *FLAGS]).encode())
    return (directory or compiled_dir()) / f"panel-gemm-{digest.hexdigest()[:32]}.so"


def loaded() -> bool:
    """Whether the product is loaded into this process (:func:`load`)."""
    return _loaded is not None


def loaded_name() -> str | None:
    """The file name of the product loaded into this process (a digest of what it is built
    from), or None."""
    return None if _loaded is None else _loaded.name


def load(directory: Path | None = None, build: bool = False) -> bool:
    """Load the product into this process where the CPU suits it (:func:`cpu_suits`): from
    the cache directory where it was built before, or (``build``) built there now. Return
    whether it is loaded. Raises ``PermissionError`` for a file that this user does not alone
    own, and ``RuntimeError`` (the compiler's first lines) for a build that fails."""
    global _loaded
    if _loaded is not None:
        return True
    if not cpu_suits():
        return False
    path = library_path(directory)
    if not path.is_file():
        if not build:
            return False
        _build(path)
    require_trusted(path)
    if not _registered():  # the operators of a copy loaded before serve (one set a process)
        torch.ops.load_library(str(path))
        # What the product's output is without running it: for torch.export, which traces
        # the compiled decoder step through it.
        torch.library.register_fake("aiayn_panels::linear")(_linear_shape)
        torch.library.register_fake("aiayn_panels::attend")(_attend_shape)
    native_kernels.register_first_argmax(torch.ops.aiayn_panels.first_argmax)
    _loaded = path
    return True


def _linear_shape(
    x: Tensor, panels: Tensor, out_features: int, bias: Tensor | None, relu: bool
) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _attend_shape(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    batch, heads, queries, _ = q.shape
    return q.new_empty((batch, queries, heads, v.shape[-1])).transpose(1, 2)


def _registered() -> bool:
    return hasattr(torch.ops.aiayn_panels, "linear")


def _build(path: Path) -> None:
    found = compiler()
    if found is None:
        raise RuntimeError("no C++ compiler here (apt-get install g++)")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=path.stem + ".", dir=path.parent))
    try:
        built = work / path.name
        done = subprocess.run(_command(found, built), capture_output=True, text=True)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(f"building {SOURCE.name} failed: {' '.join(lines[:3])[:300]}")
        os.chmod(built, 0o700)
        os.replace(built, path)  # atomically: another process sees all of it or nothing
    finally:
        shutil.rmtree(work, ignore_errors=True)


def log_softmax_(logits: Tensor) -> Tensor:
    """``torch.log_softmax(logits, -1, out=logits)``: by the product's file where it is loaded
    (vectorised, faster than PyTorch's at a step's shapes: docs/performance.md), for a
    float32 CPU matrix with contiguous rows; else PyTorch's. The values agree to float32
    rounding (another exp, other sums)."""
    if (
        _loaded is not None
        and logits.dim() == 2
        and logits.dtype is torch.float32
        and logits.device.type == "cpu"
        and logits.stride(1) == 1
        and not logits.requires_grad
    ):
        return torch.ops.aiayn_panels.log_softmax_(logits)
    return torch.log_softmax(logits, dim=-1, out=logits)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """``softmax(q·kᵀ·scale + mask)·v`` for float32 q (B, H, T, Dk), k (B, H, S, Dk) and v
    (B, H, S, Dv), each of any strides with a contiguous last dimension; ``mask`` broadcast to
    (B, H, T, S), boolean (True: attend) or additive. k and v may also be (B, H, P, G, D):
    S = P × G keys, key ``p * G + g`` at (p, g), as a beam cache kept positions first has
    them, read in place. One task per (b, h); a position masked out weighs exactly 0, and
    neither its key nor its value enters the result; a query with nothing to attend gives NaN.
    Up to eight queries a (b, h) (decoding's steps) each read only the keys they attend; more
    (the encoder's) share the keys, copied transposed, four queries at a time. Out
    (B, H, T, Dv), a view of (B, T, H, Dv)."""
    return torch.ops.aiayn_panels.attend(q, k, v, mask, scale)


def pack(weight: Tensor) -> Tensor:
    """``weight`` (out, in) float32 as the product's panels (out / 16 rounded up, in, 16)."""
    return torch.ops.aiayn_panels.pack(weight)


def linear(
    x: Tensor, panels: Tensor, out_features: int, bias: Tensor | None, relu: bool = False
) -> Tensor:
    """``F.linear(x, weight, bias)`` (then ReLU, with ``relu``) through ``pack(weight)``,
    for float32 ``x`` of any leading shape."""
    return torch.ops.aiayn_panels.linear(x, panels, out_features, bias, relu)


class PanelLinear(nn.Linear):
    """An ``nn.Linear`` whose product is the panels' operator over :attr:`panels`, a buffer
    packed from its weight (:func:`to_panels`): the compiled decoder step's products, in the
    copy of the model the step is compiled from, where the product is loaded."""

    panels: Tensor

    def forward(self, x: Tensor) -> Tensor:
        return self.packed_product(x)

    def packed_product(self, x: Tensor, relu: bool = False) -> Tensor:
        """The product (and its ReLU, with ``relu``, applied as it writes)."""
        return linear(x, self.panels, self.out_features, self.bias, relu)


class PanelFeedForward(PositionwiseFeedForward):
    """A :class:`~aiayn.model.feedforward.PositionwiseFeedForward` of :class:`PanelLinear`
    products, in the compiled step's copy of the model, whose ReLU the first product applies
    as it writes: the same values without a pass over the (rows, d_ff) activations, but for a
    NaN of the product, which becomes 0 (the layer's output row is still NaN where its input
    row has one, through the residual connection)."""

    w1: PanelLinear

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.dropout(self.w1.packed_product(x, relu=True)))

    @classmethod
    def of(cls, ffn: nn.Module) -> PanelFeedForward | None:
        """The layer of ``ffn``'s own products and dropout, where ``ffn`` is a plain
        feed-forward layer with a ReLU whose first product is a :class:`PanelLinear`; else
        None."""
        if type(ffn) is not PositionwiseFeedForward or ffn.activation is not F.relu:
            return None
        if not isinstance(ffn.w1, PanelLinear):
            return None
        new = cls(ffn.w1.in_features, ffn.w1.out_features)
        new.w1, new.w2, new.dropout, new.activation = ffn.w1, ffn.w2, ffn.dropout, ffn.activation
        return new


def to_panels(layer: nn.Linear) -> PanelLinear:
    """A :class:`PanelLinear` of ``layer``'s (float32) own weight and bias."""
    new = PanelLinear(layer.in_features, layer.out_features, layer.bias is not None, "meta")
    new.weight, new.bias = layer.weight, layer.bias
    new.register_buffer("panels", pack(layer.weight.detach()))
    return new
