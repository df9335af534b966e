"""aiayn's own float32 product (aiayn.accel.panels), for decoding on x86 CPUs with AVX2 and
without AVX-512: the same products as ``F.linear`` to float32 rounding at every shape, built
beside the compiled decoder step and used by the step's products once loaded, the encoder's
left to oneDNN; a build that fails or a file that is not the user's leaves oneDNN's packs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from aiayn.accel import accelerate, panels
from aiayn.accel.attention import PanelAttention
from aiayn.accel.compiled import (
    MANY_ROWS,
    OneQueryAttention,
    cannot_build,
    compile_step,
    extern_calls,
    load_compiled_step,
    step_path,
    step_products,
)
from aiayn.accel.linear import onednn_packing_available
from aiayn.inference import search
from aiayn.model.attention import MultiHeadAttention
from tests.helpers import packing_model, search_tokens, step_log_probs

pytestmark = [
    pytest.mark.skipif(
        not panels.cpu_suits(), reason="the panels' product is for x86 CPUs with AVX2, no AVX-512"
    ),
    pytest.mark.skipif(panels.compiler() is None, reason="no C++ compiler (apt-get install g++)"),
    pytest.mark.skipif(
        not onednn_packing_available(), reason="PyTorch without oneDNN's packed-linear operators"
    ),
    pytest.mark.usefixtures("amd_cpu"),
]

FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}


NATIVE_FIRST_ARGMAX = search.native_first_argmax  # (conftest sets it aside in each test)


@pytest.fixture
def loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "compiled"
    assert panels.load(folder, build=True) and panels.loaded()
    monkeypatch.setattr(search, "native_first_argmax", NATIVE_FIRST_ARGMAX)
    return folder


@pytest.mark.parametrize(
    ("rows", "width", "out"),
    [
        *[(1, 8, 1), (5, 24, 17), (6, 256, 16), (7, 257, 40), (64, 600, 33), (131, 32, 80)],
        *[(0, 16, 8), (3, 40, 2049), (131, 600, 2065)],
    ],
)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("relu", [False, True])
def test_products_equal_f_linear(
    loaded: Path, rows: int, width: int, out: int, bias: bool, relu: bool
) -> None:
    # widths past 256 take K in blocks; 131 rows: blocks of six and a rest; 17, 33, 40
    # columns: a last, partial panel; from 2,048 columns x is copied into blocks of rows (at
    # 600 wide, 131 rows are three blocks of rows)
    torch.manual_seed(1)
    x, weight = torch.randn(rows, width), torch.randn(out, width)
    b = torch.randn(out) if bias else None
    got = panels.linear(x, panels.pack(weight), out, b, relu)
    want = F.linear(x, weight, b)
    assert_close(got, want.relu() if relu else want, rtol=1e-5, atol=1e-5 * width**0.5)


def test_leading_dimensions_are_kept(loaded: Path) -> None:
    x, weight = torch.randn(3, 1, 48), torch.randn(80, 48)
    got = panels.linear(x, panels.pack(weight), 80, None)
    assert got.shape == (3, 1, 80)
    assert_close(got, F.linear(x, weight), **FLOAT32)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_every_kernel_gives_the_same_bits_however_its_work_is_handed_out(
    loaded: Path, threads: int
) -> None:
    # Over many rows the work goes out in chunks, each thread taking the next when done: every
    # item exactly once, each computed alone, so the bits are those of one thread doing all.
    # Few rows: one share a thread. Both, at thread counts whose chunks do not divide evenly.
    torch.manual_seed(threads)
    cases = []
    for rows, width, out in [(64, 600, 8000), (64, 256, 1000), (100, 40, 33), (4, 256, 2065)]:
        x, weight, b = torch.randn(rows, width), torch.randn(out, width), torch.randn(out)
        cases.append((x, panels.pack(weight), out, b))
    logits = [torch.randn(rows, 1037) * 5 for rows in (64, 37, 3)]
    q, k, v = (torch.randn(13, 4, 7, 16) for _ in range(3))

    def run() -> list[Tensor]:
        got = [panels.linear(x, p, out, b, True) for x, p, out, b in cases]
        got += [panels.log_softmax_(x.clone()) for x in logits]
        got += [torch.ops.aiayn_panels.first_argmax(x) for x in logits]
        return [
            *got,
            panels.attend(q, k, v, None, 0.25),
            panels.attend(q[:1], k[:1], v[:1], None, 1.0),
        ]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run()
        torch.set_num_threads(threads)
        for _ in range(3):
            for got, want in zip(run(), alone, strict=True):
                assert torch.equal(got, want)
    finally:
        torch.set_num_threads(before)


# -- the decoding kernels beside the product ---------------------------------------------------


@pytest.mark.parametrize(("rows", "vocab"), [(64, 8000), (3, 17), (9, 1037), (2, 5), (5, 1)])
def test_first_argmax_is_the_first_maximum_as_max_gives_it(
    loaded: Path, rows: int, vocab: int
) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    scores = torch.randint(-3, 3, (rows, vocab), generator=gen).float()  # ties in every row
    scores[0] = float("-inf")  # nothing but -inf: the first index
    if rows > 2:
        scores[1, -1] = 100.0  # the maximum at the last token, past the last whole vector
        scores[2, vocab // 2] = scores[2, vocab - 1] = float("nan")  # NaN counts as the maximum
    op = torch.ops.aiayn_panels.first_argmax
    assert torch.equal(op(scores), scores.max(dim=-1).indices)
    assert torch.equal(op(scores.t().contiguous().t()), scores.max(dim=-1).indices)  # strided
    native = search.native_first_argmax()  # greedy search's choice, once loaded
    assert native is op
    assert torch.equal(search.first_argmax(scores, native), scores.max(dim=-1).indices)


@pytest.mark.parametrize(("rows", "vocab"), [(64, 8000), (3, 17), (8, 8005), (2, 40), (5, 1)])
@pytest.mark.parametrize("spread", [1.0, 30.0])
def test_log_softmax_in_place_equals_pytorchs(
    loaded: Path, rows: int, vocab: int, spread: float
) -> None:
    torch.manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab) * spread
    logits[0, : vocab // 2] = float("-inf")  # masked tokens stay -inf
    want = torch.log_softmax(logits, dim=-1)
    got = logits.clone()
    assert panels.log_softmax_(got) is got  # in place
    assert_close(got, want, rtol=2e-6, atol=2e-6 * spread)
    assert torch.equal(got.isinf(), want.isinf())


def test_log_softmax_of_rows_without_a_finite_maximum_is_nan_as_pytorchs(loaded: Path) -> None:
    logits = torch.randn(4, 50)
    logits[0, 3] = float("nan")
    logits[1, 7] = float("inf")
    logits[2] = float("-inf")
    got = panels.log_softmax_(logits.clone())
    want = torch.log_softmax(logits, dim=-1)
    assert torch.equal(got[:3].isnan(), want[:3].isnan()) and bool(got[:3].isnan().all())
    assert_close(got[3], want[3], rtol=2e-6, atol=2e-6)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    scores = (q.double() @ k.double().transpose(-1, -2)) / q.size(-1) ** 0.5
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf"))
            if mask.dtype == torch.bool
            else scores + mask.double()
        )
    return (scores.softmax(-1) @ v.double()).float()


@pytest.mark.parametrize(
    ("b", "h", "t", "s", "dk", "dv"),
    [(64, 4, 24, 24, 64, 64), (3, 2, 5, 7, 5, 13), (2, 8, 1, 1, 64, 64), (5, 3, 9, 33, 16, 40)],
)
@pytest.mark.parametrize("mask", ["none", "keys", "additive"])
def test_attention_equals_softmax_of_scores_times_values(
    loaded: Path, b: int, h: int, t: int, s: int, dk: int, dv: int, mask: str
) -> None:
    # keys and values views of one fused product (rows far apart), a query tile of four
    # with a partial last one, keys past a whole vector, widths of no whole vector
    torch.manual_seed(b * t + s)
    q = torch.randn(b, t, h, dk).transpose(1, 2)
    kv = torch.randn(b, s, h, dk + dv)
    k, v = kv[..., :dk].transpose(1, 2), kv[..., dk:].transpose(1, 2)
    m: Tensor | None = None
    if mask == "keys":  # (B, 1, 1, S), True = attend, as attention_mask gives it
        m = torch.rand(b, 1, 1, s) > 0.3
        m[..., 0] = True
    elif mask == "additive":
        m = torch.where(torch.rand(b, 1, t, s) > 0.3, 0.0, float("-inf"))
        m[..., 0] = 0.0
    got = panels.attend(q, k, v, m, dk**-0.5)
    assert got.shape == (b, h, t, dv)
    assert got.transpose(1, 2).is_contiguous()  # the heads side by side: merged by a view
    assert_close(got, reference_attention(q, k, v, m), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("queries", "beam"), [(1, 1), (4, 4), (3, 2), (12, 4)])
def test_keys_of_beams_kept_positions_first_are_read_as_their_flattening(
    loaded: Path, queries: int, beam: int
) -> None:
    # A beam cache's keys (positions, sentences, H, beam, Dh) seen as (sentences, H,
    # positions, beam, Dh): key j * beam + b is beam b's at position j, each query kept to
    # its lineage by an additive mask. Few queries read them in place, more a flattened copy.
    torch.manual_seed(queries * beam)
    sentences, heads, positions, dk, dv = 5, 3, 7, 16, 24
    k = torch.randn(positions, sentences, heads, beam, dk).permute(1, 2, 0, 3, 4)
    v = torch.randn(positions, sentences, heads, beam, dv).permute(1, 2, 0, 3, 4)
    q = torch.randn(sentences, heads, queries, dk)
    lineage = torch.randint(0, beam, (sentences, 1, queries, positions, 1))
    mask = torch.where(lineage == torch.arange(beam), 0.0, float("-inf")).flatten(
        3
    )  # (sentences, 1, queries, positions × beam)
    got = panels.attend(q, k, v, mask, dk**-0.5)
    flat_k, flat_v = k.flatten(2, 3), v.flatten(2, 3)
    assert torch.equal(got, panels.attend(q, flat_k, flat_v, mask, dk**-0.5))
    assert_close(got, reference_attention(q, flat_k, flat_v, mask), rtol=1e-5, atol=1e-5)


def test_the_steps_attention_through_the_kernel_is_sdpa(loaded: Path) -> None:
    # As the libraries for many rows attend: one query a row, or a sentence's beams each over
    # its lineage, their keys as the cache keeps them (positions first) or flattened.
    torch.manual_seed(3)
    attn = MultiHeadAttention(32, 4, 8, 8, self_attention=True).eval()
    sentences, heads, positions, beam, dk = 6, 4, 9, 4, 8
    k, v = (torch.randn(positions, sentences, heads, beam, dk).permute(1, 2, 0, 3, 4) for _ in "kv")
    lineage = torch.randint(0, beam, (sentences, 1, beam, positions, 1))
    lineage[..., 0, :] = 0
    beams = torch.where(lineage == torch.arange(beam), 0.0, float("-inf")).flatten(3)
    allowed = torch.rand(sentences, 1, 1, positions * beam) > 0.3
    allowed[..., 0] = True
    cases = [
        (torch.randn(sentences, heads, beam, dk), beams),
        (torch.randn(sentences, heads, 1, dk), allowed),
    ]
    for q, mask in cases:
        want = attn.scaled_dot_product(q, k.flatten(2, 3), v.flatten(2, 3), mask, False)
        attn.__class__ = OneQueryAttention
        attn.through_kernel = True
        for keys, values in ((k, v), (k.flatten(2, 3), v.flatten(2, 3))):
            got = attn.scaled_dot_product(q, keys, values, mask, False)
            assert_close(got, want, rtol=1e-5, atol=1e-6)
        attn.__class__ = MultiHeadAttention


def test_attention_without_a_position_is_nan_and_reads_no_masked_value(loaded: Path) -> None:
    q, k, v = torch.randn(2, 1, 6, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)
    k[:, :, 4] = v[:, :, 4] = float("nan")  # a padding position's key and value: not used
    want = reference_attention(q[:1], k[:1, :, :4], v[:1, :, :4], None)[0]  # the 4 attended
    keys = torch.tensor([[True, True, True, True, False], [False] * 5]).view(2, 1, 1, 5)
    additive = torch.zeros(2, 1, 6, 5).masked_fill(~keys, float("-inf"))
    for mask in (keys, additive):
        got = panels.attend(q, k, v, mask, 8**-0.5)
        assert bool(got[1].isnan().all())
        assert_close(got[0], want, rtol=1e-5, atol=1e-5)


def test_decoding_attends_the_encoders_sentences_through_the_kernel(loaded: Path) -> None:
    plain, model = packing_model(), packing_model()
    acceleration = accelerate(model, "decode")
    encoder = [type(m) for m in model.encoder.modules() if isinstance(m, MultiHeadAttention)]
    assert encoder and set(encoder) == {PanelAttention}
    assert "encoder attention by aiayn's kernel" in acceleration.levers
    # the decoder's attend as the step (compiled or eager) has them
    assert not any(type(m) is PanelAttention for m in model.decoder.modules())
    src = torch.randint(4, 50, (3, 11))
    src_pad = torch.zeros_like(src, dtype=torch.bool)
    src_pad[1, 7:] = True
    with torch.inference_mode():
        assert_close(model.encode(src, src_pad), plain.encode(src, src_pad), **FLOAT32)
    acceleration.undo()
    assert {type(m) for m in model.encoder.modules() if isinstance(m, MultiHeadAttention)} == {
        MultiHeadAttention
    }


def test_decoding_packs_the_steps_products_into_panels_and_the_encoders_for_onednn(
    loaded: Path,
) -> None:
    plain, model = packing_model(), packing_model()
    stepwise = {id(m) for m in step_products(model)}
    acceleration = accelerate(model, "decode")
    kinds = {name: m.pack.kind for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds["out_proj"] == kinds["decoder.layers.0.ffn.w1"] == "panels"
    assert (
        kinds["encoder.layers.0.ffn.w1"] == kinds["decoder.layers.1.cross_attn.kv_proj"] == "onednn"
    )
    assert all(
        (kind == "panels") == (id(m) in stepwise)
        for m, kind in zip(
            [m for m in model.modules() if isinstance(m, nn.Linear)], kinds.values(), strict=True
        )
    )
    assert "aiayn's AVX2 panels" in acceleration.levers
    assert acceleration.details["packed weights"] == "oneDNN and aiayn's AVX2 panels, 23"
    for rows in (1, 5, 40):
        assert_close(step_log_probs(model, rows), step_log_probs(plain, rows), **FLOAT32)
    for beam in (True, False):
        assert search_tokens(model, beam) == search_tokens(plain, beam)


def test_a_library_that_is_not_the_users_alone_is_not_loaded(loaded: Path) -> None:
    path = panels.library_path(loaded)
    panels._loaded = None
    path.chmod(0o720)  # group-writable
    with pytest.raises(PermissionError, match="not this user's alone"):
        panels.load(loaded)
    assert not panels.loaded()


def test_a_failed_build_says_why_and_decoding_keeps_onednns_packs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "panel_gemm.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(panels, "SOURCE", broken)
    monkeypatch.setattr(panels, "_build", panels._build.real)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"building panel_gemm\.cpp failed: .*error"):
        panels.load(tmp_path / "compiled", build=True)
    assert not panels.loaded() and not list((tmp_path / "compiled").iterdir())
    model = packing_model()
    accelerate(model, "decode")
    assert {m.pack.kind for m in model.modules() if isinstance(m, nn.Linear)} == {"onednn"}


@pytest.mark.skipif(cannot_build() is not None, reason=f"compiling the step: {cannot_build()}")
def test_the_compiled_steps_products_go_through_the_panels(
    loaded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.accel.test_compiled import decode, same_steps

    monkeypatch.setenv("AIAYN_CACHE", str(tmp_path / "cache"))
    model = packing_model()
    accelerate(model, "decode")
    step = compile_step(model, rows=MANY_ROWS)
    # The library calls the operator (its runner reads the description beside it) ...
    calls = extern_calls(step.path)
    assert step.path == step_path(model, rows=MANY_ROWS) and "aiayn_panels::linear" in (
        calls.read_text()
    )
    # ... for each product of its decoder layers but the cross-attention keys' and values'
    layers = len(model.decoder.layers)
    assert calls.read_text().count('"aiayn_panels::linear"') == 6 * layers
    # ... the feed-forward's first applying its ReLU as it writes (no pass of its own)
    relu = {
        args["panels"]["as_tensor"]["name"]
        for node in json.loads(calls.read_text())["nodes"]
        if node["node"]["target"] == "aiayn_panels::linear"
        for args in [{i["name"]: i["arg"] for i in node["node"]["inputs"]}]
        if args["relu"]["as_bool"]
    }
    assert relu == {f"decoder_layers_{i}_ffn_w1_panels" for i in range(layers)}
    # ... and each attention through the kernel, its own and the memory's
    assert calls.read_text().count('"aiayn_panels::attend"') == 2 * layers
    assert step.constants is not None  # its panels too read from its file
    same_steps(model, step, 17, 30, 5)
    assert decode(model, step, 40, 1) == decode(model, None, 40, 1)
    # A library built without the operator loaded is another file.
    monkeypatch.setattr(panels, "_loaded", None)
    assert step_path(model, rows=MANY_ROWS) != step.path
    monkeypatch.setattr(panels, "_loaded", panels.library_path(loaded))
    calls.chmod(0o620)  # the description is native code's too: the user's alone
    with pytest.raises(PermissionError, match="not this user's alone"):
        load_compiled_step(model, rows=MANY_ROWS)
