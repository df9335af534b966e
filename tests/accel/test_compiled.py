"""The decoder step compiled ahead of time (aiayn.accel.compiled): the eager step's
log-probabilities and hypotheses, the cache search drives, where it is found again, and where
it does not serve. Three compiles for the module, the libraries tuned for few rows, for many
and for beam searches over many (AOTInductor, about half a minute each here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from aiayn.accel import (
    Acceleration,
    BufferedDecoding,
    CpuLinear,
    accelerate,
    panels,
    use_compiled_step,
)
from aiayn.accel.compiled import (
    BEAM,
    BEAM_ROWS,
    FEW_ROWS,
    FIRST_SLOTS,
    MANY_ROWS,
    MARCH_VAR,
    MAX_ROWS,
    CompiledBeamCache,
    CompiledCache,
    CompiledStep,
    OneQueryAttention,
    _cross_keys_values,
    cannot_build,
    compile_step,
    extern_calls,
    library_products,
    load_compiled_step,
    step_key,
    step_path,
    unsupported,
)
from aiayn.accel.store import trusted
from aiayn.config import ModelConfig
from aiayn.inference.search import beam_search, greedy_search
from aiayn.model.attention import MultiHeadAttention
from aiayn.model.cache import DecoderCache
from aiayn.model.transformer import Transformer
from tests.conftest import panel_library_copy
from tests.helpers import ROOT, LetterTokenizer, packing_model

pytestmark = pytest.mark.skipif(
    cannot_build() is not None, reason=f"compiling the decoder step: {cannot_build()}"
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """aiayn's cache directory for the module: where compiled steps are kept."""
    path = tmp_path_factory.mktemp("aiayn-cache")
    if panels.cpu_suits():  # built beside the steps, as translate --compiled-step does
        panel_library_copy(panels.library_path(path / "compiled"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIAYN_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def model(cache_dir: Path) -> Transformer:
    """An accelerated fp32 model (random weights: greedy sentences finish at different
    steps, so search shrinks the batch)."""
    plain = packing_model()
    accelerate(plain, "decode", precision="fp32")
    return plain


def compile_side_by_side(rows: Sequence[int]) -> None:
    """Compile the module model's libraries tuned for ``rows`` into its cache, each in a
    process of its own and all at once: the machine's cores compile them together (20-27 s
    each on two cores, one after another)."""
    script = (
        "import sys, torch\n"
        "from aiayn.accel import accelerate\n"
        "from aiayn.accel.compiled import compile_step\n"
        "from tests.helpers import packing_model\n"
        "torch.set_num_threads(int(sys.argv[1]))  # the key names the thread count\n"
        "model = packing_model()\n"
        "accelerate(model, 'decode', precision='fp32')\n"
        "compile_step(model, rows=int(sys.argv[2]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    threads = str(torch.get_num_threads())
    run = [[sys.executable, "-c", script, threads, str(n)] for n in rows]
    processes = [subprocess.Popen(args, env=env, stderr=subprocess.PIPE) for args in run]
    for process in processes:
        _, err = process.communicate()
        assert process.returncode == 0, err.decode(errors="replace")[-2000:]


@pytest.fixture(scope="module")
def step(model: Transformer) -> CompiledStep:
    """The library tuned for few rows, the three compiled together first, so that every test
    that asks for one finds all three in the module's cache."""
    compile_side_by_side((FEW_ROWS, MANY_ROWS, BEAM_ROWS))
    found = load_compiled_step(model)
    assert found is not None  # the processes' key is this process's
    return found


@pytest.fixture(scope="module")
def batch_step(model: Transformer, step: CompiledStep) -> CompiledStep:
    """The library tuned for many rows (greedy batches)."""
    return compile_step(model, rows=MANY_ROWS)


@pytest.fixture(scope="module")
def beam_step(model: Transformer, step: CompiledStep) -> CompiledStep:
    """The library for beam searches over many rows."""
    return compile_step(model, rows=BEAM_ROWS)


def storages(tensors: list[torch.Tensor | None]) -> set[int]:
    """The storages ``tensors`` are views of."""
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


def sources(rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * 100 + length)
    src = torch.randint(4, 50, (rows, length), generator=generator)
    src_pad = torch.zeros_like(src, dtype=torch.bool)
    for i in range(1, rows, 2):  # every other source padded at its end
        src_pad[i, length - 1 - i % length :] = True
        src[i][src_pad[i]] = 0
    return src, src_pad


def decode(model: Transformer, step: CompiledStep | None, rows: int, beam: int) -> list:
    src, src_pad = sources(rows, max(9, rows + 1))  # no source padded whole
    with torch.inference_mode():
        memory = model.encode(src, src_pad)
        if step is None:
            cache = model.init_cache(memory, src_pad, 14, beam_size=beam)
            fn = model.log_probs_step
        else:
            cache = step.init_cache(model, memory, src_pad, 14, beam)
            fn = step.log_probs_step
        if beam == 1:
            return [h.tokens for h in greedy_search(fn, cache, rows, max_len=13)]
        hyps = beam_search(fn, cache, rows, beam_size=beam, max_len=13, alpha=0.6, nbest=beam)
        return [[(h.tokens, round(h.score, 4)) for h in sentence] for sentence in hyps]


def same_steps(model: Transformer, step: CompiledStep, rows: int, length: int, slots: int) -> None:
    """The compiled step's log-probabilities are the eager step's at every position."""
    src, src_pad = sources(rows, length)
    generator = torch.Generator().manual_seed(slots)
    with torch.inference_mode():
        memory = model.encode(src, src_pad)
        eager = model.init_cache(memory, src_pad, slots, beam_size=1)
        compiled = step.init_cache(model, memory, src_pad, slots, 1)
        tokens = torch.ones(rows, dtype=torch.long)
        # Row-major (few rows): room for FIRST_SLOTS positions, grown by doubling up to
        # max_len. Position-major (many): room for max_len, of which a step reads those
        # decoded so far.
        row_major = isinstance(compiled, CompiledCache)
        assert compiled.capacity == (min(slots, FIRST_SLOTS) if row_major else slots)
        for _ in range(slots):
            want = model.log_probs_step(tokens, eager)
            got = step.log_probs_step(tokens, compiled)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            tokens = torch.randint(4, 50, (rows,), generator=generator)
            if row_major:
                assert compiled.length <= compiled.capacity
                assert compiled.capacity < max(2 * compiled.length, FIRST_SLOTS + 1)
        assert compiled.length == compiled.capacity == slots
        with pytest.raises(ValueError, match="cache is full"):
            step.log_probs_step(tokens, compiled)


@pytest.mark.slow
@pytest.mark.parametrize(("rows", "length", "slots"), [(3, 9, 6), (1, 1, 1), (2, 70, 90)])
def test_the_step_is_the_eager_step(
    model: Transformer, step: CompiledStep, rows: int, length: int, slots: int
) -> None:
    """Sources and caches shorter and longer than those it was compiled with."""
    same_steps(model, step, rows, length, slots)


# (Every source keeps a token: sources() pads every other one, and more rows than tokens
# would pad some whole, a row that attends to nothing, which no translation has.)
@pytest.mark.slow
@pytest.mark.parametrize(("rows", "length", "slots"), [(70, 71, 40), (17, 30, 5), (2, 3, 17)])
def test_the_step_tuned_for_many_rows_is_the_eager_step(
    model: Transformer, batch_step: CompiledStep, rows: int, length: int, slots: int
) -> None:
    assert batch_step.path != step_path(model)
    with torch.inference_mode():
        cache = batch_step.init_cache(model, torch.zeros(rows, 3, 32), None, 5, 1)
    # Position-major, each row its own set of keys and values (no lineage to follow).
    assert isinstance(cache, CompiledBeamCache) and cache.lineage is None
    assert cache.layers[0].self_k.shape[:2] == (5, rows)
    same_steps(model, batch_step, rows, length, slots)


@pytest.mark.slow
def test_the_library_attends_in_its_own_loops(step: CompiledStep) -> None:
    # ATen's attention kernel, called out of the library, costs more than the attention.
    assert b"scaled_dot_product" not in step.path.read_bytes()


def test_one_query_attention_is_sdpa() -> None:
    gen = torch.Generator().manual_seed(0)
    attn = MultiHeadAttention(32, 4, 8, 8, self_attention=True).eval()
    rows, heads, keys, dk = 5, 4, 9, 8
    q = torch.randn(rows, heads, 1, dk, generator=gen)
    k, v = (torch.randn(rows, heads, keys, dk, generator=gen) for _ in range(2))
    allowed = torch.rand(rows, 1, 1, keys, generator=gen) > 0.3
    allowed[..., 0] = True  # every row attends somewhere
    per_key = (torch.arange(keys) <= 4).view(1, 1, 1, keys)  # the step's mask of slots
    additive = torch.randn(rows, 1, 1, keys, generator=gen)
    # A sentence's beams: several queries, each with its own mask of keys (lineages).
    several = torch.randn(rows, heads, 3, dk, generator=gen)
    lineages = torch.rand(rows, 1, 3, keys, generator=gen) > 0.5
    lineages[..., 0] = True
    one = [(q, mask) for mask in (None, allowed, per_key, additive)]
    for queries, mask in one + [(several, m) for m in (None, allowed, lineages, additive)]:
        want = attn.scaled_dot_product(queries, k, v, mask, False)
        attn.__class__ = OneQueryAttention
        got = attn.scaled_dot_product(queries, k, v, mask, False)
        attn.__class__ = MultiHeadAttention
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_models_own_variants_are_compiled(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pre-norm with a final norm, learned positions, separate target embeddings and
    vocabulary, a bias on the projection, GELU: the step is the model's own."""
    from aiayn.accel import compiled

    # Without autotuning the products (the module's libraries have it): the same graph,
    # compiled in a fifth of the time.
    monkeypatch.setattr(compiled, "_INDUCTOR", compiled._INDUCTOR | {"max_autotune": False})
    torch.manual_seed(1)
    config = ModelConfig(
        vocab_size=50,
        tgt_vocab_size=60,
        share_embeddings=False,
        d_model=32,
        d_ff=64,
        n_heads=4,
        n_layers=2,
        dropout=0.0,
        pre_norm=True,
        positional="learned",
        final_logits_bias=True,
        activation="gelu",
        max_positions=128,
    )
    variant = Transformer(config).eval()
    with torch.no_grad():
        variant.out_proj.bias.uniform_(-1, 1)
    accelerate(variant, "decode", precision="fp32")
    same_steps(variant, compile_step(variant), 2, 11, 8)


@pytest.mark.slow
@pytest.mark.parametrize(("rows", "beam"), [(1, 1), (5, 1), (1, 4), (3, 4), (40, 1)])
def test_search_finds_the_eager_hypotheses(
    model: Transformer, step: CompiledStep, batch_step: CompiledStep, rows: int, beam: int
) -> None:
    got = decode(model, step if rows * beam <= MAX_ROWS else batch_step, rows, beam)
    assert got == decode(model, None, rows, beam)
    if beam == 1 and rows > 1:  # sentences of several lengths: the batch shrank
        assert len({len(tokens) for tokens in got}) > 1


@pytest.mark.slow
def test_reorder_and_keep_move_whole_rows(model: Transformer, step: CompiledStep) -> None:
    src, src_pad = sources(2, 9)
    with torch.inference_mode():
        memory = model.encode(src, src_pad)
        cache = step.init_cache(model, memory, src_pad, 5, 2)
        assert isinstance(cache, CompiledCache)
        # Each sentence's cross-attention keys and values, once per beam row, every layer's
        # in one block (one allocation the batch's size, given back whole).
        layer = model.decoder.layers[1].cross_attn
        assert layer is not None
        k, v = layer.project_kv(memory)
        assert torch.equal(cache.cross_k[1], k.repeat_interleave(2, 0))
        assert torch.equal(cache.cross_v[1], v.repeat_interleave(2, 0))
        assert len(storages([*cache.cross_k, *cache.cross_v])) == 1
        assert all(t.is_contiguous() for t in [*cache.cross_k, *cache.cross_v])
        step.log_probs_step(torch.ones(4, dtype=torch.long), cache)
        before = [k.clone() for k in cache.self_k]
        before_v = [v.clone() for v in cache.self_v]
        cache.reorder(torch.tensor([1, 1, 2, 3]))
        assert torch.equal(cache.self_k[0][0], before[0][1])
        for layer, v in enumerate(cache.self_v):  # every layer's keys and values moved
            assert torch.equal(v, before_v[layer][[1, 1, 2, 3]])
            assert torch.equal(cache.self_k[layer], before[layer][[1, 1, 2, 3]])
        with pytest.raises(ValueError, match="reorder expects 4"):
            cache.reorder(torch.tensor([0, 1]))
        cache.keep(torch.tensor([2, 3]))
        assert cache.batch_size == 2 and cache.cross_mask.size(0) == 2
        assert torch.equal(cache.self_k[1][0], before[1][2])
        assert torch.equal(cache.self_v[1][1], before_v[1][3])


@pytest.mark.slow
@pytest.mark.parametrize("rows", [5, 20])
def test_beam_searches_over_many_rows_find_the_eager_hypotheses(
    model: Transformer, beam_step: CompiledStep, rows: int
) -> None:
    got = decode(model, beam_step, rows, BEAM)
    assert got == decode(model, None, rows, BEAM)
    # Sentences of several lengths: the batch shrank as they finished.
    assert len({len(hyps[0][0]) for hyps in got}) > 1


@pytest.mark.slow
def test_the_beam_cache_steps_reorders_and_keeps_as_the_eager_one(
    model: Transformer, beam_step: CompiledStep
) -> None:
    src, src_pad = sources(5, 9)
    generator = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        memory = model.encode(src, src_pad)
        eager = model.init_cache(memory, src_pad, 12, beam_size=BEAM)
        compiled = beam_step.init_cache(model, memory, src_pad, 12, BEAM)
        assert isinstance(compiled, CompiledBeamCache) and compiled.batch_size == 5 * BEAM
        storage = compiled.layers[0].self_k.data_ptr()
        # Every layer's self-attention keys and values in one block, its cross-attention ones
        # in another: an allocation each, the batch's size.
        layers = compiled.layers
        assert len(storages([t for c in layers for t in (c.self_k, c.self_v)])) == 1
        assert len(storages([t for c in layers for t in (c.cross_k, c.cross_v)])) == 1
        assert all(t.is_contiguous() for c in layers for t in (c.self_k, c.cross_k, c.cross_v))

        written = set()

        def steps(n: int) -> None:
            for _ in range(n):
                tokens = torch.randint(4, 50, (eager.batch_size,), generator=generator)
                want = model.log_probs_step(tokens, eager)
                got = beam_step.log_probs_step(tokens, compiled)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                written.add(got.data_ptr())

        steps(3)
        order = torch.arange(5 * BEAM).view(5, BEAM)[:, [2, 0, 0, 3]].flatten()
        eager.reorder(order)
        compiled.reorder(order)
        steps(2)
        # Sentences 3 and 1 kept, in that order: their positions become a prefix of the
        # same storage, laid out for two sentences.
        kept = torch.cat([torch.arange(3 * BEAM, 4 * BEAM), torch.arange(BEAM, 2 * BEAM)])
        before = compiled.layers[1].self_v[: compiled.length].clone()
        eager.keep(kept)
        compiled.keep(kept)
        assert compiled.batch_size == 2 * BEAM and compiled.cross_mask is not None
        assert compiled.cross_mask.size(0) == 2
        after = compiled.layers[1].self_v
        assert after.is_contiguous() and compiled.layers[0].self_k.data_ptr() == storage
        assert torch.equal(after[: compiled.length], before[:, [3, 1]])
        steps(3)
        # Every step's log-probabilities in the cache's one buffer, where the projection is a
        # plain product (a pack, as on x86 CPUs other than Intel's, makes its own matrix).
        out_proj = model.out_proj
        if not isinstance(out_proj, CpuLinear) or out_proj.pack is None:
            assert len(written) == 1
        with pytest.raises(ValueError, match="whole groups"):
            compiled.keep(torch.tensor([0, 1]))
        with pytest.raises(ValueError, match="beam 4, not 2"):
            beam_step.init_cache(model, memory, src_pad, 12, 2)


def test_one_buffer_and_a_buffer_per_layer_move_alike() -> None:
    # Where keys and values differ in width the cache keeps a tensor per layer: the same
    # reorders and keeps leave both layouts equal (no library is involved).
    gen = torch.Generator().manual_seed(0)
    layers, rows, heads, slots, dk = 3, 6, 2, 5, 4
    kv = torch.randn(2, layers, rows, heads, slots, dk, generator=gen)
    cross = [torch.randn(rows, heads, 7, dk, generator=gen) for _ in range(2 * layers)]
    mask = torch.ones(rows, 1, 1, 7, dtype=torch.bool)

    def cache(one_buffer: bool) -> CompiledCache:
        own = kv.clone()
        parts = (
            [list(own[0]), list(own[1])]
            if one_buffer
            else [
                [t.clone() for t in kv[0]],
                [t.clone() for t in kv[1]],
            ]
        )
        return CompiledCache(
            None,  # type: ignore[arg-type]  # the step is not used by reorder and keep
            *parts,
            cross[:layers],
            cross[layers:],
            mask,
            3,
            slots,
            2,
            self_kv=own if one_buffer else None,
        )

    one, apart = cache(True), cache(False)
    for move in ("reorder", [1, 1, 0, 3, 5, 4]), ("keep", [5, 2, 3, 0]), ("reorder", [1, 0, 3, 3]):
        for c in (one, apart):
            getattr(c, move[0])(torch.tensor(move[1]))
        assert one.batch_size == apart.batch_size == len(move[1])
        for a, b in zip([*one.self_k, *one.self_v], [*apart.self_k, *apart.self_v], strict=True):
            assert torch.equal(a, b)
        assert one.self_kv is not None
        assert all(
            t.untyped_storage().data_ptr() == one.self_kv.untyped_storage().data_ptr()
            for t in one.self_k
        )  # the layers' tensors are views of the one buffer
    # The decoded positions followed every move; the ones after them stayed where they were
    # (no step has written them: the library reads them as the zeros they are made with).
    assert torch.equal(one.self_k[0][:, :, :3], kv[0, 0][[0, 4, 1, 1]][:, :, :3])
    assert torch.equal(one.self_v[2][:, :, 3:], kv[1, 2][:4][:, :, 3:])
    tensors = [*one.self_k, *one.self_v, *one.cross_k, *one.cross_v, one.cross_mask]
    assert all(t.is_contiguous() for t in tensors)  # as the library reads them


@pytest.mark.parametrize("d_v", [8, 4])
def test_the_cross_keys_and_values_are_each_sentences_once_a_beam(d_v: int) -> None:
    # One block where keys and values are as wide (d_v 8 = d_k), a tensor each where not.
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=30, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=d_v, n_layers=2, dropout=0.0
    )
    model = Transformer(config).eval()
    memory = torch.randn(3, 5, 16)
    with torch.inference_mode():
        keys, values = _cross_keys_values(model.decoder.layers, memory, 2)
        for layer, k, v in zip(model.decoder.layers, keys, values, strict=True):
            assert layer.cross_attn is not None
            want_k, want_v = layer.cross_attn.project_kv(memory)
            assert torch.equal(k, want_k.repeat_interleave(2, 0))
            assert torch.equal(v, want_v.repeat_interleave(2, 0))
            assert k.is_contiguous() and v.is_contiguous()
    assert len(storages([*keys, *values])) == (1 if d_v == 8 else 4)


@pytest.mark.slow
def test_found_again_by_key_and_only_for_the_same_weights(
    model: Transformer, step: CompiledStep, cache_dir: Path
) -> None:
    assert step.path.parent == cache_dir / "compiled" and step.path.is_file()
    assert trusted(step.path)
    again = load_compiled_step(model)
    assert again is not None and again.path == step.path
    other = packing_model()
    with torch.no_grad():
        other.out_proj.weight[3, 0] += 1.0
    assert step_path(other) != step.path
    assert load_compiled_step(other) is None
    key = step_key(model)
    assert key == step_key(packing_model())
    assert step_key(model, MANY_ROWS) != key  # tuned for other rows: another library
    assert step_key(model, BEAM_ROWS) not in (key, step_key(model, MANY_ROWS))
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:  # the library's kernels are built for a thread count
        assert step_key(model) != key
    finally:
        torch.set_num_threads(threads)
    longer = Transformer(ModelConfig(**{**vars(model.config), "max_positions": 512}))
    longer.load_state_dict(packing_model().state_dict())
    assert step_key(longer) != step_key(model)
    from torch._inductor import config

    with config.patch({"cpp.march": "x86-64-v3"}):  # TORCHINDUCTOR_CPP_MARCH: other code
        assert step_key(model) != key
    assert step_key(model) == key


@pytest.mark.slow
def test_a_decoding_process_imports_nothing_of_the_compiler(step: CompiledStep) -> None:
    """Naming, loading and running a library import nothing of Inductor (which costs a
    decoding process 68 MB), and the key is the one Inductor's own setting gives, with a
    target set and without."""
    script = (
        "import sys, torch\n"
        "from aiayn.accel import accelerate\n"
        "from aiayn.accel.compiled import load_compiled_step, step_key\n"
        "from tests.helpers import packing_model\n"
        "model = packing_model()\n"
        "accelerate(model, 'decode', precision='fp32')\n"
        "key = step_key(model)\n"
        "step = load_compiled_step(model)\n"
        "if step is not None:\n"
        "    memory = model.encode(torch.ones(2, 5, dtype=torch.long), None)\n"
        "    cache = step.init_cache(model, memory, None, 8, 1)\n"
        "    assert step.log_probs_step(torch.ones(2, dtype=torch.long), cache).shape == (2, 50)\n"
        "imported = 'torch._inductor.config' in sys.modules\n"
        "from torch._inductor import config\n"
        "print(imported, step is not None, key, step_key(model), config.cpp.march)\n"
    )
    keys = []
    for march in (None, "x86-64-v3"):
        env = {k: v for k, v in os.environ.items() if k != MARCH_VAR}  # AIAYN_CACHE: the step's
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src")])
        if march is not None:
            env[MARCH_VAR] = march
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        # The library is found for the environment it was compiled in, not for another target.
        assert out == ["False", str(march is None), out[2], out[2], str(march)]
        keys.append(out[2])
    assert keys[0] == step_key(packing_model()) != keys[1]


@pytest.mark.slow
def test_a_step_that_is_not_trusted_or_does_not_load_is_not_used(
    model: Transformer, step: CompiledStep, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIAYN_CACHE", str(tmp_path))
    fresh = packing_model()
    acceleration = accelerate(fresh, "decode", precision="fp32")
    (tmp_path / "compiled").mkdir(mode=0o700)
    copied = step_path(fresh)
    shutil.copy(step.path, copied)
    copied.chmod(0o722)  # others may write it
    warnings: list[str] = []
    assert use_compiled_step(fresh, acceleration, False, warnings.append) is None
    assert "not this user's alone" in warnings[-1]
    copied.write_bytes(b"not a library")
    copied.chmod(0o700)
    assert use_compiled_step(fresh, acceleration, False, warnings.append) is None
    assert len(warnings) == 2 and warnings[-1].startswith("compiled step: ")
    assert "compiled decoder step" not in acceleration.levers
    copied.unlink()
    assert use_compiled_step(fresh, acceleration, False, warnings.append) is None
    assert len(warnings) == 2  # nothing compiled: nothing to say


def test_it_is_compiled_without_autograd_however_it_is_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor packs a product's weight only where it needs no gradient: the compile runs
    without autograd whether the step is asked for by compile_step or use_compiled_step."""
    monkeypatch.setenv("AIAYN_CACHE", str(tmp_path))
    grad: list[bool] = []

    def stop(*args: object, **kwargs: object) -> None:
        grad.append(torch.is_grad_enabled())
        raise RuntimeError("stopped before compiling")

    monkeypatch.setattr(torch._inductor, "aot_compile", stop)
    fresh = packing_model()
    acceleration = accelerate(fresh, "decode", precision="fp32")
    warnings: list[str] = []
    assert torch.is_grad_enabled()
    assert use_compiled_step(fresh, acceleration, True, warnings.append) is None
    assert "stopped before compiling" in warnings[-1]
    with pytest.raises(RuntimeError, match="stopped"):
        compile_step(fresh, rows=MANY_ROWS)
    assert grad == [False, False]


@pytest.mark.slow
def test_the_model_uses_it_for_small_batches_and_greedy_ones_of_its_own_weights(
    step: CompiledStep, batch_step: CompiledStep, beam_step: CompiledStep
) -> None:
    model = packing_model()
    acceleration = accelerate(model, "decode", precision="fp32")
    assert use_compiled_step(model, acceleration, False, print) is not None
    assert isinstance(model, BufferedDecoding)
    memory = torch.zeros(MAX_ROWS // 4 + 1, 3, 32)
    with torch.inference_mode():
        small = model.init_cache(memory[:4], None, 5, beam_size=4)
        large = model.init_cache(memory, None, 5, beam_size=4)
        other_beam = model.init_cache(torch.zeros(MAX_ROWS // 3 + 1, 3, 32), None, 5, 3)
        greedy = model.init_cache(torch.zeros(MAX_ROWS + 1, 3, 32), None, 5)
    with torch.enable_grad():
        training = model.init_cache(memory[:1], None, 5)
    assert isinstance(small, CompiledCache) and small.step is model.compiled_step
    assert isinstance(greedy, CompiledBeamCache) and greedy.step is model.compiled_batch_step
    assert greedy.step.path == batch_step.path
    assert isinstance(large, CompiledBeamCache) and large.step is model.compiled_beam_step
    assert large.step is not None and large.step.path == beam_step.path
    for eager in (other_beam, training):  # beam 3 over 18 rows; autograd on
        assert type(eager) is not CompiledBeamCache and isinstance(eager, DecoderCache)
    step = model.compiled_step
    assert step is not None and not step.serves(model, memory.bfloat16())
    with pytest.raises(TypeError, match="log-probabilities only"):
        model.decode_step(torch.ones(16, dtype=torch.long), small)
    with torch.no_grad():
        model.out_proj.weight[0, 0] += 1.0  # a weight that changed is not the library's
    with torch.inference_mode():
        assert isinstance(model.init_cache(memory[:1], None, 5), DecoderCache)
    acceleration.undo()
    assert not {"compiled_step", "compiled_batch_step", "compiled_beam_step"} & set(vars(model))
    assert type(model) is Transformer


@pytest.mark.slow
def test_a_switch_between_paths_hands_back_what_is_idle(
    step: CompiledStep,
    batch_step: CompiledStep,
    beam_step: CompiledStep,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import aiayn.accel.decoding as decoding

    released: list[Path] = []
    monkeypatch.setattr(decoding, "release_file_pages", lambda p, cached: released.append(p) or 0)
    model = packing_model()
    acceleration = accelerate(model, "decode", precision="fp32")
    few = use_compiled_step(model, acceleration, False, print)
    many, beams = model.compiled_batch_step, model.compiled_beam_step
    assert few is not None and many is not None and beams is not None
    assert not few.idle and not many.idle and not beams.idle
    memory = torch.zeros(MAX_ROWS // 4 + 1, 3, 32)
    with torch.inference_mode():
        model.init_cache(memory[:1], None, 5, beam_size=4)  # few rows
        assert released == [many.path, beams.path]  # the others idle
        eager = torch.zeros(MAX_ROWS // 3 + 1, 3, 32)  # eager: beam 3 over many rows
        model.init_cache(eager, None, 5, beam_size=3)
        model.init_cache(eager, None, 5, beam_size=3)
        assert few.idle and many.idle and beams.idle
        assert released[2:] == [few.path]
        model.init_cache(memory[:1], None, 5, beam_size=4)
        model.init_cache(memory[:2], None, 5, beam_size=4)
        assert not few.idle and len(released) == 3
        model.init_cache(torch.zeros(MAX_ROWS + 1, 3, 32), None, 5)  # greedy, many rows
        assert not many.idle and released[3:] == [few.path]
        model.init_cache(memory, None, 5, beam_size=4)  # beam 4 over many rows
        assert not beams.idle and released[4:] == [many.path]
    acceleration.undo()


@pytest.mark.slow
def test_left_out_the_weights_stay_the_loaders_copy(
    model: Transformer, step: CompiledStep, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without "compiled weights read in place" the steps keep their loader's copy of the
    weights, hand no pages back, and decode as with the weights in place."""
    import aiayn.accel.decoding as decoding

    released: list[Path] = []
    monkeypatch.setattr(decoding, "release_file_pages", lambda p, cached: released.append(p) or 0)
    copy = packing_model()  # the module model's weights: its libraries serve it
    lever = "compiled weights read in place"
    acceleration = accelerate(copy, "decode", precision="fp32", disable={lever})
    few = use_compiled_step(copy, acceleration, False, print)
    assert few is not None and few.constants is None and step.constants is not None
    assert "compiled decoder step" in acceleration.levers and lever not in acceleration.levers
    with torch.inference_mode():
        copy.init_cache(torch.zeros(MAX_ROWS + 1, 3, 32), None, 5)  # another library serves
    assert released == [] and not few.idle
    assert decode(copy, few, 1, 4) == decode(model, step, 1, 4)
    acceleration.undo()
    placed = accelerate(copy, "decode", precision="fp32")
    assert use_compiled_step(copy, placed, False, print) is not None
    assert lever in placed.levers
    placed.undo()


def test_what_it_does_not_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    base = dict(vocab_size=50, d_model=32, d_ff=64, n_heads=4, n_layers=1)
    assert unsupported(packing_model()) is None
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__version__", "2.11.0+cu130")
        assert "verified with PyTorch 2.13 only (this is 2.11.0+cu130)" in str(
            unsupported(packing_model())
        )
    assert "full attention" in str(
        unsupported(Transformer(ModelConfig(**base, decoder_attention="local")))
    )
    assert "float32" in str(unsupported(packing_model().to(torch.bfloat16)))
    assert "Transformer" in str(unsupported(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="cannot compile the decoder step"):
        compile_step(packing_model().to(torch.bfloat16))


@pytest.mark.slow
def test_a_translator_finds_it_and_translates_as_without(
    step: CompiledStep,
    batch_step: CompiledStep,
    beam_step: CompiledStep,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiayn.config import DecodeConfig
    from aiayn.inference.translator import Translator

    # Six lines: beam 4 over 24 rows, through the beam library.
    lines = ["abc de", "fgh", "a b c d e f", "", "hgf edc", "b"]
    steps = 0
    run = CompiledStep.log_probs_step

    def counted(self: CompiledStep, *args: object) -> torch.Tensor:
        nonlocal steps
        steps += 1
        return run(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(CompiledStep, "log_probs_step", counted)
    for beam in (1, 4):
        found = {}
        for setting in (None, False):
            decode = DecodeConfig(beam_size=beam, max_len_a=0, max_len_b=12)
            translator = Translator(
                packing_model(), LetterTokenizer(), decode, nbest=beam, compiled_step=setting
            )
            assert translator.acceleration is not None
            uses = "compiled decoder step" in translator.acceleration.levers
            assert uses == (setting is None)  # found: the same weights as the module's model
            # With the three libraries the products they hold are not packed.
            held = library_products(translator.model)
            assert bool(held) == uses
            assert all(getattr(m, "pack", None) is None for m in held)
            found[setting] = translator.translate_nbest(lines)
        for compiled, eager in zip(found[None], found[False], strict=True):
            assert [h.tokens for h in compiled] == [h.tokens for h in eager]
            assert [h.score for h in compiled] == pytest.approx([h.score for h in eager], abs=1e-4)
        assert any(h.tokens for hyps in found[None] for h in hyps)
    assert steps > 12  # the decodes with the step went through it
    warnings: list[str] = []
    letters = LetterTokenizer()
    Translator(
        packing_model(), letters, accelerated=False, compiled_step=True, warn=warnings.append
    )
    assert len(warnings) == 1 and "accelerated=False" in warnings[0]
    warnings.clear()
    Translator(packing_model(), LetterTokenizer(), compiled_step=True, warn=warnings.append)
    assert warnings == []  # both found: nothing compiled, nothing to say
    # Loaded before the weights are packed: its loading transient does not meet the packs.
    levers = Translator(packing_model(), letters, pack_weights=True).acceleration.levers
    packed = [i for i, lever in enumerate(levers) if lever.startswith("packed weights")]
    assert packed and levers.index("compiled decoder step") < packed[0], levers


@pytest.mark.parametrize(
    ("flag", "setting"), [([], None), (["--compiled-step"], True), (["--no-compiled-step"], False)]
)
def test_the_command_line_passes_the_setting(
    flag: list[str], setting: bool | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from aiayn.inference.translator import Translator
    from tests.helpers import loader_settings

    source = tmp_path / "in.txt"
    source.write_text("abc\n", encoding="utf-8")
    command = ["translate", str(tmp_path / "m.pt"), "-i", str(source), "--device", "cpu", *flag]
    seen = loader_settings(monkeypatch, Translator, command)
    assert seen["compiled_step"] is setting
    assert seen["mmap"] is True  # the checkpoint mapped unless --no-mmap
    assert loader_settings(monkeypatch, Translator, [*command, "--no-mmap"])["mmap"] is False


def without_index(step: CompiledStep, model: Transformer, folder: Path) -> CompiledStep:
    """``step``'s library copied into ``folder`` with no index beside it, loaded for ``model``:
    its runner reads the loader's copy of the weights."""
    copied = folder / step.path.name
    shutil.copy(step.path, copied)
    if extern_calls(step.path).exists():  # the calls of aiayn's own product (accel.panels)
        shutil.copy(extern_calls(step.path), extern_calls(copied))
    loaded = CompiledStep(copied, model)
    assert loaded.constants is None
    return loaded


def five_steps(model: Transformer, compiled: CompiledStep) -> torch.Tensor:
    """The log-probabilities of five steps of three sentences, beam 2, through ``compiled``."""
    src, src_pad = sources(3, 9)
    with torch.inference_mode():
        memory = model.encode(src, src_pad)
        cache = compiled.init_cache(model, memory, src_pad, 6, 2)
        tokens = torch.ones(6, dtype=torch.long)
        # Each step's copied at once: the cache keeps one buffer for them.
        return torch.stack([compiled.log_probs_step(tokens, cache).clone() for _ in range(5)])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_the_weights_are_read_from_the_librarys_file(
    model: Transformer, step: CompiledStep, tmp_path: Path
) -> None:
    """The runner's constants are views of the library's file (the loader's copy is freed),
    and the step's log-probabilities with them are those with the copy, to the bit."""
    from aiayn.accel.library_constants import data_pointer, index_path
    from aiayn.accel.memory import file_mappings

    assert index_path(step.path).is_file() and trusted(index_path(step.path))
    assert step.constants  # the decoder layers' weights and more
    spans = [(lo, hi) for lo, hi, name in file_mappings() if name == str(step.path)]
    in_use = step.runner.extract_constants_map(False)  # what the runner reads now
    # Autotuning may pick oneDNN's packed product for some weights (it does on CPUs with
    # AMX): those have no data_ptr(), hence data_pointer.
    assert in_use and all(
        any(lo <= data_pointer(t) < hi for lo, hi in spans) for t in in_use.values()
    )
    with_copy = without_index(step, model, tmp_path)
    copied = with_copy.path
    assert torch.equal(five_steps(model, with_copy), five_steps(model, step))
    assert decode(model, with_copy, 1, 4) == decode(model, step, 1, 4)
    # An index that does not fit the library leaves the copy; each case keeps the rest.
    index = index_path(copied)
    good = json.loads(index_path(step.path).read_text())
    first, rest = good["constants"][0], good["constants"][1:]
    buffer = next(c for c in good["constants"] if c["name"] == "positions_table")
    # Two constants of one size and other values, each the only one of its original name
    # (those the loader's copy is compared with when the library loads).
    fqns = step.runner.get_constant_names_to_original_fqns()
    alone = {n for n, f in fqns.items() if list(fqns.values()).count(f) == 1}
    x, y = next(
        (a, b)
        for a in good["constants"]
        for b in good["constants"]
        if a["name"] in alone
        and b is not a
        and a["nbytes"] == b["nbytes"]
        and not torch.equal(
            step.constants[a["name"]].flatten(), step.constants[b["name"]].flatten()
        )
    )
    moved = [{**c, "offset": y["offset"]} if c is x else c for c in good["constants"]]
    for broken in (
        {**good, "length": good["length"] + 1},
        {**good, "version": 0},
        {**good, "constants": rest},  # a parameter missing
        {**good, "constants": [c for c in good["constants"] if c is not buffer]},  # a buffer
        {**good, "constants": [{**first, "offset": good["length"]}, *rest]},
        {**good, "constants": [{**first, "nbytes": 4}, *rest]},  # too few bytes
        {**good, "constants": [{**first, "storage_offset": -1}, *rest]},
        {**good, "constants": [{**first, "dtype": "float64"}, *rest]},
        {**good, "constants": moved},  # another's bytes
        [],
    ):
        index.write_text(json.dumps(broken))
        index.chmod(0o600)
        fallback = CompiledStep(copied, model)
        assert fallback.constants is None
        assert torch.equal(five_steps(model, fallback), five_steps(model, step))
    index.write_text("not json")
    assert CompiledStep(copied, model).constants is None
    index.write_text(json.dumps(good))
    assert CompiledStep(copied, model).constants is not None  # the same library
    index.chmod(0o666)  # others may write it
    assert CompiledStep(copied, model).constants is None


@pytest.mark.slow
def test_weights_packed_for_onednn_are_read_from_the_file_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where freezing packs a product's weight for oneDNN (blocks that strides do not
    describe: Inductor's ATen products, as without autotuning), the runner reads those from
    the library's file too, and the step's log-probabilities are those with the copy."""
    from aiayn.accel import compiled
    from aiayn.accel.library_constants import data_pointer
    from aiayn.accel.memory import file_mappings

    monkeypatch.setenv("AIAYN_CACHE", str(tmp_path))
    monkeypatch.setattr(compiled, "_INDUCTOR", {**compiled._INDUCTOR, "max_autotune": False})
    monkeypatch.setattr(panels, "cpu_suits", lambda: False)  # products of Inductor's own
    fresh = packing_model()
    accelerate(fresh, "decode", precision="fp32")
    step = compile_step(fresh)
    assert step.constants is not None
    in_use = step.runner.extract_constants_map(False)
    packed = [t for t in in_use.values() if t.is_mkldnn]
    assert len(packed) == 12  # the two layers' six products each
    spans = [(lo, hi) for lo, hi, name in file_mappings() if name == str(step.path)]
    assert all(any(lo <= data_pointer(t) < hi for lo, hi in spans) for t in in_use.values())
    (tmp_path / "copy").mkdir(mode=0o700)
    with_copy = without_index(step, fresh, tmp_path / "copy")
    assert torch.equal(five_steps(fresh, with_copy), five_steps(fresh, step))


@pytest.mark.parametrize("pack_weights", [False, True])
def test_the_products_the_libraries_hold_are_not_packed(pack_weights: bool) -> None:
    """A model given its three libraries: the decoder's products that the libraries hold are
    not packed (each decode they serve reads the libraries' copies), whether the other
    float32 weights are packed or not (``pack_weights=False`` is the default where MKL is the
    CPU's float32 library, as on Intel CPUs)."""
    from aiayn.accel import compiled

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=300, d_model=32, d_ff=64, n_heads=4, n_layers=1)
    model = Transformer(config).eval()

    def give_libraries(acceleration: Acceleration) -> None:
        # Stand-ins: only whether the model has all three is read while accelerating.
        for name in compiled._ATTRIBUTES:
            acceleration._set(model, name, object())

    accelerate(model, "decode", pack_weights=pack_weights, before_packing=give_libraries)
    held = library_products(model)
    assert held and all(getattr(m, "pack", None) is None for m in held)
    if pack_weights:  # the encoder's are
        assert getattr(model.encoder.layers[0].ffn.w1, "pack", None) is not None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_file_pages_are_handed_back_and_read_again(tmp_path: Path) -> None:
    """What the loader leaves mapped of a library is advised away; nothing is lost."""
    import mmap

    from aiayn.accel.memory import release_file_pages

    path = tmp_path / "blob.bin"
    data = bytes(range(256)) * (8 << 12)  # 8 MiB
    path.write_bytes(data)
    with path.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    try:
        assert mapped[:] == data  # every page read in
        assert release_file_pages(path) == len(data)
        assert mapped[:] == data
        assert release_file_pages(tmp_path / "other.bin") == 0
    finally:
        mapped.close()


@pytest.mark.slow
def test_a_training_run_ends_with_the_step_that_translate_then_uses(
    cache_dir: Path,
    reverse_data_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiayn.accel import compiled
    from aiayn.cli import main

    # Without autotuning the products: the same library otherwise, compiled in less time; and
    # the first two libraries only (the path from training to translate is what is checked).
    monkeypatch.setattr(compiled, "_INDUCTOR", compiled._INDUCTOR | {"max_autotune": False})
    monkeypatch.setattr(compiled, "LIBRARIES", compiled.LIBRARIES[:2])
    monkeypatch.setattr(compiled, "_ATTRIBUTES", compiled._ATTRIBUTES[:2])
    from aiayn.inference.translator import Translator
    from tests.helpers import TINY

    run = tmp_path / "run"
    args = ["train", "--config", TINY, "--data", str(reverse_data_dir), "--out", str(run)]
    quick = ["--no-progress", "--device", "cpu", "train.max_steps=2", "train.valid_interval=0"]
    assert main([*args, *quick]) == 0  # the tiny recipe does not compile
    assert "decoder step compiled" not in capsys.readouterr().out
    assert main([*args, *quick, "train.max_steps=3", "train.compile_step=true"]) == 0
    assert "decoder step compiled for translate on this machine" in capsys.readouterr().out
    translator, _ = Translator.from_checkpoint(run)  # compiled_step=None: found, not built
    assert translator.acceleration is not None
    assert "compiled decoder step" in translator.acceleration.levers
    model = translator.model
    assert isinstance(model, BufferedDecoding)  # both libraries, the second built after the first
    assert model.compiled_step is not None and model.compiled_batch_step is not None


@pytest.mark.parametrize("one_buffer", [True, False])
def test_reorder_moves_the_decoded_positions_of_the_rows_that_change(one_buffer: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    layers, rows, heads, slots, dk, length = 2, 4, 2, 6, 3, 4
    kv = torch.randn(2, layers, rows, heads, slots, dk, generator=gen)
    own = kv.clone()
    parts = (
        [list(own[0]), list(own[1])] if one_buffer else [list(kv[0].clone()), list(kv[1].clone())]
    )
    cross = torch.zeros(rows, heads, 5, dk)
    mask = torch.ones(rows, 1, 1, 5, dtype=torch.bool)
    cache = CompiledCache(
        None,  # type: ignore[arg-type]  # the step is not used by reorder
        *parts,
        [cross] * layers,
        [cross] * layers,
        mask,
        length,
        slots,
        4,
        self_kv=own if one_buffer else None,
    )
    expected = kv.clone()
    for order in ([0, 1, 2, 3], [0, 0, 2, 3], [0, 1, 3, 3], [2, 0, 1, 1], [0, 1, 2, 3]):
        cache.reorder(torch.tensor(order))
        expected[:, :, :, :, :length] = expected[:, :, order, :, :length]
        got = torch.stack([torch.stack(cache.self_k), torch.stack(cache.self_v)])
        assert torch.equal(got, expected)  # the positions after `length` never move


def test_the_steps_copy_takes_the_relu_in_the_panels_product_where_it_can() -> None:
    """panels.PanelFeedForward.of: a plain ReLU feed-forward layer whose first product is a
    PanelLinear becomes one over the same sublayers; any other layer stays as it is."""
    from aiayn.accel.panels import PanelFeedForward, PanelLinear
    from aiayn.model.feedforward import PositionwiseFeedForward

    def ffn(activation: str = "relu", panel: bool = True) -> PositionwiseFeedForward:
        layer = PositionwiseFeedForward(8, 32, relu_dropout=0.1, activation=activation)
        if panel:
            layer.w1 = PanelLinear(8, 32, True, "meta")
        return layer

    plain = ffn()
    made = PanelFeedForward.of(plain)
    assert type(made) is PanelFeedForward
    assert (made.w1, made.w2, made.dropout) == (plain.w1, plain.w2, plain.dropout)
    assert PanelFeedForward.of(ffn("gelu")) is None
    assert PanelFeedForward.of(ffn(panel=False)) is None
    assert PanelFeedForward.of(made) is None  # a subclass: not a plain layer
    assert PanelFeedForward.of(torch.nn.Linear(8, 8)) is None
