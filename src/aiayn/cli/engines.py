"""The decoding engines of ``aiayn translate``, ``score`` and ``serve``: their options,
declared once for the commands, the checks of what each engine takes, made before a
checkpoint is read or exported, and the translator an engine opens (:func:`open_translator`).
Light on purpose (no PyTorch, no CTranslate2 at import): the CLI's ``--help`` reads it."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiayn.errors import CLIError

if TYPE_CHECKING:
    from aiayn.config import RunConfig
    from aiayn.inference.translator import TextTranslator
    from aiayn.interop.ct2_translator import Ct2Translator

ENGINES = ("torch", "ctranslate2")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--engine``, ``--threads``, ``--quantize``, ``--pack-weights``,
    ``--compiled-step``, ``--mmap`` and ``--precision``, with the same meaning in every command that
    decodes translations."""
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        help="what decodes: 'torch' (the model in PyTorch, the default) or 'ctranslate2' "
        "(the default with --quantize int8: the checkpoint exported to CTranslate2 once, "
        "cached beside it as NAME.ct2-float32 or NAME.ct2-int8, and decoded with aiayn's "
        "tokenisation, batching, output limit and length penalty; beam search by the fairseq "
        "rule, which is CTranslate2's; needs pip install 'aiayn[interop]')",
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads of the decoding (default: PyTorch's or CTranslate2's own default)",
    )
    parser.add_argument(
        "--quantize",
        choices=["int8"],
        help="int8 weights (outputs change a little): decoded by CTranslate2 from its int8 "
        "export of the checkpoint, as --engine ctranslate2 (its options and refusals; needs "
        "pip install 'aiayn[interop]')",
    )
    parser.add_argument(
        "--pack-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pre-pack the float32 weights (CPU) for oneDNN or, on an Intel CPU, MKL; "
        "default: packed where the library is oneDNN (CPUs other than Intel's: faster at "
        "every batch size), --pack-weights also for MKL (beam searches a few percent faster), "
        "--no-pack-weights packs no float32 weight; a pack takes memory besides the weights",
    )
    parser.add_argument(
        "--compiled-step",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode up to 16 rows (sentences x beam) at a time, and greedy batches, through "
        "the decoder step compiled ahead of time for this model and CPU (float32 Transformers "
        "on the CPU; needs a C++ compiler): --compiled-step compiles it where it has not been "
        "(a minute or two for a small model; kept in aiayn's cache directory), and on an x86 "
        "CPU other than Intel's with AVX2 and no AVX-512 also aiayn's own float32 product, "
        "which the step's products then use; by default they are used "
        "where they have been compiled before; --no-compiled-step never uses the step",
    )
    parser.add_argument(
        "--mmap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="map the checkpoint's weights from its file rather than read them (the default): "
        "pages are read as they are used; --no-mmap reads the file, for a checkpoint that may "
        "be written over in place (not replaced by a rename) while it is loaded",
    )
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="weights and products in this dtype (default fp32): bf16 on a CPU with bfloat16 "
        "instructions (AVX512-BF16 or AMX) or a GPU, fp16 on a GPU; faster batches, slower "
        "one-sentence steps on the CPU; log-probabilities and beam scores stay float32; "
        "with --engine ctranslate2, CTranslate2's compute type (float32, bfloat16, float16)",
    )


def check_engine_options(args: argparse.Namespace) -> None:
    """Settle ``args.engine`` (``ctranslate2`` with ``--quantize int8``, else ``torch``, where
    ``--engine`` is not given) and refuse, in one line, what the engine does not take:
    ``--threads`` below 1; ``--quantize int8`` with ``--engine torch``, or where CTranslate2 is
    not installed; with CTranslate2, ``--pack-weights``, ``--compiled-step``, ``--mmap``,
    ``--constraints`` (where the command has it: CTranslate2 has no constrained search),
    ``--beam-rule paper`` (where the command has it, and the beam is not 1) and a device
    CTranslate2 does not know."""
    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads must be at least 1, got {args.threads}")
    # int8 is CTranslate2's (docs/translation.md, "int8"): PyTorch's own int8 path,
    # torch.ao's dynamic quantization, is deprecated.
    int8 = args.quantize == "int8"
    if int8 and args.engine == "torch":
        raise CLIError(
            "--quantize int8 decodes with CTranslate2's int8 weights: leave out --engine "
            "torch (or use --engine ctranslate2)"
        )
    if args.engine is None:
        args.engine = "ctranslate2" if int8 else "torch"
    if args.engine != "ctranslate2":
        return
    if int8:
        _require_ctranslate2()
    # Where only --quantize int8 chose the engine, the refusals say so.
    chosen = " (--quantize int8 decodes with CTranslate2)" if int8 else ""
    for name in ("pack_weights", "compiled_step", "mmap"):
        value = getattr(args, name, None)
        if value is not None:
            flag = "--" + ("" if value else "no-") + name.replace("_", "-")
            raise CLIError(f"{flag} is an option of --engine torch{chosen}")
    if getattr(args, "constraints", None) is not None:  # translate --constraints
        other = "leave out --quantize int8" if int8 else "use --engine torch"
        raise CLIError(f"CTranslate2 has no constrained search{chosen}: for --constraints, {other}")
    if getattr(args, "beam_rule", None) == "paper" and getattr(args, "beam", None) != 1:
        other = "leave out --quantize int8" if int8 else "--engine torch"
        raise CLIError(
            "CTranslate2's beam search stops as the fairseq rule does (beam rule 'paper' has "
            f"no CTranslate2 equivalent): use --beam-rule fairseq, or {other}"
        )
    if args.device not in (None, "auto"):
        kind, _, index = args.device.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise CLIError(f"unknown device {args.device!r} for CTranslate2 (cpu, cuda, cuda:N)")


def ct2_device(requested: str | None) -> str:
    """cpu, cuda or cuda:N for CTranslate2 (``auto`` or None: CUDA where CTranslate2 sees a
    GPU); a device that :func:`check_engine_options` let through."""
    if requested not in (None, "auto"):
        return requested
    from aiayn.interop.ct2 import import_ctranslate2

    ct2 = import_ctranslate2()
    return "cuda" if ct2.get_cuda_device_count() > 0 else "cpu"


def _require_ctranslate2() -> None:
    """Refuse ``--quantize int8`` in one line where CTranslate2 is not installed."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        raise CLIError(
            "--quantize int8 decodes with CTranslate2's int8 weights, and CTranslate2 is not "
            "installed: pip install 'aiayn[interop]'"
        ) from None


def open_ct2(
    args: argparse.Namespace, decode_overrides: Mapping[str, Any], nbest: int = 1
) -> tuple[Ct2Translator, RunConfig, str]:
    """CTranslate2's translator of the ``--engine ctranslate2`` options (through the export
    cached beside the checkpoint, made now where missing or stale), the run's config, and
    where it runs: the device and the compute type."""
    from aiayn.interop.ct2_translator import Ct2Translator
    from aiayn.progress import stderr_report

    device = ct2_device(args.device)
    ct2, config = Ct2Translator.from_checkpoint(
        args.checkpoint,
        device=device,
        decode_overrides=decode_overrides,
        nbest=nbest,
        quantize=args.quantize,
        precision=args.precision,
        threads=args.threads or 0,
        log=stderr_report(),
    )
    return ct2, config, f"{device} (CTranslate2, {ct2.compute_type})"


def open_translator(
    args: argparse.Namespace, decode_overrides: Mapping[str, Any], nbest: int = 1
) -> tuple[TextTranslator, str]:
    """The translator of ``--engine`` (CTranslate2's through the export cached beside the
    checkpoint; PyTorch's with the process settings an aiayn command asks for) with
    ``decode_overrides`` and ``nbest``, and where it runs: the device, and CTranslate2's
    compute type. ValueError for settings an engine refuses."""
    if args.engine == "ctranslate2":
        ct2, _, where = open_ct2(args, decode_overrides, nbest)
        return ct2, where
    from aiayn.devices import pick_device
    from aiayn.inference.translator import Translator

    torch_device = pick_device(args.device or "auto")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    translator, _ = Translator.from_checkpoint(
        args.checkpoint,
        device=torch_device,
        decode_overrides=decode_overrides,
        nbest=nbest,
        pack_weights=args.pack_weights,
        precision=args.precision,
        compiled_step=args.compiled_step,
        mmap=args.mmap is not False,
        process_settings=True,
    )
    return translator, str(torch_device)
