"""The decoder-only LM and the encoder-only models: causality, the cache, the heads, and the
shared layers."""

import pytest
import torch
from torch.testing import assert_close

from aiayn.config import ModelConfig
from aiayn.model.families import (
    DecoderOnlyLM,
    EncoderOnly,
    build_model,
    pretrained_encoder_state,
)
from aiayn.model.layers import DecoderLayer, EncoderLayer
from aiayn.model.transformer import Transformer, count_parameters


def _config(**changes) -> ModelConfig:
    base = {
        "vocab_size": 50,
        "d_model": 32,
        "d_ff": 64,
        "n_heads": 4,
        "n_layers": 2,
        "dropout": 0.0,
        "max_positions": 64,
        "task": "lm",
    }
    return ModelConfig(**{**base, **changes})


def _lm(**changes) -> DecoderOnlyLM:
    torch.manual_seed(0)
    return DecoderOnlyLM(_config(**changes)).eval()


@pytest.mark.parametrize("pre_norm", [False, True])
@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_lm_logits_at_t_do_not_depend_on_later_tokens(pre_norm, positional):
    model = _lm(pre_norm=pre_norm, positional=positional)
    torch.manual_seed(1)
    inputs = torch.randint(4, 50, (3, 12))
    changed = inputs.clone()
    changed[:, 7:] = torch.randint(4, 50, (3, 5))
    with torch.no_grad():
        a = model(inputs)
        b = model(changed)
    assert torch.equal(a[:, :7], b[:, :7])  # bit-identical before the change
    assert not torch.equal(a[:, 7:], b[:, 7:])


def test_lm_cached_steps_equal_the_full_forward_at_every_step():
    model = _lm()
    inputs = torch.randint(4, 50, (2, 10))
    with torch.no_grad():
        full = torch.log_softmax(model(inputs), dim=-1)
        cache = model.init_cache(2, 10)
        for t in range(10):
            step = model.log_probs_step(inputs[:, t], cache)
            assert_close(step, full[:, t], atol=1e-5, rtol=1e-5)
    assert cache.length == 10


def test_lm_prefill_then_beams_equal_the_full_forward():
    model = _lm()
    k = 3
    prompt = torch.randint(4, 50, (1, 5)).expand(k, -1)
    with torch.no_grad():
        cache = model.init_cache(k, 8, beam_size=k)
        model.prefill(prompt[:, :4], cache)
        nxt = torch.tensor([7, 8, 9])
        step = model.log_probs_step(prompt[:, 4], cache)
        step2 = model.log_probs_step(nxt, cache)
        full = torch.log_softmax(model(torch.cat([prompt, nxt[:, None]], 1)), dim=-1)
    assert_close(step, full[:, 4], atol=1e-5, rtol=1e-5)
    assert_close(step2, full[:, 5], atol=1e-5, rtol=1e-5)


def test_lm_is_the_decoder_stack_without_cross_attention():
    model = _lm()
    layer = model.decoder.layers[0]
    assert isinstance(layer, DecoderLayer)
    assert layer.cross_attn is None and layer.cross_attn_norm is None
    # Tied: the projection is the embedding matrix.
    assert model.out_proj.weight is model.embed.token.weight
    # One decoder layer of the translation model minus its cross-attention block.
    translation = Transformer(_config(task="translation"))
    t_layer = translation.decoder.layers[0]
    cross = count_parameters(t_layer.cross_attn) + count_parameters(t_layer.cross_attn_norm)
    assert count_parameters(t_layer) - cross == count_parameters(layer)


def test_lm_cache_refuses_more_than_max_positions():
    model = _lm()
    with pytest.raises(ValueError, match="max_positions"):
        model.init_cache(1, 65)


def _encoder(task: str, **changes) -> EncoderOnly:
    torch.manual_seed(0)
    return EncoderOnly(_config(task=task, **changes)).eval()


def test_mlm_logits_per_position_and_padding_does_not_leak():
    model = _encoder("mlm")
    inputs = torch.randint(4, 50, (2, 9))
    inputs[1, 6:] = 0
    pad = inputs == 0
    with torch.no_grad():
        logits = model(inputs, pad)
        alone = model(inputs[1:, :6], pad[1:, :6])
    assert logits.shape == (2, 9, 50)
    assert_close(logits[1, :6], alone[0], atol=1e-5, rtol=1e-5)
    assert model.encoder.layers[0].__class__ is EncoderLayer


@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_classifier_gives_class_logits_independent_of_padding(pooling):
    model = _encoder("classify", n_classes=5, pooling=pooling)
    inputs = torch.randint(4, 50, (2, 9))
    inputs[0, 0] = inputs[1, 0] = 2  # BOS
    padded = torch.cat([inputs, torch.zeros(2, 4, dtype=torch.long)], 1)
    with torch.no_grad():
        a = model(inputs, inputs == 0)
        b = model(padded, padded == 0)
    assert a.shape == (2, 5)
    assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_pretrained_encoder_state_loads_exactly_into_a_classifier():
    mlm = _encoder("mlm")
    torch.manual_seed(5)
    classifier = EncoderOnly(_config(task="classify", n_classes=3))
    weights = pretrained_encoder_state(mlm.state_dict())
    assert weights and all(k.startswith(("embed.", "encoder.")) for k in weights)
    missing, unexpected = classifier.load_state_dict(weights, strict=False)
    assert not unexpected
    assert all(k.startswith(("classifier.", "out_proj.")) for k in missing)
    for name, tensor in classifier.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name]), name


def test_build_model_by_task():
    assert type(build_model(_config(task="translation"))) is Transformer
    assert type(build_model(_config(task="lm"))) is DecoderOnlyLM
    assert build_model(_config(task="mlm")).classifier is None
    assert build_model(_config(task="classify", n_classes=4)).classifier is not None
    with pytest.raises(ValueError, match="mlm and classify"):
        EncoderOnly(_config(task="lm"))


@pytest.mark.parametrize("preset", ["gpt_small", "gpt_base", "bert_small", "bert_base"])
def test_gpt_and_bert_presets_are_the_papers_layers_in_their_shapes(preset):
    """What docs/families.md says of the presets: the paper's ReLU FFN, its embedding scaled
    by √d_model with no LayerNorm, post-norm, and (mlm) the bare tied projection as the head,
    with no dense + GELU + LayerNorm transform and no output bias; GPT's and BERT's GELU is
    model.activation = "gelu", the exact form 0.5·x·(1 + erf(x/√2)), written out here."""
    import math

    from aiayn.config import config_from_dict

    small = {"d_model": 32, "d_ff": 64, "n_heads": 4, "n_layers": 1, "vocab_size": 50}
    config = config_from_dict({"preset": preset, "model": small}).model
    assert (config.activation, config.pre_norm, config.final_logits_bias) == ("relu", False, False)
    torch.manual_seed(0)
    model = build_model(config)
    assert isinstance(model, (DecoderOnlyLM, EncoderOnly))
    assert model.embed.scale == math.sqrt(32)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.embed.modules())
    assert model.out_proj is not None
    assert model.out_proj.weight is model.embed.token.weight and model.out_proj.bias is None
    names = {name.split(".")[0] for name, _ in model.named_parameters()}
    assert names == {"embed", "decoder" if config.task == "lm" else "encoder"}
    gelu = build_model(
        config_from_dict({"preset": preset, "model": {**small, "activation": "gelu"}}).model
    )
    ffn = (gelu.decoder if isinstance(gelu, DecoderOnlyLM) else gelu.encoder).layers[0].ffn
    x = torch.randn(3, 32)
    hidden = ffn.w1(x)
    expected = ffn.w2(0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2))))
    assert_close(ffn(x), expected)
