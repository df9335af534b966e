"""The levers of :func:`aiayn.accel.accelerate`, listed once.

Each :class:`Lever` says in which mode it applies, when, what it swaps and how
:meth:`~aiayn.accel.Acceleration.undo` puts it back. :data:`LEVERS` is the list
``accelerate`` draws on: it reports a lever by its :attr:`~Lever.name` in
``Acceleration.levers`` (its counts in ``Acceleration.details``), and
``accelerate(..., disable={name, ...})`` leaves any of them out, to measure what it gives
(``make bench-levers`` writes the table of each lever on and off:
``benchmarks/results/levers-<host>.md``; docs/performance.md shows both). The levers marked
``process`` change the process, not the model: only with ``process_settings=True``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Lever:
    """One lever: ``name`` as ``Acceleration.levers`` reports it; ``mode``: ``"train"``,
    ``"decode"`` or both; ``applies``: when; ``swaps``: what changes; ``undone``: how
    :meth:`~aiayn.accel.Acceleration.undo` puts it back; ``process``: process-wide (only with
    ``process_settings=True``); ``needs``: levers without which it does not apply."""

    name: str
    mode: str
    applies: str
    swaps: str
    undone: str
    process: bool = False
    needs: tuple[str, ...] = ()


_CLASS_BACK = "the plain class given back"

LEVERS: tuple[Lever, ...] = (
    Lever(
        "grid dropout",
        "train, decode",
        "always (in decoding a cheaper identity)",
        "nn.Dropout → GridDropout, Residual → GridResidual (one random draw per four elements)",
        _CLASS_BACK,
    ),
    Lever(
        "fused projection + loss",
        "train",
        "always",
        "the Trainer takes accel.loss.projected_label_smoothed_nll: no (N, V) logits",
        "Acceleration.fused_loss cleared",
    ),
    Lever(
        "one buffer per decode",
        "decode",
        "always",
        "Transformer → BufferedDecoding (the decode's caches in one buffer)",
        _CLASS_BACK,
    ),
    Lever(
        "beam steps attended by products",
        "decode",
        "x86 CPUs other than Intel's (oneDNN packs float32); 32+ (sentence, head) pairs, "
        "2-16 beams",
        "the decoder's MultiHeadAttention → StepAttention",
        _CLASS_BACK,
    ),
    Lever(
        "attention in float32",
        "train, decode",
        "bf16",
        "MultiHeadAttention → Float32Attention (StepAttention is one too)",
        _CLASS_BACK,
    ),
    Lever(
        "compiled decoder step",
        "decode",
        "fp32 Transformers, once compiled on the machine (Translator, translate "
        "--compiled-step): up to 16 rows, greedy decodes and beam 4 searches of more",
        "BufferedDecoding.compiled_step, compiled_batch_step, compiled_beam_step "
        "(accel.use_compiled_step)",
        "the attributes removed",
        needs=("one buffer per decode",),
    ),
    Lever(
        "compiled weights read in place",
        "decode",
        "compiled steps whose library was indexed when built (accel.library_constants)",
        "each library's weights read from its file instead of its loader's copy; an idle "
        "library's pages handed back while other decodes serve",
        "the steps removed with their lever",
        needs=("compiled decoder step",),
    ),
    Lever(
        "encoder attention by aiayn's kernel",
        "decode",
        "fp32, where aiayn's AVX2 product is loaded (x86 CPUs other than Intel's with AVX2 "
        "and no AVX-512, with the compiled step)",
        "the encoder's MultiHeadAttention → PanelAttention",
        _CLASS_BACK,
        needs=("compiled decoder step",),  # whose loader loads aiayn's AVX2 product
    ),
    Lever(
        "padded bfloat16 rows",
        "train, decode",
        "bf16",
        "nn.Linear → CpuLinear with pad_bf16_rows",
        "the attribute removed, " + _CLASS_BACK,
    ),
    Lever(
        "packed weights",
        "decode",
        "bf16 (oneDNN); fp32 where oneDNN packs float32 (x86 CPUs other than Intel's) or with "
        "pack_weights",
        "nn.Linear → CpuLinear with a pack of its weight (MKL, oneDNN or aiayn's panels)",
        "the packs dropped, " + _CLASS_BACK,
    ),
    Lever(
        "aiayn's AVX2 panels",
        "decode",
        "fp32, oneDNN, where aiayn's AVX2 product is loaded: the decoder step's products",
        "those packs made for aiayn's panels (accel.panels) instead of oneDNN",
        "the packs dropped",
        needs=("packed weights", "compiled decoder step"),
    ),
    Lever(
        "malloc thresholds",
        "train, decode",
        "process_settings=True (aiayn's commands), glibc",
        "the process's mmap and trim thresholds raised (accel.memory)",
        "released; glibc's defaults when the last holder goes",
        process=True,
    ),
)

NAMES: tuple[str, ...] = tuple(lever.name for lever in LEVERS)
BY_NAME: dict[str, Lever] = {lever.name: lever for lever in LEVERS}


def disabled_levers(disable: Iterable[str]) -> frozenset[str]:
    """``disable`` as a set of lever names, with the levers that need one of them; a name
    that is not a lever's raises ValueError naming the valid ones."""
    if isinstance(disable, str):  # one name, not its letters
        disable = (disable,)
    names = frozenset(disable)
    unknown = sorted(names - BY_NAME.keys())
    if unknown:
        raise ValueError(
            f"unknown lever(s) {', '.join(map(repr, unknown))}; the levers: "
            + ", ".join(map(repr, NAMES))
        )
    while True:  # and those that need those
        more = {lever.name for lever in LEVERS if names.intersection(lever.needs)} - names
        if not more:
            return names
        names |= more


def markdown_table() -> str:
    """The list as a Markdown table (name, mode, when, what it swaps, how it is undone)."""
    rows = ["| lever | mode | applies | swaps | undone |", "|---|---|---|---|---|"]
    for lever in LEVERS:
        applies = lever.applies + (" (process-wide)" if lever.process else "")
        rows.append(f"| {lever.name} | {lever.mode} | {applies} | {lever.swaps} | {lever.undone} |")
    return "\n".join(rows) + "\n"
