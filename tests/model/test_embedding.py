"""Embeddings, positions and parameter counts (§3.4, §3.5, Table 3)."""

import math

import pytest
import torch
from torch.testing import assert_close

from aiayn.config import load_config
from aiayn.model import Transformer, count_parameters
from aiayn.model.embedding import sinusoid_table
from aiayn.presets import PAPER_PARAMS_M


def test_sinusoid_table_equals_the_formula_elementwise():
    n_positions, d_model = 50, 16
    table = sinusoid_table(n_positions, d_model)
    for pos in range(n_positions):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_halves_table_is_hugging_face_marians_not_tensor2tensors():
    """``layout="halves"``: Hugging Face's MarianSinusoidalPositionalEmbedding written out
    (angle pos / 10000^(2·(j // 2) / d), sines of the even j first, then cosines of the odd
    j). tensor2tensor's get_timing_signal_1d (and fairseq's, Marian C++'s) has the same
    layout with the frequencies 10000^(−i / (d/2 − 1)): another table."""
    n_positions, d_model = 50, 16
    table = sinusoid_table(n_positions, d_model, layout="halves").double()
    angle = torch.tensor(
        [[pos / 10000 ** (2 * (j // 2) / d_model) for j in range(d_model)] for pos in range(50)],
        dtype=torch.float64,
    )
    marian = torch.cat([angle[:, 0::2].sin(), angle[:, 1::2].cos()], dim=1)
    assert_close(table, marian, atol=1e-6, rtol=0)
    half = d_model // 2
    increment = math.log(10000.0) / (half - 1)
    timescales = torch.exp(torch.arange(half, dtype=torch.float64) * -increment)
    scaled = torch.arange(n_positions, dtype=torch.float64)[:, None] * timescales[None, :]
    t2t = torch.cat([scaled.sin(), scaled.cos()], dim=1)
    assert (table - t2t).abs().max() > 0.1


def test_three_embedding_uses_are_one_tensor_scaled_by_sqrt_d_model():
    model = Transformer(load_config(overrides=["preset=tiny", "model.dropout=0"]).model).eval()
    weight = model.out_proj.weight
    assert model.src_embed.token.weight is weight
    assert model.tgt_embed.token.weight is weight
    ids = torch.tensor([[5, 9, 11]])
    d_model = model.config.d_model
    expected = weight[ids] * math.sqrt(d_model) + sinusoid_table(3, d_model)
    assert_close(model.src_embed(ids), expected)
    assert_close(model.tgt_embed(ids), expected)
    # The shared matrix counts once.
    names = [n for n, _ in model.named_parameters()]
    assert sum("token.weight" in n or n == "out_proj.weight" for n in names) == 1


def test_unshared_embeddings_are_three_tensors():
    model = Transformer(load_config(overrides=["preset=tiny", "model.share_embeddings=0"]).model)
    tensors = {id(model.src_embed.token.weight), id(model.tgt_embed.token.weight)}
    assert len(tensors | {id(model.out_proj.weight)}) == 3


def test_post_norm_stacks_have_no_final_layer_norm():
    model = Transformer(load_config(overrides=["preset=tiny"]).model)
    assert model.encoder.final_norm is None and model.decoder.final_norm is None
    pre = Transformer(load_config(overrides=["preset=tiny", "model.pre_norm=true"]).model)
    assert pre.encoder.final_norm is not None and pre.decoder.final_norm is not None


def _params(preset: str) -> int:
    config = load_config(overrides=[f"preset={preset}", "model.vocab_size=37000"]).model
    with torch.device("meta"):  # count without allocating 200M parameters
        return count_parameters(Transformer(config))


@pytest.mark.parametrize("preset", ["base", "big"])
def test_base_and_big_parameter_counts_within_3_percent_of_the_paper(preset):
    assert _params(preset) == pytest.approx(PAPER_PARAMS_M[preset] * 1e6, rel=0.03)


@pytest.mark.parametrize(
    "preset", ["b_dk16", "b_dk32", "c_n2", "c_n4", "c_n8", "c_dff1024", "c_dff4096"]
)
def test_table3_rows_differ_from_base_as_in_the_paper(preset):
    # Table 3 rounds to 1M, so each difference from base is known to within 1M. (Rows that
    # change d_model also change the embedding, whose size depends on the paper's exact
    # vocabulary: see docs/faithfulness.md.)
    ours = (_params(preset) - _params("base")) / 1e6
    paper = PAPER_PARAMS_M[preset] - PAPER_PARAMS_M["base"]
    assert abs(ours - paper) <= 1.0


def test_base_parameter_count_by_hand():
    d, d_ff, n, v = 512, 2048, 6, 37000
    attention = 4 * (d * d + d)
    ffn = d * d_ff + d_ff + d_ff * d + d
    norm = 2 * d
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    assert _params("base") == v * d + n * (encoder_layer + decoder_layer)
