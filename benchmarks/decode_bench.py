"""Decoding speed of one system on the SMALL or BASE model, in this process (``run_all.py``).

64 random source sentences of 24 tokens; every system does exactly 24 decoder steps per
sentence (end-of-sentence is suppressed until the last step), with beam 4 (length penalty 0.6)
and greedy, once with all 64 sentences in one batch (sentences/s from the median of repeated
runs) and once one sentence at a time (median latency per sentence). ``aiayn`` is the default
path once its decoder step is compiled on the machine (``--compile-only`` compiles it, in a
process of its own, and reports how long that took; a timed process loads it);
``aiayn-eager`` is ``--no-compiled-step``. With ``--ct2-dir``, aiayn's processes map the
model's weights from a file there (the first one writes it), as aiayn's Translator maps a
checkpoint. aiayn and the
``nn.Transformer`` peer are driven by ``aiayn.inference.search``; Hugging Face by ``generate``;
CTranslate2 by ``translate_batch``.

    python -m benchmarks.decode_bench --system aiayn --repeats 3 [--workload base]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.common import (
    DECODE,
    DECODE_WORKLOADS,
    EOS_ID,
    THREADS,
    DecodeWorkload,
    decode_sources,
    emit,
    median,
    peak_rss_mb,
    set_threads,
    skip,
    time_calls,
)
from benchmarks.peers import available

SYSTEMS = (
    "aiayn",
    "aiayn-eager",
    "aiayn-packed",
    "aiayn-bf16",
    "torch",
    "hf",
    "ct2-float32",
    "ct2-int8",
    "ct2-float32-1thread",
    "ct2-float32-avx2",
)
MODES = ("beam-batch", "greedy-batch", "beam-single", "greedy-single")
# In the models' directory (--ct2-dir): aiayn's weights, written by the first aiayn process.
AIAYN_WEIGHTS = "aiayn-weights.pt"
ALPHA = 0.6

# decode(sources (n, S), beam_size) decodes n sentences with exactly DECODE.steps steps each
# and returns the number of output tokens of each sentence's best hypothesis.
Decode = Callable[[Tensor, int], list[int]]
StepFn = Callable[[Tensor, object], Tensor]


def suppress_eos(step_fn: StepFn, steps: int) -> StepFn:
    """EOS impossible before the last of ``steps`` steps, where search allows only EOS."""
    calls = 0

    def step(tokens: Tensor, cache: object) -> Tensor:
        nonlocal calls
        calls += 1
        log_probs = step_fn(tokens, cache)
        if calls < steps:
            log_probs[:, EOS_ID] = float("-inf")
        return log_probs

    return step


# How the compiled decoder step came to be (aiayn's default system): compiled in this process
# (``compile_s``, the first call on a machine) or loaded (``load_s``, every later process).
STEP_TIMES: dict[str, float] = {}


def use_compiled_step(model: Any, acceleration: Any) -> None:
    """What ``Translator(compiled_step=None)`` finds once the step was compiled on this
    machine (``translate --compiled-step`` compiles it): compiled here the first time."""
    import sys

    from aiayn.accel import use_compiled_step
    from aiayn.accel.compiled import step_paths, unsupported
    from aiayn.accel.store import compiled_dir

    if unsupported(model) is not None:
        return
    there = compiled_dir().is_dir() and all(p.is_file() for p in step_paths(model).values())
    start = time.perf_counter()
    if use_compiled_step(model, acceleration, True, lambda m: print(m, file=sys.stderr)):
        STEP_TIMES["load_s" if there else "compile_s"] = time.perf_counter() - start


def aiayn_decoder(
    dw: DecodeWorkload,
    packed: bool = False,
    bf16: bool = False,
    compiled: bool = False,
    weights: Path | None = None,
) -> Decode:
    """aiayn's decode; ``weights``: the file of the model's weights (written by the first
    process that needs it), mapped from it."""
    from aiayn.accel import accelerate
    from aiayn.inference.search import beam_search, greedy_search
    from aiayn.model.families import build_model

    w = dw.model
    config = w.model_config()
    torch.manual_seed(0)
    model = build_model(config).eval()
    if weights is not None:  # mapped, as aiayn's Translator maps a checkpoint
        from aiayn.inference.loading import assign_weights
        from aiayn.training.checkpoint import save_atomic

        if not weights.is_file():  # the first process writes it (on disk, then renamed)
            save_atomic(model.state_dict(), weights)
        assign_weights(model, torch.load(weights, mmap=True, weights_only=True))
    if bf16:  # Translator(precision="bf16") / translate --precision bf16
        model.to(torch.bfloat16)
    # What aiayn's Translator does on the CPU: float32 weights packed where the CPU's library
    # for them is oneDNN; with ``packed`` (translate --pack-weights) also for MKL.
    precision = "bf16" if bf16 else "fp32"
    # The compiled step is loaded before the weights are packed, as the Translator does.
    accelerate(
        model,
        "decode",
        precision=precision,
        pack_weights=True if packed else None,
        before_packing=(lambda acc: use_compiled_step(model, acc)) if compiled else None,
        process_settings=True,  # as aiayn translate and serve ask for them
    )

    @torch.inference_mode()
    def decode(src: Tensor, beam: int) -> list[int]:
        n = src.size(0)
        src_pad = torch.zeros_like(src, dtype=torch.bool)
        memory = model.encode(src, src_pad)
        # The beams of a sentence share its memory: projected once, not repeated per beam.
        cache = model.init_cache(memory, src_pad, dw.steps, beam_size=beam)
        step = suppress_eos(model.log_probs_step, dw.steps)
        if beam > 1:
            hyps = beam_search(step, cache, n, beam_size=beam, alpha=ALPHA, max_len=dw.steps - 1)
            return [len(h[0].tokens) + 1 for h in hyps]  # + EOS
        return [len(h.tokens) + 1 for h in greedy_search(step, cache, n, max_len=dw.steps - 1)]

    return decode


def torch_decoder(dw: DecodeWorkload) -> Decode:
    from aiayn.inference.search import beam_search, greedy_search
    from benchmarks.peers import PrefixCache, TorchTransformer, torch_log_probs_step

    torch.manual_seed(0)
    model = TorchTransformer(dw.model).eval()

    def step_fn(tokens: Tensor, cache: object) -> Tensor:
        assert isinstance(cache, PrefixCache)
        return torch_log_probs_step(model, tokens, cache)

    @torch.inference_mode()
    def decode(src: Tensor, beam: int) -> list[int]:
        n = src.size(0)
        src_pad = torch.zeros_like(src, dtype=torch.bool)
        memory = model.encode(src, src_pad)
        if beam > 1:
            memory, src_pad = memory.repeat_interleave(beam, 0), src_pad.repeat_interleave(beam, 0)
        cache = PrefixCache(memory, src_pad)  # search feeds BOS first: the prefix grows
        step = suppress_eos(step_fn, dw.steps)
        if beam > 1:
            hyps = beam_search(step, cache, n, beam_size=beam, alpha=ALPHA, max_len=dw.steps - 1)
            return [len(h[0].tokens) + 1 for h in hyps]
        return [len(h.tokens) + 1 for h in greedy_search(step, cache, n, max_len=dw.steps - 1)]

    return decode


def hf_decoder(dw: DecodeWorkload) -> Decode:
    from benchmarks.peers import marian_model

    model = marian_model(dw.model).eval()

    @torch.inference_mode()
    def decode(src: Tensor, beam: int) -> list[int]:
        out = model.generate(
            input_ids=src,
            attention_mask=torch.ones_like(src),
            num_beams=beam,
            do_sample=False,
            max_new_tokens=dw.steps,
            min_new_tokens=dw.steps,
            length_penalty=ALPHA,
            early_stopping=True,
        )
        return [out.size(1) - 1] * src.size(0)  # minus the decoder-start token

    return decode


def ct2_decoder(
    dw: DecodeWorkload, quantization: str, model_dir: Path | None, threads: int = THREADS
) -> Decode:
    """``model_dir`` holds the converted models (``run_all`` converts them in a process of
    its own, so that this process's RSS is CTranslate2's alone); None converts here.
    ``threads``: CTranslate2's intra-op threads (the workload's 2; 1 for the extra row that
    shows CTranslate2 on a machine where its 2-thread mode is slower than one thread)."""
    import ctranslate2

    from benchmarks.peers import convert_to_ctranslate2, vocabulary

    if model_dir is None:
        model_dir = Path(tempfile.mkdtemp(prefix="aiayn-bench-ct2-"))
        convert_to_ctranslate2(dw.model, model_dir)
    translator = ctranslate2.Translator(
        str(model_dir / f"ct2-{quantization}"),
        device="cpu",
        compute_type=quantization,
        intra_threads=threads,
        inter_threads=1,
    )
    tokens = vocabulary(dw.model)

    def decode(src: Tensor, beam: int) -> list[int]:
        batch = [[tokens[i] for i in row] for row in src.tolist()]
        results = translator.translate_batch(
            batch,
            beam_size=beam,
            max_decoding_length=dw.steps,
            min_decoding_length=dw.steps,
            length_penalty=ALPHA,
            max_batch_size=len(batch),
        )
        return [len(r.hypotheses[0]) for r in results]

    return decode


def build(system: str, dw: DecodeWorkload, ct2_dir: Path | None) -> Decode:
    if system.startswith("aiayn"):
        return aiayn_decoder(
            dw,
            packed=system == "aiayn-packed",
            bf16=system == "aiayn-bf16",
            compiled=system in ("aiayn", "aiayn-packed"),
            weights=None if ct2_dir is None else ct2_dir / AIAYN_WEIGHTS,
        )
    if system == "torch":
        return torch_decoder(dw)
    if system == "hf":
        return hf_decoder(dw)
    if system.endswith("-1thread"):
        return ct2_decoder(dw, system.removeprefix("ct2-").removesuffix("-1thread"), ct2_dir, 1)
    if system.endswith("-avx2"):
        # Read by oneDNN when it first runs (run_all.py sets it before the process starts).
        os.environ.setdefault(*CT2_AVX2)
        return ct2_decoder(dw, system.removeprefix("ct2-").removesuffix("-avx2"), ct2_dir)
    return ct2_decoder(dw, system.removeprefix("ct2-"), ct2_dir)


# The CTranslate2 model is converted from the Hugging Face one, so it needs both.
REQUIRES = {
    "hf": ["transformers"],
    "ct2-float32": ["ctranslate2", "transformers"],
    "ct2-int8": ["ctranslate2", "transformers"],
    "ct2-float32-1thread": ["ctranslate2", "transformers"],
    "ct2-float32-avx2": ["ctranslate2", "transformers"],
}
# CTranslate2 float32 with the oneDNN inside it limited to AVX2 (its own kernels pick AVX2 on
# an AMD CPU already): on an AMD EPYC (Zen 4) its greedy batches ran 1.2× faster so, its
# AVX-512 products of 64 × 1024 by 1024 × 256 taking twice the AVX2 ones' time
# (docs/performance.md, Limits). A setting of CTranslate2's, measured as one.
CT2_AVX2 = ("ONEDNN_MAX_CPU_ISA", "AVX2")


def check_length(system: str, lengths: list[int], steps: int) -> None:
    if any(n != steps for n in lengths):
        raise RuntimeError(f"{system} decoded {sorted(set(lengths))} steps instead of {steps}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=SYSTEMS)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each batch mode")
    parser.add_argument(
        "--single", type=int, default=DECODE.n_sentences, help="sentences decoded one at a time"
    )
    parser.add_argument("--workload", choices=sorted(DECODE_WORKLOADS), default="small")
    parser.add_argument(
        "--ct2-dir", type=Path, help="the models: CTranslate2's converted ones, aiayn's weights"
    )
    parser.add_argument("--convert-only", action="store_true", help="convert into --ct2-dir")
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="compile aiayn's decoder step for the workload (where it is not in the cache yet)",
    )
    args = parser.parse_args(argv)
    if args.compile_only:
        set_threads()
        weights = None
        if args.ct2_dir is not None:
            args.ct2_dir.mkdir(parents=True, exist_ok=True)
            weights = args.ct2_dir / AIAYN_WEIGHTS
        aiayn_decoder(DECODE_WORKLOADS[args.workload], compiled=True, weights=weights)
        emit(
            {
                "kind": "compile",
                "system": "aiayn",
                **{f"step_{k}": v for k, v in STEP_TIMES.items()},
            }
        )
        return
    if args.convert_only:
        from benchmarks.peers import convert_to_ctranslate2

        start = time.perf_counter()
        convert_to_ctranslate2(DECODE_WORKLOADS[args.workload].model, args.ct2_dir)
        emit({"kind": "convert", "system": "ct2", "convert_s": time.perf_counter() - start})
        return
    if args.system is None:
        parser.error("--system is required (unless --convert-only or --compile-only)")
    set_threads()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    missing = [m for m in REQUIRES.get(args.system, []) if not available(m)]
    if missing:
        skip(args.system, f"{', '.join(missing)} not installed (pip install -e '.[bench]')")
        return
    if args.system == "aiayn-packed":
        from aiayn.accel.linear import packing_available

        if not packing_available():
            skip(args.system, "this PyTorch has no MKL packed-linear operators")
            return
    if args.system == "aiayn-bf16":
        from aiayn.accel import cpu_has_bfloat16

        if not cpu_has_bfloat16():
            skip(args.system, "this CPU has no bfloat16 instructions (AVX512-BF16 or AMX)")
            return
    dw = DECODE_WORKLOADS[args.workload]
    src = decode_sources(dw)
    start = time.perf_counter()
    decode = build(args.system, dw, args.ct2_dir)
    build_s = time.perf_counter() - start
    results: dict[str, dict[str, float]] = {}
    for mode in args.modes:
        beam = dw.beam_size if mode.startswith("beam") else 1
        if mode.endswith("batch"):
            check_length(args.system, decode(src, beam), dw.steps)  # warm-up
            times = time_calls(lambda b=beam: decode(src, b), 0, args.repeats)
            results[mode] = {
                "median_s": median(times),
                "sentences_per_s": src.size(0) / median(times),
            }
        else:
            rows = src[: args.single]
            check_length(args.system, decode(rows[:1], beam), dw.steps)  # warm-up
            times = [time_calls(lambda r=r, b=beam: decode(r[None], b), 0, 1)[0] for r in rows]
            results[mode] = {"median_s": median(times), "latency_ms": 1000 * median(times)}
        results[mode]["times_s"] = times  # type: ignore[assignment]
    emit(
        {
            "kind": "decode",
            "system": args.system,
            "workload": args.workload,
            "modes": results,
            "build_s": build_s,
            **{f"step_{name}": value for name, value in STEP_TIMES.items()},
            "peak_rss_mb": peak_rss_mb(),
        }
    )


if __name__ == "__main__":
    main()
