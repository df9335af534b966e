"""A decoding lever on and off: the same translations of a file, and how long each took.

Translates ``--source`` with a checkpoint twice, the way ``aiayn translate`` does (beam 4 and
greedy, the run's α), with the lever on and off, and counts the lines that differ:

- ``--lever pack``: float32 weights packed for the CPU's matrix library (``--pack-weights``;
  by default on a CPU other than Intel's, oneDNN) against none (``--no-pack-weights``);
- ``--lever compiled``: the decoder step compiled ahead of time (``--compiled-step``, compiled
  first if it has not been: the time is reported) against the eager step
  (``--no-compiled-step``), one sentence at a time (the compiled step serves up to 16 rows);
- ``--lever attention``: beam steps over many sentences attended by two matrix products
  (``aiayn.accel.attention.StepAttention``, the default) against PyTorch's attention kernel,
  the file in batches (one sentence has too few (sentence, head) pairs for it).

::

    python benchmarks/lever_equality.py runs/m30k-60/averaged.pt --source data/multi30k/valid.en \\
        --lever compiled
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

LEVERS = {"pack": "pack_weights", "compiled": "compiled_step", "attention": None}


def translator(checkpoint: Path, lever: str, on: bool, beam: int) -> Any:
    from aiayn.inference.translator import Translator

    # The pack lever is measured on the eager step (the compiled one has its own products);
    # the attention lever is not a setting of the Translator (see translate).
    setting = LEVERS[lever]
    settings = {} if setting is None else {setting: on}
    settings |= {"compiled_step": False} if lever == "pack" else {}
    made, _ = Translator.from_checkpoint(
        checkpoint, decode_overrides={"beam_size": beam}, **settings
    )
    return made


def translate(
    model: Any, lines: list[str], one_at_a_time: bool, step_attention: bool = True
) -> tuple[list[str], float]:
    """``step_attention``: False raises StepAttention's threshold out of reach for the call."""
    import aiayn.accel.attention as attention

    pairs = attention.STEP_PAIRS
    attention.STEP_PAIRS = pairs if step_attention else sys.maxsize
    try:
        start = time.perf_counter()
        if one_at_a_time:
            out = [model.translate([line])[0] for line in lines]
        else:
            out = model.translate(lines)
        return out, time.perf_counter() - start
    finally:
        attention.STEP_PAIRS = pairs


def compare(
    checkpoint: Path, lines: list[str], lever: str, beam: int, one_at_a_time: bool
) -> dict[str, Any]:
    start = time.perf_counter()
    on_model = translator(checkpoint, lever, True, beam)
    setup_s = time.perf_counter() - start
    off_model = translator(checkpoint, lever, False, beam)
    off_attention = lever != "attention"  # StepAttention in the "off" run but for its lever
    for model, step_attention in ((on_model, True), (off_model, off_attention)):
        translate(model, lines[:16], one_at_a_time, step_attention)  # warm-up
    on, on_s = translate(on_model, lines, one_at_a_time)
    off, off_s = translate(off_model, lines, one_at_a_time, off_attention)
    differ = [i for i, (a, b) in enumerate(zip(on, off, strict=True)) if a != b]
    return {
        "lever": lever,
        "beam": beam,
        "lines": len(lines),
        "one_at_a_time": one_at_a_time,
        "differ": len(differ),
        "first_differing": [i + 1 for i in differ[:10]],
        "setup_on_s": setup_s,
        "on_s": on_s,
        "off_s": off_s,
        "levers_on": on_model.acceleration.levers if on_model.acceleration else [],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--lever", choices=sorted(LEVERS), default="pack")
    parser.add_argument("--beams", type=int, nargs="+", default=[4, 1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--one-at-a-time",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="translate line by line (default: with --lever compiled)",
    )
    args = parser.parse_args(argv)
    import torch

    from aiayn.accel.linear import fp32_pack_library

    torch.set_num_threads(args.threads)
    lines = args.source.read_text(encoding="utf-8").splitlines()
    one = args.one_at_a_time if args.one_at_a_time is not None else args.lever == "compiled"
    library = fp32_pack_library()
    print(f"float32 packs for: {library}; {args.threads} threads", file=sys.stderr)
    for beam in args.beams:
        result = compare(args.checkpoint, lines, args.lever, beam, one) | {"library": library}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
