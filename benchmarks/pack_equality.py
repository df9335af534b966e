"""Packed against unpacked float32 weights: the same translations of a file, and how long each took.

Translates ``--source`` with a checkpoint twice, the way ``aiayn translate`` does (beam 4 and
greedy, the run's α): once with float32 weights packed for the CPU's matrix library
(``--pack-weights``; by default on a CPU other than Intel's, oneDNN) and once without
(``--no-pack-weights``), and counts the lines that differ::

    python benchmarks/pack_equality.py runs/m30k-60/averaged.pt --source data/multi30k/valid.en
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def translate(checkpoint: Path, lines: list[str], pack: bool, beam: int) -> tuple[list[str], float]:
    from aiayn.inference.translator import Translator

    translator, _ = Translator.from_checkpoint(
        checkpoint, pack_weights=pack, decode_overrides={"beam_size": beam}
    )
    start = time.perf_counter()
    out = translator.translate(lines)
    return out, time.perf_counter() - start


def compare(checkpoint: Path, lines: list[str], beam: int) -> dict[str, Any]:
    translate(checkpoint, lines[:32], True, beam)  # warm-up: kernels, allocator, page cache
    packed, packed_s = translate(checkpoint, lines, True, beam)
    plain, plain_s = translate(checkpoint, lines, False, beam)
    differ = [i for i, (a, b) in enumerate(zip(packed, plain, strict=True)) if a != b]
    return {
        "beam": beam,
        "lines": len(lines),
        "differ": len(differ),
        "first_differing": [i + 1 for i in differ[:10]],
        "packed_s": packed_s,
        "unpacked_s": plain_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--beams", type=int, nargs="+", default=[4, 1])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    from aiayn.accel.linear import fp32_pack_library

    torch.set_num_threads(args.threads)
    lines = args.source.read_text(encoding="utf-8").splitlines()
    library = fp32_pack_library()
    print(f"float32 packs for: {library}; {args.threads} threads", file=sys.stderr)
    for beam in args.beams:
        result = compare(args.checkpoint, lines, beam) | {"library": library}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
