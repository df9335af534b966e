"""The contract of aiayn.accel.accelerate: the accelerated model gives the plain model's values
(bit for bit, or to the tolerances stated here), forward, backward and decoding; it keeps the
same parameters and state dict; undo() restores the plain model; and nothing of it happens
without the explicit call."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from aiayn.accel import (
    CpuLinear,
    Float32Attention,
    GridDropout,
    GridResidual,
    accelerate,
    cpu_has_bfloat16,
)
from aiayn.accel.cpu import private_ops_unverified
from aiayn.accel.linear import LogitsBuffer, Pack, logits_into, onednn_packing_available
from aiayn.config import ModelConfig
from aiayn.inference.search import beam_search
from aiayn.model.attention import MultiHeadAttention
from aiayn.model.layers import Residual
from aiayn.model.transformer import Transformer
from tests.helpers import LetterTokenizer

needs_bf16 = pytest.mark.skipif(
    not (onednn_packing_available() and cpu_has_bfloat16()),
    reason="PyTorch without oneDNN's packed-linear operators, or a CPU without bfloat16",
)

# The paths of an Intel CPU, where float32 weights are not packed unless asked; on other CPUs
# they are, for oneDNN (tests/accel/test_linear_onednn.py). One thread: these tests compare
# bits, and a product split over two threads need not round alike from call to call (MKL may
# change its split between calls; the plain and accelerated models once differed so in a run).
pytestmark = pytest.mark.usefixtures("intel_cpu", "single_thread")


def _model(dropout: float = 0.0, pre_norm: bool = False) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=50,
        d_model=32,
        d_ff=64,
        n_heads=4,
        n_layers=2,
        dropout=dropout,
        relu_dropout=dropout,
        pre_norm=pre_norm,
    )
    return Transformer(config)


def _batch() -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(4, 50, (3, 9), generator=gen)
    src_pad = torch.zeros_like(src, dtype=torch.bool)
    src_pad[0, 6:] = True
    return src, src_pad, torch.randint(4, 50, (3, 7), generator=gen)


def _forward_backward(model: Transformer) -> tuple[Tensor, list[Tensor]]:
    src, src_pad, tgt = _batch()
    model.zero_grad(set_to_none=True)
    logits = model(src, src_pad, tgt)
    logits.float().logsumexp(-1).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _classes(model: nn.Module) -> list[type]:
    return [type(m) for m in model.modules()]


@pytest.mark.parametrize("pre_norm", [False, True])
def test_training_in_fp32_without_dropout_is_bit_identical(pre_norm: bool) -> None:
    plain, fast = _model(pre_norm=pre_norm).train(), _model(pre_norm=pre_norm).train()
    acceleration = accelerate(fast, "train")
    assert GridResidual in _classes(fast) and GridDropout in _classes(fast)
    want_logits, want_grads = _forward_backward(plain)
    got_logits, got_grads = _forward_backward(fast)
    assert torch.equal(got_logits, want_logits)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads, strict=True))
    acceleration.undo()


def test_training_with_dropout_is_the_plain_model_in_eval_and_drops_in_train() -> None:
    plain, fast = _model(dropout=0.3), _model(dropout=0.3)
    accelerate(fast, "train")
    src, src_pad, tgt = _batch()
    with torch.no_grad():
        assert torch.equal(fast.eval()(src, src_pad, tgt), plain.eval()(src, src_pad, tgt))
        fast.train()
        torch.manual_seed(3)
        first = fast(src, src_pad, tgt)
        torch.manual_seed(3)
        assert torch.equal(fast(src, src_pad, tgt), first)  # from the generator's state
        assert not torch.equal(first, fast.eval()(src, src_pad, tgt))


def test_parameters_and_state_dict_stay_and_undo_restores_the_plain_model() -> None:
    plain, fast = _model(dropout=0.1), _model(dropout=0.1)
    params = list(fast.parameters())
    state = fast.state_dict()
    acceleration = accelerate(fast, "train", precision="bf16")
    assert list(fast.parameters()) == params
    assert fast.state_dict().keys() == state.keys()
    assert all(torch.equal(fast.state_dict()[k], v) for k, v in state.items())
    assert {Float32Attention, CpuLinear, GridDropout, GridResidual} <= set(_classes(fast))
    assert acceleration.levers
    acceleration.undo()
    assert _classes(fast) == _classes(plain)
    assert not {Float32Attention, CpuLinear, GridDropout, GridResidual} & set(_classes(fast))
    assert {MultiHeadAttention, nn.Linear, nn.Dropout, Residual} <= set(_classes(fast))
    assert acceleration.levers == []
    src, src_pad, tgt = _batch()
    with torch.no_grad():
        assert torch.equal(fast.eval()(src, src_pad, tgt), plain.eval()(src, src_pad, tgt))


def test_decoding_in_fp32_is_bit_identical() -> None:
    plain, fast = _model().eval(), _model().eval()
    # Unpacked, as on an Intel CPU (packed weights agree to float32 rounding only).
    with accelerate(fast, "decode", pack_weights=False) as acceleration:
        assert acceleration.mode == "decode"
        assert _hypotheses(fast) == _hypotheses(plain)
        assert torch.equal(_steps(fast), _steps(plain))


def test_a_packed_projection_frees_the_last_steps_log_probabilities_first() -> None:
    """A packed product allocates its output: the step before's is gone when the next is
    made (search lets go of it once it has chosen its candidates)."""
    import weakref

    from aiayn.accel.linear import packing_available

    if not packing_available():
        pytest.skip("this PyTorch has no MKL packed-linear operators")
    model = _model().eval()
    made: list[weakref.ref[Tensor]] = []
    with accelerate(model, "decode", pack_weights=True):
        projection = model.out_proj
        assert isinstance(projection, CpuLinear) and projection.pack_serves()
        product = projection.product_through  # what the decoder step's projection calls

        def watched(pack: Pack, x: Tensor) -> Tensor:
            assert all(ref() is None for ref in made)
            out = product(pack, x)
            assert out is not None
            made.append(weakref.ref(out))
            return out

        projection.product_through = watched  # type: ignore[method-assign]
        _hypotheses(model)
        del projection.product_through
    assert len(made) > 3


def test_the_projection_is_written_into_the_caches_one_buffer() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(5, 8)
    plain = nn.Linear(8, 11, bias=False)
    cache = LogitsBuffer()
    with torch.no_grad():
        first = logits_into(plain, hidden, cache)
        assert first is not None and torch.equal(first, plain(hidden))
        where, first = first.data_ptr(), first.clone()
        fewer = logits_into(plain, hidden[:3], cache)  # sentences finished: the same buffer
        assert fewer is not None and fewer.data_ptr() == where
        assert_close(fewer, first[:3])
        # What is not a plain product without bias is the caller's to project.
        assert logits_into(nn.Linear(8, 11), hidden, cache) is None
        hooked = nn.Linear(8, 11, bias=False)
        hooked.register_forward_hook(lambda *_: None)
        assert logits_into(hooked, hidden, cache) is None
        assert logits_into(nn.Identity(), hidden, cache) is None
        with torch.autocast("cpu", dtype=torch.bfloat16):  # mm(out=) would skip it
            assert logits_into(plain, hidden, cache) is None


def _steps(model: Transformer) -> Tensor:
    src, src_pad, tgt = _batch()
    with torch.inference_mode():
        cache = model.init_cache(model.encode(src, src_pad), src_pad, max_len=7)
        # each step's result copied at once: the accelerated model reuses one buffer
        return torch.stack([model.log_probs_step(tgt[:, t], cache).clone() for t in range(6)])


def _hypotheses(model: Transformer) -> list[list[list[int]]]:
    src, src_pad, _ = _batch()
    with torch.inference_mode():
        cache = model.init_cache(model.encode(src, src_pad), src_pad, max_len=12, beam_size=4)
        hyps = beam_search(model.log_probs_step, cache, 3, beam_size=4, max_len=11, nbest=2)
    return [[h.tokens for h in sentence] for sentence in hyps]


# bfloat16: the accelerated model attends in float32 and keeps a float32 cache where the plain
# one rounds to bfloat16; both are compared with the float32 model, and the accelerated one
# must be no further from it than bfloat16 rounding allows (2^-8 relative, a few roundings).
BF16_TOLERANCE = {"rtol": 3e-2, "atol": 3e-2}


@needs_bf16
def test_training_in_bf16_is_the_plain_model_to_bf16_rounding() -> None:
    reference, plain, fast = _model().train(), _model().train(), _model().train()
    accelerate(fast, "train", precision="bf16")
    want_logits, want_grads = _forward_backward(reference)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_logits, plain_grads = _forward_backward(plain)
        got_logits, got_grads = _forward_backward(fast)
    assert got_logits.dtype == plain_logits.dtype == torch.bfloat16
    assert_close(got_logits.float(), want_logits, **BF16_TOLERANCE)
    assert_close(got_logits.float(), plain_logits.float(), **BF16_TOLERANCE)

    # The gradient: no further from float32's than plain autocast's (over the whole model,
    # and each parameter within twice that or 1% of its norm).
    def error(grads: list[Tensor]) -> Tensor:
        return torch.stack([(g - w).norm() for g, w in zip(grads, want_grads, strict=True)])

    ours, theirs = error(got_grads), error(plain_grads)
    norms = torch.stack([w.norm() for w in want_grads])
    assert float(ours.norm()) <= 1.1 * float(theirs.norm())
    assert bool((ours <= torch.maximum(2 * theirs, 1e-2 * norms)).all())


@needs_bf16
def test_decoding_in_bf16_is_the_plain_model_to_bf16_rounding() -> None:
    reference, plain, fast = _model().eval(), _model().eval(), _model().eval()
    plain.to(torch.bfloat16)
    fast.to(torch.bfloat16)
    acceleration = accelerate(fast, "decode", precision="bf16")
    assert acceleration.packed == sum(isinstance(m, nn.Linear) for m in fast.modules())
    src, src_pad, _ = _batch()
    with torch.inference_mode():
        cache = fast.init_cache(fast.encode(src, src_pad), src_pad, max_len=7)
    assert {cache.layers[0].self_k.dtype, cache.layers[0].cross_k.dtype} == {torch.float32}
    want, got = _steps(reference), _steps(fast)
    assert got.dtype == torch.float32
    assert_close(got, want, **BF16_TOLERANCE)
    assert_close(got, _steps(plain), **BF16_TOLERANCE)


# The packed products' operators are used with the PyTorch they were verified with only.
PACKS_VERIFIED = pytest.mark.skipif(
    private_ops_unverified() is not None, reason=str(private_ops_unverified())
)


@PACKS_VERIFIED
def test_calls_add_up_and_each_undoes_its_own() -> None:
    plain, model = _model().eval(), _model().eval()
    first = accelerate(model, "decode")
    second = accelerate(model, "decode", pack_weights=True)
    assert "grid dropout" in first.levers and second.packed > 0
    assert "grid dropout" not in second.levers  # nothing plain was left of it
    assert _hypotheses(model) == _hypotheses(plain)
    second.undo()
    assert not any(isinstance(m, CpuLinear) for m in model.modules())
    assert GridResidual in _classes(model)
    first.undo()
    assert _classes(model) == _classes(plain)


@PACKS_VERIFIED
def test_a_later_call_packs_and_pads_the_layers_an_earlier_one_swapped() -> None:
    model = _model().eval()
    first = accelerate(model, "decode", pack_weights=True)
    assert first.packed > 0
    again = accelerate(model, "decode", pack_weights=True)
    assert again.packed == first.packed and again.levers == []  # the packs serve: nothing new
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    float_packs = [m.pack for m in linears]
    model.to(torch.bfloat16)  # the float32 packs no longer match the weights
    bf16 = accelerate(model, "decode", precision="bf16")
    assert "padded bfloat16 rows" in bf16.levers and all(m.pad_bf16_rows for m in linears)
    if cpu_has_bfloat16():
        assert bf16.packed == len(linears)
        assert all(m.pack is not None and m.pack.kind == "onednn" for m in linears)
    else:  # bfloat16 packs only where the CPU multiplies bfloat16 itself
        assert bf16.packed == 0
    bf16.undo()  # the first call's packs and settings come back
    assert [m.pack for m in linears] == float_packs
    assert not any(m.pad_bf16_rows for m in linears)
    first.undo()
    again.undo()
    assert not any(isinstance(m, CpuLinear) for m in model.modules())


def test_undo_leaves_a_module_that_was_swapped_again_since() -> None:
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, weight: Tensor) -> Tensor:
            return 2 * weight

    model = _model().eval()
    acceleration = accelerate(model, "decode", pack_weights=True)
    layer = model.decoder.layers[0].ffn.w1
    parametrize.register_parametrization(layer, "weight", Double())  # its class changes again
    acceleration.undo()
    assert isinstance(layer, CpuLinear)  # left to its parametrization, not broken
    src, src_pad, tgt = _batch()
    with torch.no_grad():
        model(src, src_pad, tgt)


def test_a_model_elsewhere_than_the_cpu_is_left_as_it_is() -> None:
    model = _model().to("meta")
    acceleration = accelerate(model, "train", precision="fp16")
    assert acceleration.levers == [] and not any(
        isinstance(m, (GridDropout, CpuLinear)) for m in model.modules()
    )


def test_bad_calls_are_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match="mode"):
        accelerate(model, "serve")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="precision"):
        accelerate(model, "train", precision="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pack_weights"):
        accelerate(model, "train", pack_weights=True)
    with pytest.raises(ValueError, match="fp16"):
        accelerate(model, "train", precision="fp16")
    with pytest.raises(ValueError, match="weights"):
        accelerate(model, "decode", precision="bf16")  # the weights are float32


def test_trainer_and_translator_accelerate_on_the_cpu_unless_asked_not_to(tmp_path) -> None:
    from aiayn.config import load_config
    from aiayn.inference.translator import Translator
    from aiayn.training.trainer import Trainer

    config = load_config(None, ["preset=tiny", "model.vocab_size=50"])
    for accelerated in (True, False):
        model = Transformer(config.model)
        trainer = Trainer(
            config,
            model,
            [],
            [],
            tmp_path / str(accelerated),  # type: ignore[arg-type]
            show_progress=False,
            tensorboard=False,
            accelerated=accelerated,
        )
        assert (GridResidual in _classes(model)) is accelerated
        if trainer.acceleration is not None:
            trainer.acceleration.undo()
        translator = Translator(
            _model().eval(),
            LetterTokenizer(),
            accelerated=accelerated,  # type: ignore[arg-type]
        )
        assert (translator.acceleration is not None) is accelerated
        assert translator.engine_details()["accelerated"] is accelerated
        if translator.acceleration is not None:
            translator.acceleration.undo()


def test_a_translator_accelerates_the_precision_its_model_has() -> None:
    from aiayn.inference.translator import Translator

    half = _model().eval().half()  # fp16 weights on the CPU: decoded plain, slowly, as given
    translator = Translator(half, LetterTokenizer())  # type: ignore[arg-type]
    assert translator.acceleration is None
    if cpu_has_bfloat16() and onednn_packing_available():
        model = _model().eval().to(torch.bfloat16)
        translator = Translator(model, LetterTokenizer())  # type: ignore[arg-type]  # default precision
        assert translator.acceleration is not None
        assert "attention in float32" in translator.acceleration.levers
        assert len(translator.translate(["hello"])) == 1


def test_closing_the_trainer_gives_the_plain_model_and_the_malloc_setting_back(
    tmp_path: Path,
) -> None:
    from aiayn.accel import memory
    from aiayn.config import load_config
    from aiayn.training.trainer import Trainer

    config = load_config(None, ["preset=tiny", "model.vocab_size=50"])
    model = Transformer(config.model)
    before = memory.in_force()
    trainer = Trainer(config, model, [], [], tmp_path, show_progress=False, tensorboard=False)  # type: ignore[arg-type]
    assert GridResidual in _classes(model)
    trainer.close()
    assert GridResidual not in _classes(model) and Residual in _classes(model)
    assert memory.in_force() == before


# What a fresh process has after importing aiayn and building its objects without the
# explicit call: no module swapped, no malloc setting, no optimizer hook.
_NO_SIDE_EFFECTS = """
import torch
import aiayn, aiayn.inference.translator, aiayn.training.trainer
from aiayn.accel import memory
from aiayn.accel.linear import optimizer_hook_registered
from aiayn.config import load_config
from aiayn.model.transformer import Transformer
from tests.helpers import LetterTokenizer
model = Transformer(load_config(None, ["preset=tiny"]).model)
model(torch.randint(4, 60, (2, 5)), None, torch.randint(4, 60, (2, 4)))
classes = {type(m).__module__ for m in model.modules()}
print(memory.in_force() is None, not optimizer_hook_registered(), classes)
"""


def test_nothing_happens_without_the_explicit_call() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _NO_SIDE_EFFECTS], capture_output=True, text=True, check=True
    ).stdout.split(" ", 2)
    assert out[:2] == ["True", "True"]
    assert "aiayn.accel" not in out[2]


def test_deepcopy_keeps_the_swaps_but_no_pack() -> None:
    model = _model().eval()
    accelerate(model, "decode", pack_weights=True)
    twin = copy.deepcopy(model)
    assert _classes(twin) == _classes(model)
    assert all(m.pack is None for m in twin.modules() if isinstance(m, CpuLinear))
