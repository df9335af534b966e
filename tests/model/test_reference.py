"""Our layers and stacks against torch.nn's independent implementation, weights copied."""

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from aiayn.config import load_config
from aiayn.model import Transformer
from aiayn.model.attention import MultiHeadAttention, attention_mask
from aiayn.model.layers import DecoderLayer, EncoderLayer

D_MODEL, N_HEADS, D_FF, EPS = 32, 4, 64, 1e-6


@pytest.fixture(autouse=True)
def _no_fastpath():
    # torch's inference fast path returns zeros at padded positions; compare the plain path.
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    yield
    torch.backends.mha.set_fastpath_enabled(previous)


def _model_config(n_layers=2):
    return load_config(
        overrides=[
            "preset=tiny",
            f"model.d_model={D_MODEL}",
            f"model.n_heads={N_HEADS}",
            f"model.d_ff={D_FF}",
            f"model.n_layers={n_layers}",
            "model.dropout=0.0",
            f"model.layer_norm_eps={EPS}",
        ]
    ).model


def _copy_attention(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        if ours.self_attention:
            ours.qkv_proj.weight.copy_(theirs.in_proj_weight)
            ours.qkv_proj.bias.copy_(theirs.in_proj_bias)
        else:
            ours.q_proj.weight.copy_(theirs.in_proj_weight[:D_MODEL])
            ours.q_proj.bias.copy_(theirs.in_proj_bias[:D_MODEL])
            ours.kv_proj.weight.copy_(theirs.in_proj_weight[D_MODEL:])
            ours.kv_proj.bias.copy_(theirs.in_proj_bias[D_MODEL:])
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
        ours.out_proj.bias.copy_(theirs.out_proj.bias)


def _copy_common(ours, theirs, norms) -> None:
    with torch.no_grad():
        ours.ffn.w1.weight.copy_(theirs.linear1.weight)
        ours.ffn.w1.bias.copy_(theirs.linear1.bias)
        ours.ffn.w2.weight.copy_(theirs.linear2.weight)
        ours.ffn.w2.bias.copy_(theirs.linear2.bias)
        for our_norm, their_norm in norms:
            our_norm.weight.copy_(their_norm.weight)
            our_norm.bias.copy_(their_norm.bias)


def copy_encoder_layer(ours: EncoderLayer, theirs: nn.TransformerEncoderLayer) -> None:
    _copy_attention(ours.self_attn, theirs.self_attn)
    _copy_common(ours, theirs, [(ours.self_attn_norm, theirs.norm1), (ours.ffn_norm, theirs.norm2)])


def copy_decoder_layer(ours: DecoderLayer, theirs: nn.TransformerDecoderLayer) -> None:
    _copy_attention(ours.self_attn, theirs.self_attn)
    _copy_attention(ours.cross_attn, theirs.multihead_attn)
    _copy_common(
        ours,
        theirs,
        [
            (ours.self_attn_norm, theirs.norm1),
            (ours.cross_attn_norm, theirs.norm2),
            (ours.ffn_norm, theirs.norm3),
        ],
    )


def _randomise(module: nn.Module) -> None:
    """Non-trivial LayerNorm gains/biases and biases, so that every parameter matters."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(0.0, 0.5)


def _reference_layer(cls):
    return (
        cls(
            D_MODEL,
            N_HEADS,
            D_FF,
            dropout=0.0,
            activation="relu",
            layer_norm_eps=EPS,
            batch_first=True,
            norm_first=False,
        )
        .double()
        .eval()
    )


def _padding():
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 6:] = True
    return pad


def test_encoder_layer_equals_torch_post_norm_relu_layer():
    theirs = _reference_layer(nn.TransformerEncoderLayer)
    _randomise(theirs)
    ours = EncoderLayer(_model_config()).double().eval()
    copy_encoder_layer(ours, theirs)
    x, pad = torch.randn(3, 7, D_MODEL, dtype=torch.float64), _padding()
    assert_close(ours(x, attention_mask(pad)), theirs(x, src_key_padding_mask=pad))


def test_decoder_layer_equals_torch_post_norm_relu_layer():
    theirs = _reference_layer(nn.TransformerDecoderLayer)
    _randomise(theirs)
    ours = DecoderLayer(_model_config()).double().eval()
    copy_decoder_layer(ours, theirs)
    x = torch.randn(3, 5, D_MODEL, dtype=torch.float64)
    memory, pad = torch.randn(3, 7, D_MODEL, dtype=torch.float64), _padding()
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    expected = theirs(x, memory, tgt_mask=causal, memory_key_padding_mask=pad)
    assert_close(ours(x, memory, attention_mask(pad)), expected)


def test_whole_stack_equals_torch_transformer_without_final_norms():
    n_layers = 3
    theirs = (
        nn.Transformer(
            D_MODEL,
            N_HEADS,
            n_layers,
            n_layers,
            D_FF,
            dropout=0.0,
            activation="relu",
            layer_norm_eps=EPS,
            batch_first=True,
            norm_first=False,
        )
        .double()
        .eval()
    )
    # The paper's post-norm stacks have no final LayerNorm; torch.nn.Transformer adds one.
    theirs.encoder.norm = nn.Identity()
    theirs.decoder.norm = nn.Identity()
    _randomise(theirs)
    ours = Transformer(_model_config(n_layers)).double().eval()
    for our_layer, their_layer in zip(ours.encoder.layers, theirs.encoder.layers, strict=True):
        copy_encoder_layer(our_layer, their_layer)
    for our_layer, their_layer in zip(ours.decoder.layers, theirs.decoder.layers, strict=True):
        copy_decoder_layer(our_layer, their_layer)

    pad = _padding()
    src_ids = torch.randint(4, 64, (3, 7)).masked_fill(pad, 0)
    tgt_in = torch.randint(4, 64, (3, 5))
    src_emb, tgt_emb = ours.src_embed(src_ids), ours.tgt_embed(tgt_in)
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    expected = theirs(
        src_emb,
        tgt_emb,
        tgt_mask=causal,
        src_key_padding_mask=pad,
        memory_key_padding_mask=pad,
    )
    memory = ours.encode(src_ids, pad)
    assert_close(ours.decode(tgt_in, memory, pad), expected)
    assert_close(ours(src_ids, pad, tgt_in), expected @ ours.out_proj.weight.T)
