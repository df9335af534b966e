"""Attention patterns for long sequences (aiayn.model.patterns): the blocked computation equals
attention written out with the pattern's mask; a pattern that covers every position is full
attention; causal patterns never see the future; cached decoding equals the full forward.
Linformer and LSH: equal to full attention where they cover everything, padding ignored, LSH
equal to its written-out union of rounds, Linformer refused where it would be causal."""

import re
from typing import get_args

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from aiayn.accel import Float32Attention, accelerate
from aiayn.config import AttentionName, ModelConfig, config_from_dict, load_config
from aiayn.errors import ConfigError, UserError
from aiayn.inference.attention_maps import attention_weights
from aiayn.model.attention import naive_attention
from aiayn.model.families import DecoderOnlyLM, EncoderOnly
from aiayn.model.patterns import (
    PATTERNS,
    BlockPattern,
    LinformerPattern,
    LSHPattern,
    make_pattern,
)
from aiayn.model.transformer import Transformer
from aiayn.training import averaging
from aiayn.training import checkpoint as ckpt
from aiayn.training.pretrained import pretrained_weights
from tests.helpers import small_reverse_trainer, tiny_config

SETTINGS = {"window": 3, "n_global": 2, "block": 4, "n_random": 2}
NAMES = ("local", "longformer", "bigbird")


def _qkv(t: int = 37, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, t, 8, generator=generator) for _ in range(3))


def _pad(t: int) -> torch.Tensor:
    pad = torch.zeros(2, t, dtype=torch.bool)
    pad[1, t - 9 :] = True  # the second sequence is 9 positions shorter
    return pad


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_blocked_attention_equals_the_pattern_written_out(name, causal):
    pattern = make_pattern(name, **SETTINGS)
    assert pattern is not None
    q, k, v = _qkv()
    pad = _pad(37)
    ours = pattern(q, k, v, pad, causal, 0.0)
    seen = pattern.allowed(37, causal, q.device)
    expected, _ = naive_attention(q, k, v, seen[None, None] & ~pad[:, None, None, :])
    real = ~pad  # the outputs of padding positions are never used
    assert_close(ours[0], expected[0], atol=1e-5, rtol=1e-5)
    assert_close(ours[1][:, real[1]], expected[1][:, real[1]], atol=1e-5, rtol=1e-5)
    # the pattern is sparse: far fewer keys than full attention
    assert seen.float().mean() < 0.7
    if causal:
        assert not seen.triu(1).any()


def test_what_each_pattern_sees():
    local = make_pattern("local", **SETTINGS)
    longformer = make_pattern("longformer", **SETTINGS)
    bigbird = make_pattern("bigbird", **SETTINGS)
    assert local is not None and longformer is not None and bigbird is not None
    seen = local.allowed(12, False, torch.device("cpu"))
    assert seen[6].nonzero().flatten().tolist() == [3, 4, 5, 6, 7, 8, 9]
    causal = local.allowed(12, True, torch.device("cpu"))
    assert causal[6].nonzero().flatten().tolist() == [3, 4, 5, 6]
    seen = longformer.allowed(12, False, torch.device("cpu"))
    assert seen[9].nonzero().flatten().tolist() == [0, 1, 6, 7, 8, 9, 10, 11]
    assert seen[1].all() and seen[:, 0].all()  # global tokens see and are seen by all
    seen = bigbird.allowed(40, False, torch.device("cpu"))
    blocks = seen.view(10, 4, 10, 4).any(3).any(1)  # (query block, key block)
    assert blocks[0].all() and blocks[:, 0].all()  # the global block
    for i in range(1, 10):
        near = {j for j in (i - 1, i, i + 1) if 0 <= j < 10}
        others = set(blocks[i].nonzero().flatten().tolist()) - near - {0}
        assert len(others) == 2  # its random blocks
    # the random blocks are the same at every call
    again = make_pattern("bigbird", **SETTINGS)
    assert again is not None and torch.equal(again.allowed(40, False, seen.device), seen)


def test_longformer_global_projections_and_bigbird_global_blocks_as_documented():
    """The two tagged departures from the references: Longformer's global attention has no
    projections of its own (a longformer model has a full-attention model's parameters, name
    for name); bigbird's global blocks are the first ceil(g/b), which every query sees and
    which see every key, and the last block is not global."""
    torch.manual_seed(0)
    full = Transformer(_config())
    torch.manual_seed(0)
    longformer = Transformer(_config(encoder_attention="longformer"))
    assert [n for n, _ in full.named_parameters()] == [n for n, _ in longformer.named_parameters()]
    bigbird = make_pattern("bigbird", **SETTINGS)  # blocks of 4, 2 global tokens: block 0
    assert bigbird is not None
    seen = bigbird.allowed(40, False, torch.device("cpu"))
    assert seen[:, :4].all() and seen[:4].all()
    assert not seen[:, 36:].all() and not seen[36:].all()


@pytest.mark.parametrize("causal", [False, True])
def test_a_pattern_that_covers_every_position_is_full_attention(causal):
    q, k, v = _qkv(t=20)
    pad = _pad(20)
    mask = ~pad[:, None, None, :]
    if causal:
        mask = mask & torch.ones(20, 20, dtype=torch.bool).tril()
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    covering = [
        BlockPattern("local", window=20),  # the window holds the sequence
        BlockPattern("longformer", window=1, n_global=20),  # every token global
        BlockPattern("bigbird", block=32, n_global=1),  # one block
    ]
    real = ~pad[1]
    for pattern in covering:
        ours = pattern(q, k, v, pad, causal, 0.0)
        assert_close(ours[0], full[0], atol=1e-5, rtol=1e-5)
        assert_close(ours[1][:, real], full[1][:, real], atol=1e-5, rtol=1e-5)


def _config(**changes) -> ModelConfig:
    base = {
        "vocab_size": 50,
        "d_model": 32,
        "d_ff": 64,
        "n_heads": 4,
        "n_layers": 2,
        "dropout": 0.0,
        "max_positions": 64,
        "attention_window": 3,
        "attention_global": 2,
        "attention_block": 4,
        "attention_random_blocks": 2,
        "linformer_k": 8,
        "lsh_buckets": 4,
        "lsh_rounds": 2,
        "lsh_chunk": 4,
    }
    return ModelConfig(**{**base, **changes})


@pytest.mark.parametrize("name", [*NAMES, "lsh"])
def test_a_causal_pattern_never_sees_the_future(name):
    torch.manual_seed(0)
    model = DecoderOnlyLM(_config(task="lm", decoder_attention=name)).eval()
    inputs = torch.randint(5, 50, (2, 30))
    changed = inputs.clone()
    changed[:, 17:] = torch.randint(5, 50, (2, 13))
    with torch.no_grad():
        a, b = model(inputs), model(changed)
    assert torch.equal(a[:, :17], b[:, :17])
    assert not torch.equal(a[:, 17:], b[:, 17:])


@pytest.mark.parametrize("name", NAMES)
def test_cached_decoding_equals_the_full_forward(name):
    torch.manual_seed(0)
    model = DecoderOnlyLM(_config(task="lm", decoder_attention=name)).eval()
    inputs = torch.randint(5, 50, (2, 26))
    with torch.no_grad():
        full = torch.log_softmax(model(inputs), dim=-1)
        cache = model.init_cache(2, 26)
        for t in range(26):
            step = model.log_probs_step(inputs[:, t], cache)
            assert_close(step, full[:, t], atol=1e-5, rtol=1e-5)
    # A translation model whose decoder has the pattern, with beams (the lineage mask).
    torch.manual_seed(0)
    model = Transformer(_config(decoder_attention=name, encoder_attention=name)).eval()
    src = torch.randint(5, 50, (1, 15))
    tgt = torch.randint(5, 50, (3, 20))
    tgt[:, 0] = 2
    with torch.no_grad():
        memory = model.encode(src, None)
        full = torch.log_softmax(model(src.expand(3, -1), None, tgt), dim=-1)
        cache = model.init_cache(memory, None, max_len=20, beam_size=3)
        for t in range(20):
            step = model.log_probs_step(tgt[:, t], cache)
            assert_close(step, full[:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [*NAMES, "linformer", "lsh"])
def test_encoder_patterns_train_and_ignore_padding(name):
    torch.manual_seed(0)
    model = EncoderOnly(_config(task="mlm", encoder_attention=name))
    inputs = torch.randint(5, 50, (2, 33))
    pad = torch.zeros(2, 33, dtype=torch.bool)
    pad[1, 20:] = True
    logits = model(inputs, pad)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    layer = model.encoder.layers[0].self_attn
    if name == "linformer":  # E and F learn
        assert isinstance(layer.pattern, LinformerPattern)
        assert layer.pattern.key_proj.grad is not None and layer.pattern.key_proj.grad.any()
        assert layer.pattern.value_proj.grad is not None and layer.pattern.value_proj.grad.any()
    if name == "lsh":  # shared QK: the key projection's rows get nothing
        grad = layer.qkv_proj.weight.grad
        assert grad is not None
        d = layer.n_heads * layer.d_k
        assert grad[:d].any() and not grad[d : 2 * d].any() and grad[2 * d :].any()
    if name == "bigbird":
        return  # its random blocks are drawn among the padded length's blocks
    # The padded row gives what the sentence gives alone.
    model.eval()
    with torch.no_grad():
        alone = model(inputs[1:, :20], pad[1:, :20])
        both = model(inputs, pad)
    assert_close(both[1, :20], alone[0], atol=1e-5, rtol=1e-5)


def test_bfloat16_autocast_runs_the_patterns():
    q, k, v = _qkv()
    low = SETTINGS | {"max_positions": 64, "linformer_k": 16, "lsh_buckets": 4, "lsh_chunk": 8}
    for name, causal in [(name, True) for name in (*NAMES, "lsh")] + [
        ("linformer", False),
        ("lsh", False),
    ]:
        pattern = make_pattern(name, **low)
        assert pattern is not None
        pattern.eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = pattern(q.bfloat16(), k.bfloat16(), v.bfloat16(), _pad(37), causal, 0.0)
        # (LSH: the same buckets as the rounded inputs' in float32)
        rounded = [x.bfloat16().float() for x in (q, k, v)]
        expected = pattern(*rounded, _pad(37), causal, 0.0)
        assert out.dtype == torch.bfloat16
        assert (out[0].float() - expected[0]).abs().max() < 0.05


def test_unknown_settings_are_refused():
    with pytest.raises(ConfigError, match="attention_window"):
        _config(attention_window=0).validate()
    with pytest.raises(ConfigError, match="attention patterns are options of the Transformer"):
        _config(arch="luong", encoder_attention="local").validate()


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_activation_checkpointing_gives_the_same_gradients(task):
    from aiayn.model.families import build_model
    from aiayn.model.transformer import set_activation_checkpointing

    stack = "encoder" if task == "translation" else "decoder"  # an lm has no encoder
    config = _config(
        task=task, dropout=0.1, attention_dropout=0.1, **{f"{stack}_attention": "local"}
    )
    grads = []
    for on in (False, True):
        torch.manual_seed(0)
        model = build_model(config).train()
        set_activation_checkpointing(model, on)
        calls: list[int] = []
        model.decoder.layers[0].register_forward_pre_hook(lambda *_, c=calls: c.append(1))
        torch.manual_seed(1)  # the same dropout masks
        inputs = torch.randint(5, 50, (2, 21))
        if task == "lm":
            out = model(inputs)
        else:
            out = model(inputs, inputs == 0, inputs[:, :15])
        out.float().pow(2).mean().backward()
        assert len(calls) == (2 if on else 1)  # checkpointed: run again in the backward pass
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5), name


@pytest.mark.parametrize("name", ["local", "longformer"])
def test_a_windowed_decoder_keeps_a_ring_and_beam_search_is_unchanged(name, monkeypatch):
    from aiayn.inference.search import beam_search
    from aiayn.model import families, transformer

    torch.manual_seed(0)
    model = Transformer(_config(decoder_attention=name, final_logits_bias=True)).eval()
    with torch.no_grad():
        model.out_proj.bias[3] = -20.0  # EOS unlikely: hypotheses run to the limit
    src = torch.randint(5, 50, (3, 12))
    src_pad = torch.zeros(3, 12, dtype=torch.bool)
    src_pad[2, 7:] = True

    def search() -> tuple[list[list[object]], int]:
        with torch.no_grad():
            memory = model.encode(src, src_pad)
            cache = model.init_cache(memory, src_pad, max_len=31, beam_size=4)
            slots = cache.layers[0].self_k.size(2)
            found = beam_search(
                model.log_probs_step, cache, 3, beam_size=4, max_len=30, nbest=4, rule="fairseq"
            )
        return [[(h.tokens, round(h.score, 4)) for h in hyps] for hyps in found], slots

    ringed, slots = search()
    assert slots == (4 if name == "local" else 6)  # w + 1 (+ g): not max_len
    monkeypatch.setattr(transformer, "window_ring", lambda *_: None)
    monkeypatch.setattr(families, "window_ring", lambda *_: None)
    whole, slots = search()
    assert slots == 31
    assert ringed == whole
    assert all(len(hyps[0][0]) == 30 for hyps in ringed)  # the ring wraps many times


# -- Linformer -------------------------------------------------------------------------------


def test_linformer_with_identity_projections_is_full_attention():
    q, k, v = _qkv(t=20)
    pattern = LinformerPattern(20, max_positions=32)
    with torch.no_grad():
        pattern.key_proj.copy_(torch.eye(20, 32))
        pattern.value_proj.copy_(torch.eye(20, 32))
    full = F.scaled_dot_product_attention(q, k, v)
    assert_close(pattern(q, k, v, None, False, 0.0), full, atol=1e-5, rtol=1e-5)


def test_linformer_ignores_padding():
    """Zeroed padded keys and values add nothing to E·K and F·V, and the real positions use the
    same columns of E and F as alone: a padded sequence gets what it gets alone."""
    torch.manual_seed(0)
    pattern = LinformerPattern(6, max_positions=64)
    q, k, v = _qkv(t=37)
    pad = _pad(37)
    both = pattern(q, k, v, pad, False, 0.0)
    alone = pattern(q[1:, :, :28], k[1:, :, :28], v[1:, :, :28], None, False, 0.0)
    assert_close(both[1, :, :28], alone[0], atol=1e-5, rtol=1e-5)
    # padding changes nothing, whatever it holds
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 28:], v2[1, :, 28:] = 1e3, -1e3
    assert_close(pattern(q, k2, v2, pad, False, 0.0), both, atol=0, rtol=0)
    with pytest.raises(ValueError, match="cannot run causally"):
        pattern(q, k, v, pad, True, 0.0)
    with pytest.raises(ValueError, match=r"at most model\.max_positions=64"):
        pattern(*_qkv(t=65), None, False, 0.0)


def test_linformer_is_refused_for_the_decoder():
    with pytest.raises(ConfigError, match="cannot run causally") as refused:
        _config(decoder_attention="linformer").validate()
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="translation task"):
        _config(task="lm", cross_attention="linformer").validate()


def test_cached_decoding_with_linformer_cross_attention_equals_the_full_forward():
    """The cache holds the memory projected to k rows (no mask); padded sources, beams."""
    torch.manual_seed(0)
    config = _config(cross_attention="linformer", encoder_attention="linformer")
    model = Transformer(config).eval()
    src = torch.randint(5, 50, (2, 15))
    src_pad = torch.zeros(2, 15, dtype=torch.bool)
    src_pad[1, 9:] = True
    tgt = torch.randint(5, 50, (4, 12))
    tgt[:, 0] = 2
    rows = torch.tensor([0, 0, 1, 1])
    with torch.no_grad():
        full = torch.log_softmax(model(src[rows], src_pad[rows], tgt), dim=-1)
        cache = model.init_cache(model.encode(src, src_pad), src_pad, max_len=12, beam_size=2)
        assert cache.cross_mask is None
        assert cache.layers[0].cross_k is not None and cache.layers[0].cross_k.shape[2] == 8
        for t in range(12):
            step = model.log_probs_step(tgt[:, t], cache)
            assert_close(step, full[:, t], atol=1e-5, rtol=1e-5)


# -- LSH ---------------------------------------------------------------------------------------


def _reformer_scores(q: torch.Tensor) -> torch.Tensor:
    """Shared-QK scores as the reference defines them, written out: trax's ``attend`` (and
    Hugging Face's ``LSHSelfAttention._len_and_dim_norm``) takes the keys as
    ``length_normalized(q) / sqrt(d)``, with ``length_normalized(x) = x / sqrt(mean(x**2) +
    1e-6)``, and scores ``q @ k.T`` with no further scaling."""
    d = q.size(-1)
    keys = q / torch.sqrt((q**2).mean(dim=-1, keepdim=True) + 1e-6) / d**0.5
    return q @ keys.transpose(-2, -1)


def _shared_qk(
    q: torch.Tensor, key_pad: torch.Tensor | None, causal: bool, divide: float = 1.0
) -> torch.Tensor:
    """Full shared-QK attention weights written out: Reformer's scores (divided by
    ``divide``); a query attends to itself only when it has no other key."""
    t = q.size(2)
    scores = _reformer_scores(q) / divide
    others = ~torch.eye(t, dtype=torch.bool)
    if causal:
        others = others & torch.ones(t, t, dtype=torch.bool).tril()
    keys = others[None, None].expand(q.size(0), 1, t, t)
    if key_pad is not None:
        keys = keys & ~key_pad[:, None, None, :]
    alone = ~keys.any(-1, keepdim=True)  # no other key: itself
    keys = keys | (alone & torch.eye(t, dtype=torch.bool))
    return scores.masked_fill(~keys, float("-inf")).softmax(dim=-1)


@pytest.mark.parametrize("causal", [False, True])
def test_lsh_with_one_bucket_and_one_chunk_is_full_shared_qk_attention(causal):
    q, k, v = _qkv()
    pad = _pad(37)
    pattern = LSHPattern(buckets=1, rounds=1, chunk=40).eval()
    ours = pattern(q, k, v, pad, causal, 0.0)
    expected = _shared_qk(q, pad, causal) @ v
    real = ~pad[1]
    assert_close(ours[0], expected[0], atol=1e-5, rtol=1e-5)
    assert_close(ours[1][:, real], expected[1][:, real], atol=1e-5, rtol=1e-5)
    # k is not used (shared QK)
    assert torch.equal(pattern(q, torch.zeros_like(k), v, pad, causal, 0.0), ours)


@pytest.mark.parametrize("causal", [False, True])
def test_lsh_scores_are_reformers_and_dk_scale_divides_them_by_sqrt_dk(causal):
    """Unit-length keys and no 1/√d_k (trax, Hugging Face): the default. ``dk_scale`` (what
    aiayn computed before, kept for its checkpoints) is that divided by √d_k, and differs."""
    q, k, v = _qkv()
    q = q * 3.0  # queries longer than 1, so that the scale shows in the weights
    pad = _pad(37)
    real = ~pad[1]
    scaled = LSHPattern(buckets=1, rounds=1, chunk=40, dk_scale=True).eval()
    ours = scaled(q, k, v, pad, causal, 0.0)
    expected = _shared_qk(q, pad, causal, divide=q.size(-1) ** 0.5) @ v
    assert_close(ours[0], expected[0], atol=1e-5, rtol=1e-5)
    assert_close(ours[1][:, real], expected[1][:, real], atol=1e-5, rtol=1e-5)
    reformer = LSHPattern(buckets=1, rounds=1, chunk=40).eval()(q, k, v, pad, causal, 0.0)
    assert (reformer[0] - ours[0]).abs().max() > 0.1
    # the pictures' weights follow the same scale
    for pattern, divide in ((LSHPattern(4, 2, 5).eval(), 1.0), (scaled, q.size(-1) ** 0.5)):
        weights = pattern.weights(q, k, None, causal)
        seen = pattern.seen(q, None, causal)
        scores = _reformer_scores(q) / divide
        scores = scores.masked_fill(torch.eye(37, dtype=torch.bool), -1e5)
        expected = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
        assert_close(weights, expected, atol=1e-6, rtol=1e-5)


def test_lsh_models_saved_before_lsh_dk_scale_load_with_it(tmp_path):
    """A checkpoint whose stored config lacks model.lsh_dk_scale was trained with the scores
    divided by √d_k: it loads with lsh_dk_scale = true and computes what it computed then; a
    model without lsh, or one saved with the key, keeps its value."""
    from aiayn.data.corpus import tokenizer_path
    from aiayn.inference.loading import load_model
    from tests.helpers import make_reverse_data

    data = make_reverse_data(tmp_path / "text", n_train=200, n_valid=10)
    spm = ckpt.bytes_to_tensor(tokenizer_path(data).read_bytes())
    overrides = ["preset=tiny", "model.vocab_size=13", "model.encoder_attention=lsh"]
    config = load_config(overrides=overrides)
    assert config.model.lsh_dk_scale is False  # the reference's scaling by default
    torch.manual_seed(0)
    model = Transformer(config.model)
    state = ckpt.model_checkpoint(config, ckpt.model_state(model), spm, 1, 0)
    del state["config"]["model"]["lsh_dk_scale"]  # as saved before the key existed
    path = tmp_path / "old.pt"
    ckpt.save_atomic(state, path)
    loaded = load_model(path, mmap=False)
    assert loaded.config.model.lsh_dk_scale is True
    pattern = loaded.model.encoder.layers[0].self_attn.pattern
    assert isinstance(pattern, LSHPattern) and pattern.dk_scale
    # a run of such a model resumed with model.lsh_dk_scale = true averages its old and its
    # new checkpoints; one with the reference's scaling is another model
    for value, averages in ((True, True), (False, False)):
        state["config"]["model"]["lsh_dk_scale"] = value
        ckpt.save_atomic(state, tmp_path / "new.pt")
        if averages:
            averaging.average_checkpoints([path, tmp_path / "new.pt"])
        else:
            with pytest.raises(Exception, match=r"model configs differ \(lsh_dk_scale\)"):
                averaging.average_checkpoints([path, tmp_path / "new.pt"])
    # a new checkpoint keeps what it says; a model without lsh gets the default
    state["config"]["model"]["lsh_dk_scale"] = False
    assert config_from_dict(state["config"], stored=True).model.lsh_dk_scale is False
    plain = load_config(overrides=["preset=tiny"]).to_dict()
    del plain["model"]["lsh_dk_scale"]
    assert config_from_dict(plain, stored=True).model.lsh_dk_scale is False


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("settings", [(4, 2, 5), (8, 3, 4), (2, 1, 3)])
def test_lsh_equals_attention_over_the_union_of_its_rounds(settings, causal):
    """Chunked, sorted and combined over rounds, it equals shared-QK attention over the keys
    that any round saw (:meth:`LSHPattern.seen`), each once, written out."""
    buckets, rounds, chunk = settings
    q, k, v = _qkv()
    pad = _pad(37)
    pattern = LSHPattern(buckets, rounds, chunk).eval()
    ours = pattern(q, k, v, pad, causal, 0.0)
    expected = pattern.weights(q, k, pad, causal) @ v
    real = ~pad[1]
    assert_close(ours[0], expected[0], atol=1e-5, rtol=1e-5)
    assert_close(ours[1][:, real], expected[1][:, real], atol=1e-5, rtol=1e-5)
    seen = pattern.seen(q, pad, causal)
    assert seen.float().mean() < 0.5  # sparse
    assert not (seen & pad[:, None, None, :]).any()
    if causal:
        assert not seen.triu(1).any()
    # each round sees at most its chunk and the one before
    assert seen.sum(-1).max() <= rounds * 2 * chunk


def test_lsh_eval_is_deterministic_and_training_draws_new_rotations():
    q, k, v = _qkv()
    pattern = LSHPattern(8, 2, 4)
    fixed = pattern.eval()(q, k, v, None, False, 0.0)
    assert torch.equal(LSHPattern(8, 2, 4).eval()(q, k, v, None, False, 0.0), fixed)
    pattern.train()
    torch.manual_seed(3)
    first = pattern(q, k, v, None, False, 0.0)
    torch.manual_seed(3)
    assert torch.equal(pattern(q, k, v, None, False, 0.0), first)  # the run's seed
    assert not torch.equal(pattern(q, k, v, None, False, 0.0), first)
    with pytest.raises(ValueError, match="depend on the data"):
        pattern.allowed(10, False, q.device)


def test_lsh_hashes_each_head_with_its_own_rotation_and_every_sequence_alike():
    """One random rotation per head and round, shared by the batch (Hugging Face's
    LSHSelfAttention): the same queries in every head and every sequence hash differently from
    head to head and alike from sequence to sequence, in eval and in training."""
    q = torch.randn(1, 1, 37, 8).expand(2, 3, 37, 8)
    pattern = LSHPattern(8, 2, 4).eval()
    seen = pattern.seen(q, None, False)
    assert torch.equal(seen[0], seen[1])
    assert not torch.equal(seen[0, 0], seen[0, 1]) and not torch.equal(seen[0, 1], seen[0, 2])
    pattern.train()
    buckets, _, _ = pattern._sort(q.float(), None, 40)  # (rounds, B, H, tp)
    assert torch.equal(buckets[:, 0], buckets[:, 1])
    assert not torch.equal(buckets[:, :, 0], buckets[:, :, 1])


def test_lsh_has_no_incremental_decoding():
    lm = DecoderOnlyLM(_config(task="lm", decoder_attention="lsh"))
    with pytest.raises(ConfigError, match="lsh attention has no incremental decoding"):
        lm.init_cache(2, 10)
    pattern = lm.decoder.layers[0].self_attn.pattern
    assert pattern is not None
    with pytest.raises(ValueError, match="lsh attention has no incremental decoding"):
        pattern.step_keys(3, torch.device("cpu"))  # what Decoder.step asks
    model = Transformer(_config(decoder_attention="lsh"))
    memory = model.encode(torch.randint(5, 50, (1, 6)), None)
    with pytest.raises(ValueError, match="lsh attention has no incremental decoding"):
        model.init_cache(memory, None, max_len=10)
    # a translation run with it would fail at its first validation BLEU
    with pytest.raises(ConfigError, match=r"set train\.valid_bleu = false"):
        load_config(overrides=["preset=tiny", "model.decoder_attention=lsh"])
    load_config(overrides=["preset=tiny", "model.decoder_attention=lsh", "train.valid_bleu=false"])
    # the encoder may use it and decode incrementally
    model = Transformer(_config(encoder_attention="lsh")).eval()
    src = torch.randint(5, 50, (1, 6))
    with torch.no_grad():
        cache = model.init_cache(model.encode(src, None), None, max_len=3)
        model.log_probs_step(torch.tensor([2]), cache)


def test_new_settings_are_checked():
    assert get_args(AttentionName) == PATTERNS
    with pytest.raises(ConfigError, match="lsh_buckets must be even"):
        _config(lsh_buckets=5).validate()
    for name in ("linformer_k", "lsh_buckets", "lsh_rounds", "lsh_chunk"):
        with pytest.raises(ConfigError, match=name):
            _config(**{name: 0}).validate()


def test_training_checkpoints_averaging_and_bf16_acceleration_keep_the_patterns(tmp_path):
    """Linformer's E and F are parameters of the model: the Trainer trains them (bf16 on the
    CPU: attention modules swapped for Float32Attention), checkpoints hold them, averaging
    takes their mean, and a bf16 accelerated model decodes through the projected memory."""
    over = [
        "model.encoder_attention=lsh",
        "model.cross_attention=linformer",
        "model.linformer_k=8",
        "model.lsh_buckets=2",
        "model.lsh_chunk=4",
        "train.max_steps=2",
        "train.save_interval_steps=1",
        "train.precision=bf16",
        "train.valid_bleu=false",
    ]
    config = tiny_config(*over)
    trainer = small_reverse_trainer(config, tmp_path)
    proj = trainer.model.decoder.layers[0].cross_attn.pattern.key_proj
    before = proj.detach().clone()
    trainer.train()
    assert not torch.equal(proj.detach(), before)  # E learns
    names = [f"step_0000000{i}.pt" for i in (1, 2)]
    states = [torch.load(tmp_path / "checkpoints" / n, weights_only=True)["model"] for n in names]
    key = "decoder.layers.0.cross_attn.pattern.key_proj"
    assert key in states[1] and torch.equal(states[1][key], ckpt.model_state(trainer.model)[key])
    mean = averaging.average_checkpoints([tmp_path / "checkpoints" / n for n in names])
    assert_close(mean[key], (states[0][key] + states[1][key]) / 2)
    model = Transformer(config.model)
    model.load_state_dict(mean)
    model = model.eval().to(torch.bfloat16)
    with accelerate(model, "decode", precision="bf16"):
        attention = model.decoder.layers[0].cross_attn
        assert isinstance(attention, Float32Attention) and attention.pattern is not None
        src = torch.randint(4, 12, (2, 7))
        pad = torch.zeros(2, 7, dtype=torch.bool)
        pad[1, 5:] = True
        tgt = torch.randint(4, 12, (2, 3))
        with torch.inference_mode():
            full = torch.log_softmax(model(src, pad, tgt).float(), dim=-1)
            cache = model.init_cache(model.encode(src, pad), pad, max_len=3)
            assert cache.layers[0].cross_k is not None
            assert cache.layers[0].cross_k.dtype == torch.float32  # Float32Attention's memory
            for t in range(3):
                step = model.log_probs_step(tgt[:, t], cache)
                assert (step - full[:, t]).abs().max() < 0.1


def test_attention_pictures_show_what_lsh_saw_and_refuse_linformer():
    torch.manual_seed(0)
    model = Transformer(_config(encoder_attention="lsh", decoder_attention="local")).eval()
    src, out = list(range(5, 25)), list(range(5, 15))
    encoder, decoder, _ = attention_weights(model, src, out)
    weights = encoder[0]  # (H, S, S), S = 21 with EOS
    assert_close(weights.sum(-1), torch.ones(4, 21))
    assert (weights > 0).float().mean() < 0.6  # only the keys its buckets gave each query
    assert not decoder[0].triu(1).any()  # local, causal
    again, _, _ = attention_weights(model, src, out)
    assert torch.equal(again[0], weights)  # eval rotations are fixed
    model = Transformer(_config(cross_attention="linformer")).eval()
    with pytest.raises(UserError, match="no attention pictures"):
        attention_weights(model, src, out)


def test_a_classifier_takes_a_linformer_encoder_only_with_its_projections(tmp_path):
    mlm = tiny_config("model.task=mlm", "model.encoder_attention=linformer", "model.linformer_k=8")
    state = ckpt.model_checkpoint(
        mlm, ckpt.model_state(EncoderOnly(mlm.model)), ckpt.bytes_to_tensor(b"tok"), 1, 0
    )
    ckpt.save_atomic(state, tmp_path / "mlm.pt")
    init = f"train.init_from={tmp_path / 'mlm.pt'}"
    for other in ("model.encoder_attention=full", "model.linformer_k=16"):
        clf = tiny_config("model.task=classify", "model.encoder_attention=linformer", init, other)
        with pytest.raises(ConfigError, match="its encoder differs"):
            pretrained_weights(clf, b"tok")
    same = ["model.encoder_attention=linformer", "model.linformer_k=8"]
    weights = pretrained_weights(tiny_config("model.task=classify", *same, init), b"tok")
    assert "encoder.layers.0.self_attn.pattern.key_proj" in weights


def test_a_translator_refuses_an_lsh_decoder_before_its_first_sentence(tmp_path):
    """translate and serve load the model through Translator.from_checkpoint: the refusal
    comes there, naming the checkpoint, not as an internal error at the first request."""
    from aiayn.data.corpus import tokenizer_path
    from aiayn.inference.translator import Translator
    from tests.helpers import make_reverse_data

    data = make_reverse_data(tmp_path / "text", n_train=200, n_valid=10)
    lsh = ["model.vocab_size=13", "model.decoder_attention=lsh", "train.valid_bleu=false"]
    config = load_config(overrides=["preset=tiny", *lsh])
    spm = ckpt.bytes_to_tensor(tokenizer_path(data).read_bytes())
    state = ckpt.model_checkpoint(config, ckpt.model_state(Transformer(config.model)), spm, 1, 0)
    path = tmp_path / "lsh.pt"
    ckpt.save_atomic(state, path)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: lsh attention has no"):
        Translator.from_checkpoint(path)


@pytest.mark.parametrize(
    ("task", "key"), [("lm", "encoder"), ("mlm", "decoder"), ("classify", "decoder")]
)
def test_a_pattern_for_a_stack_the_model_lacks_is_refused(task, key):
    with pytest.raises(ConfigError, match=rf"model\.{key}_attention: model\.task={task} is"):
        load_config(overrides=["preset=tiny", f"model.task={task}", f"model.{key}_attention=local"])
    # A checkpoint's stored config with it still loads (the pattern was ignored by its run).
    stored = {"preset": "tiny", "model": {"task": task, f"{key}_attention": "local"}}
    assert config_from_dict(stored, stored=True).model.task == task
