"""aiayn.runtime: freed CPU tensors are reused without new page faults."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

# Allocates and frees a 40 MiB tensor (above glibc's largest automatic mmap threshold, so by
# default every allocation maps fresh pages) ten times; prints the minor page faults.
_PROBE = """
import json, resource, sys
import torch
from aiayn.runtime import retain_freed_memory
applied = retain_freed_memory()
for _ in range(2):
    torch.ones(10 << 20)  # the first allocations fault either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(10 << 20)  # 10 Mi float32 = 40 MiB, written, then freed
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": faults}))
"""

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt thresholds are a glibc feature",
)


def _probe(setting: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "AIAYN_MALLOC"}
    if setting is not None:
        env["AIAYN_MALLOC"] = setting
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_retained_memory_is_reused_without_page_faults() -> None:
    tuned = _probe(None)
    assert tuned["applied"] is True
    # 10 x 40 MiB = 102,400 pages if each allocation were mapped afresh; retained, at most
    # one of them (seldom: the heap may still grow once) faults its 10,240 pages.
    assert int(tuned["faults"]) < 25_000  # type: ignore[call-overload]


@glibc_only
def test_opt_out_leaves_malloc_alone() -> None:
    system = _probe("system")
    assert system["applied"] is False
    assert int(system["faults"]) > 50_000  # type: ignore[call-overload]
