"""aiayn.runtime: freed CPU tensors are reused without new page faults (training: every
size; decoding: blocks under 16 MiB), and the settings are only ever raised."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

# Applies the settings named in argv (in that order), then ten times allocates, writes and
# frees (a) one 40 MiB tensor, above glibc's largest automatic mmap threshold, so that by
# default each maps fresh pages; (b) one 20 MiB tensor; (c) eight 1 MiB tensors alive
# together, as in a decoder step. Prints the minor page faults of each. What glibc's automatic
# thresholds do with (b) and (c) depends on what the process allocated before (it varies from
# run to run), so only the settings' effects on them are tested. The model is imported
# first, as in a training or decoding process: how often a small allocation splits a freed
# block (and the heap then grows instead of reusing it) depends on the heap's state.
_PROBE = """
import json, resource, sys
import torch
import aiayn.model.transformer
from aiayn import runtime
applied = [getattr(runtime, name)() for name in sys.argv[1:]]
def one_big():
    torch.ones(10 << 20)
def one_20():
    torch.ones(5 << 20)
def eight_small():
    blocks = [torch.ones(1 << 18) for _ in range(8)]
    del blocks
faults = {}
for name, work in (("40", one_big), ("20", one_20), ("8x1", eight_small)):
    for _ in range(2):
        work()  # the first allocations fault either way
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        work()
    faults[name] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": faults}))
"""

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt thresholds are a glibc feature",
)


def _probe(setting: str | None, *calls: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "AIAYN_MALLOC"}
    if setting is not None:
        env["AIAYN_MALLOC"] = setting
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *calls],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _faults(result: dict[str, object], work: str) -> int:
    return int(result["faults"][work])  # type: ignore[index]


@glibc_only
def test_retained_memory_is_reused_without_page_faults() -> None:
    tuned = _probe(None, "retain_freed_memory")
    assert tuned["applied"] == [True]
    # Mapped afresh, 10 x 40 MiB fault 102,400 pages (the opt-out test). Retained, a block
    # is reused, and only where a small allocation has taken part of the freed one does the
    # heap grow and fault a new block's pages (0 to 4 of the ten in practice): so each bound
    # is half of what mapping afresh costs.
    assert _faults(tuned, "40") < 51_200
    assert _faults(tuned, "20") < 25_600
    assert _faults(tuned, "8x1") < 10_240  # 10 x 8 MiB afresh: 20,480 pages


@glibc_only
def test_decoding_reuses_blocks_under_16_mib_and_maps_larger_ones() -> None:
    decoding = _probe(None, "reuse_decoding_memory")
    assert decoding["applied"] == [True]
    assert _faults(decoding, "8x1") < 10_240  # reused: 20,480 pages if faulted afresh
    # Above 16 MiB: mapped afresh and given back (10 x 20 MiB = 51,200 pages): bounded.
    assert _faults(decoding, "20") > 40_000
    assert _faults(decoding, "40") > 50_000


@glibc_only
def test_settings_are_only_raised() -> None:
    # Training then decoding in one process (aiayn demo): the training setting stays.
    both = _probe(None, "retain_freed_memory", "reuse_decoding_memory")
    assert both["applied"] == [True, True]
    assert _faults(both, "40") < 51_200
    # Decoding then training: raised to the training setting.
    raised = _probe(None, "reuse_decoding_memory", "retain_freed_memory")
    assert _faults(raised, "40") < 51_200


@glibc_only
def test_opt_out_leaves_malloc_alone() -> None:
    system = _probe("system", "retain_freed_memory", "reuse_decoding_memory")
    assert system["applied"] == [False, False]
    assert _faults(system, "40") > 50_000
