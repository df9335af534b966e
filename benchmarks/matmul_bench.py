"""The ceiling: fp32 2048×2048 matrix multiply GFLOP/s on the benchmark's threads.

python -m benchmarks.matmul_bench --repeats 10
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import THREADS, emit, median, set_threads, time_calls

SIZE = 2048


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    set_threads()
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(SIZE, SIZE, generator=gen)
    b = torch.randn(SIZE, SIZE, generator=gen)
    out = torch.empty(SIZE, SIZE)
    times = time_calls(lambda: torch.mm(a, b, out=out), 3, args.repeats)
    flops = 2.0 * SIZE**3
    emit(
        {
            "kind": "matmul",
            "system": "matmul",
            "threads": THREADS,
            "times_s": times,
            "gflops": flops / median(times) / 1e9,
            "best_gflops": flops / min(times) / 1e9,
        }
    )


if __name__ == "__main__":
    main()
