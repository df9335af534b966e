"""aiayn.accel.memory: freed CPU tensors are reused without new page faults while a setting
is held (training: every size; decoding: blocks under 16 MiB), the largest held setting
applies, and releasing the last one gives glibc's defaults back."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

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


def test_only_pages_mapped_from_a_file_are_handed_back(tmp_path):
    import torch

    from aiayn.accel import memory
    from tests.helpers import pages_stay, resident_bytes, write_to_disk

    reason = pages_stay(tmp_path)
    if reason is not None:
        pytest.skip(reason)
    path = tmp_path / "weights.pt"
    write_to_disk(path, {"w": torch.arange(1 << 20, dtype=torch.float32)})  # 4 MiB
    mapped = torch.load(path, mmap=True, weights_only=True)["w"]
    assert memory.read_by_rows(mapped)
    float(mapped.sum())
    assert resident_bytes(path) >= 4 << 20
    assert 4 << 20 >= memory.page_out(mapped) >= (4 << 20) - 2 * memory._PAGE
    assert resident_bytes(path) <= 2 * memory._PAGE  # its whole pages went, not its ends
    assert torch.equal(mapped, torch.arange(1 << 20, dtype=torch.float32))  # read again
    assert memory.read_by_rows(mapped, undo=True)
    own = torch.ones(1 << 20)
    assert memory.page_out(own) == 0 and not memory.read_by_rows(own)
    assert memory.page_out(mapped[::2]) == 0  # not contiguous: left alone


def test_library_pages_go_back_unless_the_process_wrote_them_or_may(tmp_path):
    """Only a library's clean pages go: a page the process wrote (a relocated table, made
    read-only after) would be lost, and a writable mapping may be written at any time."""
    import ctypes
    import mmap

    from aiayn.accel import memory
    from tests.helpers import resident_bytes

    if not Path("/proc/self/smaps").exists() or memory._libc() is None:
        pytest.skip("needs Linux's /proc and C library")
    size = 64 * mmap.PAGESIZE
    content = bytes(range(256)) * (size // 256)
    lib, near = tmp_path / "lib", tmp_path / "lib2"
    lib.mkdir()
    near.mkdir()
    paths = [lib / "clean.so", lib / "written.so", lib / "writable.so", near / "clean.so"]
    maps = []
    for path in paths:
        path.write_bytes(content)
        writable = path.name != "clean.so"
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        with path.open("rb" if not writable else "r+b") as file:
            maps.append(mmap.mmap(file.fileno(), size, flags=mmap.MAP_PRIVATE, prot=prot))
    clean, written = maps[:2]
    written[:4] = b"abcd"  # a private copy of this page, then the mapping made read-only
    address = ctypes.addressof(ctypes.c_char.from_buffer(written))
    assert memory._libc().mprotect(ctypes.c_void_p(address), ctypes.c_size_t(size), 1) == 0
    for m in maps:
        assert m[:] == m[:]  # every page read in
    resident = {path: resident_bytes(path) for path in paths}
    assert all(resident[path] == size for path in paths)

    assert memory.release_library_pages(lib) == size  # clean.so's pages, no other
    assert resident_bytes(paths[0]) == 0
    assert [resident_bytes(path) for path in paths[1:]] == [size] * 3
    assert written[:8] == b"abcd" + content[4:8]
    assert clean[:] == content  # read again from the file
    assert memory.release_library_pages(tmp_path / "none") == 0


def test_decoding_hands_back_the_code_pages_loading_ran() -> None:
    import torch

    from aiayn.accel import accelerate, memory
    from aiayn.config import ModelConfig
    from aiayn.model.families import build_model

    if not Path("/proc/self/smaps").exists() or memory._libc() is None:
        pytest.skip("needs Linux's /proc and C library")
    config = ModelConfig(vocab_size=64, d_model=32, d_ff=64, n_heads=4, n_layers=1)
    untouched = accelerate(build_model(config).eval(), "decode")
    assert untouched.library_pages == 0  # not asked for: the process is left alone
    model = build_model(config).eval()
    acceleration = accelerate(model, "decode", process_settings=True)
    assert acceleration.library_pages > 0
    assert any(lever.startswith("PyTorch's code pages") for lever in acceleration.levers)
    tokens = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():  # the code runs again, read back from the page cache
        assert model.encode(tokens, None).isfinite().all()
    acceleration.undo()
    assert acceleration.library_pages == 0
