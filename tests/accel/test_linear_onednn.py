"""Float32 weights packed for oneDNN (aiayn.accel.linear), as decoding on a CPU other than
Intel's does by default: the same products as the plain layers to float32 rounding, at every
row count, the same hypotheses, and never a stale weight."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from aiayn.accel import accelerate
from aiayn.accel import linear as linear_module
from aiayn.accel.linear import (
    fp32_pack_library,
    onednn_packing_available,
    onednn_rows,
    pack,
    packing_available,
)
from tests.helpers import (
    LetterTokenizer,
    linear_layers,
    packed_flags,
    packing_model,
    search_tokens,
    step_log_probs,
)

pytestmark = [
    pytest.mark.skipif(
        not onednn_packing_available(), reason="PyTorch without oneDNN's packed-linear operators"
    ),
    pytest.mark.usefixtures("amd_cpu"),
]

# Float32 sums in another order: what two float32 GEMM libraries differ by.
FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}


def test_the_library_follows_the_cpu_vendor(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fp32_pack_library() == "onednn"
    monkeypatch.setattr(linear_module, "cpu_vendor", lambda: "GenuineIntel")
    assert fp32_pack_library() == ("mkl" if packing_available() else "onednn")
    monkeypatch.setattr(linear_module, "cpu_vendor", lambda: "")  # unreadable: as Intel's
    assert fp32_pack_library() == ("mkl" if packing_available() else "onednn")


def test_decoding_packs_every_float32_linear_by_default_and_not_when_told() -> None:
    model = packing_model()
    acceleration = accelerate(model, "decode")
    assert acceleration.packed == len(linear_layers(model)) and all(packed_flags(model))
    assert "packed weights" in acceleration.levers
    assert acceleration.details["packed weights"].startswith("oneDNN")
    assert all(m.pack is not None and m.pack.kind == "onednn" for m in linear_layers(model))  # type: ignore[attr-defined]
    acceleration.undo()
    plain = packing_model()
    assert accelerate(plain, "decode", pack_weights=False).packed == 0
    assert accelerate(packing_model(), "train").packed == 0


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 65, 130, 1000])
def test_products_equal_the_plain_layer_through_the_pack_at_every_row_count(
    rows: int, onednn_rows_seen: list[int]
) -> None:
    torch.manual_seed(1)
    layer = nn.Linear(48, 80)
    plain = copy.deepcopy(layer)
    assert accelerate(layer, "decode").packed == 1
    onednn_rows_seen.clear()  # the pack's own check
    x = torch.randn(rows, 1, 48)  # a decoder step's (B, 1, d) input
    with torch.no_grad():
        got, want = layer(x), plain(x)
    assert got.dtype == torch.float32 and got.shape == want.shape == (rows, 1, 80)
    assert_close(got, want, **FLOAT32)
    assert onednn_rows_seen == [onednn_rows(rows)]
    x.requires_grad_()
    assert layer(x).requires_grad  # autograd on: the plain product
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # autocast: the plain product too
    assert onednn_rows_seen == [onednn_rows(rows)]


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_decoder_steps_equal_the_plain_model(rows: int, onednn_rows_seen: list[int]) -> None:
    plain, model = packing_model(), packing_model()
    accelerate(model, "decode")
    onednn_rows_seen.clear()
    assert_close(step_log_probs(model, rows), step_log_probs(plain, rows), **FLOAT32)
    assert onednn_rows_seen


@pytest.mark.parametrize("beam", [True, False])
def test_search_finds_the_same_hypotheses(beam: bool, onednn_rows_seen: list[int]) -> None:
    plain, model = packing_model(), packing_model()
    accelerate(model, "decode")
    onednn_rows_seen.clear()
    assert search_tokens(model, beam) == search_tokens(plain, beam)
    assert onednn_rows_seen


def test_a_weight_changed_after_packing_is_never_multiplied_stale(
    onednn_rows_seen: list[int],
) -> None:
    model = packing_model()
    plain = copy.deepcopy(model)
    accelerate(model, "decode")
    with torch.no_grad():
        model.decoder.layers[0].ffn.w1.weight.mul_(2.0)
        plain.decoder.layers[0].ffn.w1.weight.mul_(2.0)
    onednn_rows_seen.clear()
    got = step_log_probs(model, 6)
    assert packed_flags(model).count(False) == 1 and onednn_rows_seen
    assert_close(got, step_log_probs(plain, 6), **FLOAT32)


def test_a_float32_pack_that_disagrees_with_the_plain_product_is_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = linear_module._onednn_linear

    def off_from_31_rows(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        out = real(x, packed, bias)
        return out + 1e-2 if x.numel() // x.shape[-1] >= 31 else out

    monkeypatch.setattr(linear_module, "_onednn_linear", off_from_31_rows)
    assert pack(nn.Linear(16, 24)) is None


def test_translator_packs_by_default_and_not_with_pack_weights_false() -> None:
    from aiayn.inference.translator import Translator

    texts = ["hello", "", "abc", "a longer line of text"]
    model = packing_model()
    packed = Translator(model, LetterTokenizer())  # type: ignore[arg-type]
    assert all(packed_flags(model))
    plain = Translator(packing_model(), LetterTokenizer(), accelerated=False)  # type: ignore[arg-type]
    assert packed.translate(texts) == plain.translate(texts)
    model = packing_model()
    Translator(model, LetterTokenizer(), pack_weights=False)  # type: ignore[arg-type]
    assert not any(packed_flags(model))


# A decode's steps through a oneDNN-packed projection onto argv[2] columns (default 20,000)
# for argv[1] rows: at 256 rows a float32 product of 20.5 MB, above the decoding setting's
# 16 MiB mmap threshold (of 41 MB at 40,000 columns, above its 32 MiB trim threshold too).
# Prints the thresholds in force at the first step and once the cache is gone, the minor page
# faults of ten steps after two, and whether the product is the plain layer's.
_HEAP_PROBE = """
import gc, json, resource, sys
import torch
import torch.nn.functional as F
from torch import nn
from aiayn.accel import memory
from aiayn.accel.linear import CpuLinear, LogitsBuffer, logits_into, pack
torch.set_num_threads(1)
torch.manual_seed(0)
decode = memory.hold(memory.DECODE)
layer = nn.Linear(64, int(sys.argv[2]) if len(sys.argv) > 2 else 20_000, bias=False)
layer.__class__ = CpuLinear
layer.pack = pack(layer, "onednn")
hidden = torch.randn(int(sys.argv[1]), 64)
cache = LogitsBuffer()
with torch.no_grad():
    logits = logits_into(layer, hidden, cache)
    during = memory.in_force()
    same = torch.allclose(logits, F.linear(hidden, layer.weight), rtol=1e-5, atol=1e-4)
    for _ in range(2):
        logits = logits_into(layer, hidden, cache)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        logits = logits_into(layer, hidden, cache)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
del logits, cache
gc.collect()
print(json.dumps({"during": during, "after": memory.in_force(), "faults": faults, "same": same}))
"""


def _heap_probe(rows: int, columns: int = 20_000) -> dict[str, object]:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "AIAYN_MALLOC"}
    out = subprocess.run(
        [sys.executable, "-c", _HEAP_PROBE, str(rows), str(columns)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("platform").libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's"
)
def test_a_packed_projection_above_the_mmap_threshold_is_served_from_the_heap() -> None:
    decode = [16 << 20, 32 << 20]
    big = _heap_probe(256)
    assert big["same"]
    # While the cache lives, the mmap threshold is above the product's 20.5 MB and the trim
    # threshold above two of them; then the decoding setting again.
    assert big["during"][0] > 256 * 20_000 * 4  # type: ignore[index]
    assert big["during"][1] > 2 * 256 * 20_000 * 4  # type: ignore[index]
    assert big["after"] == decode
    # Mapped afresh, each product would fault its 5,000 pages: 50,000 for ten steps. From the
    # heap, it reuses freed blocks; the heap may still grow by a block or two (a product's
    # block split by a small allocation) before the reuse is steady.
    assert big["faults"] < 15_000  # type: ignore[operator]
    # Above the trim threshold too (41 MB): freed at the top of the heap, a product would be
    # handed back to the kernel and faulted in again: about 50,000 pages in ten steps.
    huge = _heap_probe(256, 40_000)
    assert huge["same"] and huge["faults"] < 25_000  # type: ignore[operator]
    # Under the threshold (4 rows, 320 KB), the decoding setting is left as it is.
    small = _heap_probe(4)
    assert small["same"] and small["during"] == decode and small["after"] == decode


# Two caches' holds: the larger one ends first, the other's stays in force (argv: none).
_HOLDS_PROBE = """
import gc, json
from aiayn.accel import memory
from aiayn.accel.linear import LogitsBuffer
decode = memory.hold(memory.DECODE)
big, small = LogitsBuffer(), LogitsBuffer()
big.keep_in_heap(40 << 20)
small.keep_in_heap(20 << 20)
both = memory.in_force()
del big
gc.collect()
alone = memory.in_force()
del small
gc.collect()
print(json.dumps([both, alone, memory.in_force()]))
"""


@pytest.mark.skipif(
    __import__("platform").libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's"
)
def test_a_caches_hold_outlives_a_larger_one_that_ends_first() -> None:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "AIAYN_MALLOC"}
    out = subprocess.run(
        [sys.executable, "-c", _HOLDS_PROBE], env=env, capture_output=True, text=True, check=True
    )
    both, alone, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert both[0] > 40 << 20
    assert 20 << 20 < alone[0] < 40 << 20
    assert after == [16 << 20, 32 << 20]
