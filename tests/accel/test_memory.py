"""aiayn.accel.memory: freed CPU tensors are reused without new page faults while a setting
is held (training: every size; decoding: blocks under 16 MiB), the largest held setting
applies, and releasing the last one gives glibc's defaults back."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

# Holds and releases the settings named in argv, in that order ("train", "decode"; "-train"
# releases the train hold), then ten times allocates, writes and frees (a) one 40 MiB tensor,
# above glibc's largest automatic mmap threshold, so that by default each maps fresh pages;
# (b) one 20 MiB tensor; (c) eight 1 MiB tensors alive together, as in a decoder step. Prints
# the minor page faults of each. What glibc's automatic thresholds do with (b) and (c) depends
# on what the process allocated before (it varies from run to run), so only the settings'
# effects on them are tested. The model is imported first, as in a training or decoding
# process: how often a small allocation splits a freed block (and the heap then grows instead
# of reusing it) depends on the heap's state.
_PROBE = """
import json, resource, sys
import torch
import aiayn.model.transformer
from aiayn.accel import memory
tokens, held = {}, []
for step in sys.argv[1:]:
    if step.startswith("-"):
        memory.release(tokens.pop(step[1:]))
    else:
        tokens[step] = memory.hold(getattr(memory, step.upper()))
        held.append(tokens[step] is not None)
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
print(json.dumps({"held": held, "in_force": memory.in_force(), "faults": faults}))
"""

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt thresholds are a glibc feature",
)


def _probe(setting: str | None, *steps: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "AIAYN_MALLOC"}
    if setting is not None:
        env["AIAYN_MALLOC"] = setting
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *steps],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _faults(result: dict[str, object], work: str) -> int:
    return int(result["faults"][work])  # type: ignore[index]


@glibc_only
def test_the_training_setting_reuses_freed_memory_without_page_faults() -> None:
    tuned = _probe(None, "train")
    assert tuned["held"] == [True] and tuned["in_force"] == [1 << 30, 1 << 30]
    # Mapped afresh, 10 x 40 MiB fault 102,400 pages (the opt-out test). Retained, a block
    # is reused, and only where a small allocation has taken part of the freed one does the
    # heap grow and fault a new block's pages: so each bound is half of what mapping afresh
    # costs.
    assert _faults(tuned, "40") < 51_200
    assert _faults(tuned, "20") < 25_600
    assert _faults(tuned, "8x1") < 10_240  # 10 x 8 MiB afresh: 20,480 pages


@glibc_only
def test_the_decoding_setting_reuses_blocks_under_16_mib_and_maps_larger_ones() -> None:
    decoding = _probe(None, "decode")
    assert decoding["held"] == [True]
    assert _faults(decoding, "8x1") < 10_240  # reused: 20,480 pages if faulted afresh
    # Above 16 MiB: mapped afresh and given back (10 x 20 MiB = 51,200 pages): bounded.
    assert _faults(decoding, "20") > 40_000
    assert _faults(decoding, "40") > 50_000


@pytest.mark.slow
@glibc_only
def test_the_largest_held_setting_applies_and_releasing_lowers_it() -> None:
    # Training then decoding in one process (aiayn demo): the training setting stays.
    both = _probe(None, "train", "decode")
    assert both["held"] == [True, True] and both["in_force"] == [1 << 30, 1 << 30]
    assert _faults(both, "40") < 51_200
    # The training hold released: the decoding setting is left.
    lowered = _probe(None, "train", "decode", "-train")
    assert lowered["in_force"] == [16 << 20, 32 << 20]
    assert _faults(lowered, "40") > 50_000
    # Everything released: glibc's defaults again (1 MiB blocks above the 128 KiB threshold).
    released = _probe(None, "decode", "-decode")
    assert released["in_force"] is None
    assert _faults(released, "8x1") > 15_000


@glibc_only
def test_opt_out_leaves_malloc_alone() -> None:
    system = _probe("system", "train", "decode")
    assert system["held"] == [False, False] and system["in_force"] is None
    assert _faults(system, "40") > 50_000
