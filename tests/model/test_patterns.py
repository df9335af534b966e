"""Attention patterns for long sequences (aiayn.model.patterns): the blocked computation equals
attention written out with the pattern's mask; a pattern that covers every position is full
attention; causal patterns never see the future; cached decoding equals the full forward."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from aiayn.config import ModelConfig
from aiayn.errors import ConfigError
from aiayn.model.attention import naive_attention
from aiayn.model.families import DecoderOnlyLM, EncoderOnly
from aiayn.model.patterns import BlockPattern, make_pattern
from aiayn.model.transformer import Transformer

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
    }
    return ModelConfig(**{**base, **changes})


@pytest.mark.parametrize("name", NAMES)
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


@pytest.mark.parametrize("name", NAMES)
def test_encoder_patterns_train_and_ignore_padding(name):
    torch.manual_seed(0)
    model = EncoderOnly(_config(task="mlm", encoder_attention=name))
    inputs = torch.randint(5, 50, (2, 33))
    pad = torch.zeros(2, 33, dtype=torch.bool)
    pad[1, 20:] = True
    logits = model(inputs, pad)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
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
    for name in NAMES:
        pattern = make_pattern(name, **SETTINGS)
        assert pattern is not None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = pattern(q.bfloat16(), k.bfloat16(), v.bfloat16(), _pad(37), True, 0.0)
        expected = pattern(q, k, v, _pad(37), True, 0.0)
        assert out.dtype == torch.bfloat16
        assert (out[0].float() - expected[0]).abs().max() < 0.05


def test_unknown_settings_are_refused():
    with pytest.raises(ConfigError, match="attention_window"):
        _config(attention_window=0).validate()


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_activation_checkpointing_gives_the_same_gradients(task):
    from aiayn.model.families import build_model
    from aiayn.model.transformer import set_activation_checkpointing

    config = _config(task=task, dropout=0.1, attention_dropout=0.1, encoder_attention="local")
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
