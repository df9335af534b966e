"""The attention-RNN baselines (model.arch = bahdanau, luong): incremental decoding equals
teacher forcing through beams and finished sentences; attention weights; padding and batch
invariance; learning a small task; the accelerated training path."""

import re

import pytest
import torch
from torch.testing import assert_close

from aiayn.accel import accelerate
from aiayn.accel.loss import projected_label_smoothed_nll
from aiayn.config import DecodeConfig, ModelConfig, config_from_dict
from aiayn.data.collate import PAD_ID, collate_pairs
from aiayn.errors import ConfigError
from aiayn.inference.translator import search_batch
from aiayn.model.families import build_model
from aiayn.model.rnn import LuongNMT, RNNSearch
from aiayn.training.loss import label_smoothed_nll
from tests.helpers import reverse_pairs

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 30

# Every variant: RNNsearch with a stacked encoder, Luong with each score, with and without
# input feeding, and sizes where the recurrent state differs from the embedding.
VARIANTS = {
    "bahdanau": {"arch": "bahdanau", "n_layers": 2},
    "bahdanau_1layer_untied": {"arch": "bahdanau", "n_layers": 1, "share_embeddings": False},
    "luong_general": {"arch": "luong"},
    "luong_dot_no_feeding": {"arch": "luong", "luong_score": "dot", "input_feeding": False},
    "luong_concat": {"arch": "luong", "luong_score": "concat", "n_layers": 1},
}


def _model(name: str, **changes) -> RNNSearch | LuongNMT:
    torch.manual_seed(0)
    base = {"vocab_size": VOCAB, "d_model": 16, "rnn_hidden": 12, "n_layers": 2}
    config = ModelConfig(**{**base, "dropout": 0.0, "max_positions": 64, **VARIANTS[name]})
    model = build_model(ModelConfig(**{**vars(config), **changes}))
    assert isinstance(model, (RNNSearch, LuongNMT))
    # Weights far from the papers' small initial ones, so that every input moves the output
    # (Bahdanau's N(0, 0.01²) leaves a fresh model nearly blind to its inputs).
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-0.5, 0.5)
    return model.eval()


def _sources() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    src = torch.randint(4, VOCAB, (3, 7))
    pad = torch.zeros_like(src, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 6:] = True
    src = src.masked_fill(pad, PAD_ID)
    return src, pad


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cached_steps_equal_teacher_forcing_through_reorder_and_keep(name):
    model = _model(name)
    src, pad = _sources()
    k, steps = 2, 6
    src_rows, pad_rows = src.repeat_interleave(k, 0), pad.repeat_interleave(k, 0)
    history = torch.full((3 * k, 1), 2)  # BOS
    with torch.no_grad():
        cache = model.init_cache(model.encode(src, pad), pad, max_len=steps, beam_size=k)
        for t in range(steps):
            step = model.log_probs_step(history[:, -1], cache)
            assert step.dtype == torch.float32
            full = model(src_rows, pad_rows, history).log_softmax(-1)[:, -1]
            assert_close(step, full, atol=1e-5, rtol=1e-5)
            history = torch.cat([history, torch.randint(4, VOCAB, (history.size(0), 1))], 1)
            if t == 1:  # beam search moves rows within their sentence's group
                rows = torch.tensor([1, 1, 3, 2, 4, 4])
                cache.reorder(rows)
                history = history[rows]
            if t == 3:  # sentence 1 finishes: keep the groups of sentences 2 and 0
                rows = torch.tensor([4, 5, 0, 1])
                cache.keep(rows)
                history, src_rows, pad_rows = history[rows], src_rows[rows], pad_rows[rows]
                assert cache.batch_size == 4 and cache.memory.size(0) == 2
        with pytest.raises(ValueError, match="cache is full"):
            model.log_probs_step(history[:, -1], cache)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_attention_weights_sum_to_one_and_leave_padding_out(name):
    model = _model(name)
    src, pad = _sources()
    tgt_in = torch.randint(4, VOCAB, (3, 5))
    weights = model.cross_attention_weights(src, pad, tgt_in)
    assert weights.shape == (3, 5, 7)
    assert_close(weights.sum(-1), torch.ones(3, 5))
    assert torch.all(weights.masked_select(pad[:, None].expand_as(weights)) == 0)
    assert torch.all(weights[0] > 0)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_padded_batch_gives_what_each_sentence_gives_alone(name):
    model = _model(name, max_positions=64)
    sources = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    targets = [[7, 8, 9], [20, 21, 22, 23, 24], [4]]
    batch = collate_pairs(sources, targets)
    greedy, beam = DecodeConfig(beam_size=1, max_len_b=6), DecodeConfig(beam_size=3, max_len_b=6)
    with torch.no_grad():
        logits = model(batch.src_ids, batch.src_pad, batch.tgt_in)
        found_greedy = search_batch(model, batch.src_ids, batch.src_pad, greedy)
        found_beam = search_batch(model, batch.src_ids, batch.src_pad, beam, nbest=2)
        for i, (source, target) in enumerate(zip(sources, targets, strict=True)):
            one = collate_pairs([source], [target])
            alone = model(one.src_ids, one.src_pad, one.tgt_in)
            assert_close(logits[i, : len(target) + 1], alone[0], atol=1e-5, rtol=1e-5)
            for decode, found in ((greedy, found_greedy), (beam, found_beam)):
                [hyps] = search_batch(model, one.src_ids, one.src_pad, decode, nbest=2)
                assert [h.tokens for h in hyps] == [h.tokens for h in found[i]]


@pytest.mark.parametrize("arch", ["bahdanau", "luong"])
def test_each_model_learns_to_reverse_a_small_corpus(arch):
    torch.manual_seed(0)
    config = ModelConfig(
        arch=arch, vocab_size=16, d_model=32, rnn_hidden=32, n_layers=1, dropout=0.0
    )
    model = build_model(config)
    pairs = reverse_pairs(64, 5, 16, seed=0)
    batch = collate_pairs([s for s, _ in pairs], [t for _, t in pairs])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        optimizer.zero_grad()
        loss, nll = label_smoothed_nll(model(batch.src_ids, batch.src_pad, batch.tgt_in),
                                       batch.tgt_out, 0.0, PAD_ID)  # fmt: skip
        (loss / batch.n_tgt_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    assert float(nll.detach()) / batch.n_tgt_tokens < 0.05
    model.eval()
    with torch.no_grad():
        found = search_batch(model, batch.src_ids, batch.src_pad, DecodeConfig(beam_size=2))
    assert [hyps[0].tokens for hyps in found] == [t for _, t in pairs]


@pytest.mark.parametrize("name", ["bahdanau", "luong_general"])
def test_training_acceleration_leaves_the_model_and_fuses_its_loss(name):
    """aiayn.accel in train mode: the fused projection + loss over the hidden states that
    project=False gives equals the plain loss over the logits; decode mode changes nothing."""
    model = _model(name)
    src, pad = _sources()
    tgt_in = torch.randint(4, VOCAB, (3, 5))
    tgt_out = torch.randint(4, VOCAB, (3, 5))
    plain = label_smoothed_nll(model(src, pad, tgt_in), tgt_out, 0.1, PAD_ID)
    with accelerate(model, "train") as acceleration:
        assert acceleration.fused_loss
        hidden = model(src, pad, tgt_in, project=False)
        fused = projected_label_smoothed_nll(
            hidden, model.get_parameter("out_proj.weight"), tgt_out, 0.1, PAD_ID
        )
    assert_close(fused, plain)
    with accelerate(model, "decode"):
        assert type(model) in (RNNSearch, LuongNMT)
        assert_close(model(src, pad, tgt_in), model(src, pad, tgt_in))


def test_shared_embeddings_are_one_matrix_and_the_projection_is_tied():
    model = _model("bahdanau")
    assert model.out_proj.weight is model.src_embed.weight is model.tgt_embed.weight
    untied = _model("bahdanau_1layer_untied")
    assert untied.src_embed.weight is not untied.tgt_embed.weight
    assert untied.out_proj.weight is not untied.tgt_embed.weight


def test_the_rnn_archs_are_translation_models():
    with pytest.raises(ConfigError, match=r"model\.arch=luong is a model of the translation task"):
        ModelConfig(arch="luong", task="lm").validate()
    with pytest.raises(ConfigError, match="rnn_hidden must be positive"):
        ModelConfig(arch="bahdanau", rnn_hidden=0).validate()
    ModelConfig(arch="bahdanau", d_model=30).validate()  # no heads to divide d_model by
    # A baseline's own setting where the model has no use for it is refused, not ignored;
    # a stored config (a checkpoint's) still loads.
    for preset, model, refused in (
        ("small", {"rnn_hidden": 512}, "rnn_hidden is an option of model.arch=bahdanau and luong"),
        ("small", {"luong_score": "dot"}, "luong_score is an option of model.arch=luong"),
        ("rnnsearch", {"input_feeding": False}, "input_feeding is an option of model.arch=luong"),
        ("rnnsearch", {"arch": "transformer"}, "rnn_hidden (preset rnnsearch sets it) is an"),
    ):
        raw = {"preset": preset, "model": model}
        with pytest.raises(ConfigError, match=rf"^model\.{re.escape(refused)}"):
            config_from_dict(raw)
        config_from_dict(raw, stored=True)
    config_from_dict({"preset": "luong", "model": {"luong_score": "dot", "input_feeding": False}})


def test_rnnsearch_equals_the_papers_equations_written_out():
    """One sentence through Bahdanau et al.'s appendix A, step by step with the model's
    weights: s_0 = tanh(W_s h←_1), e_ij = v_aᵀ tanh(W_a s_{i-1} + U_a h_j), the GRU on
    [E y_{i-1}; c_i] (PyTorch's gate layout), the maxout deep output and W_o."""
    model = _model("bahdanau")
    assert isinstance(model, RNNSearch)
    src = torch.randint(4, VOCAB, (1, 6))
    tgt_in = torch.randint(4, VOCAB, (1, 4))
    n = model.hidden_size
    with torch.no_grad():
        h = model.encode(src, None).memory[0]  # (S, 2n) annotations [h→_j; h←_j]
        _, final = model.encoder(model.src_embed(src))
        assert_close(h[0, n:], final[-1, 0])  # h←_1: the top backward layer's last state
        att, gru = model.attention, model.decoder
        s = torch.tanh(model.init_state.weight @ h[0, n:] + model.init_state.bias)
        expected = []
        for y in tgt_in[0]:
            e = torch.stack(
                [att.v.weight[0] @ torch.tanh(att.query_proj.weight @ s + att.key_proj.weight @ hj)
                 for hj in h]
            )  # fmt: skip
            c = torch.softmax(e, 0) @ h
            x = torch.cat([model.tgt_embed.weight[y], c])
            gi = gru.weight_ih @ x + gru.bias_ih
            gh = gru.weight_hh @ s + gru.bias_hh
            r = torch.sigmoid(gi[:n] + gh[:n])
            z = torch.sigmoid(gi[n : 2 * n] + gh[n : 2 * n])
            candidate = torch.tanh(gi[2 * n :] + r * gh[2 * n :])
            s = (1 - z) * candidate + z * s
            pre = model.deep_output.weight @ torch.cat([s, model.tgt_embed.weight[y], c])
            pre = pre + model.deep_output.bias
            t = torch.maximum(pre[0::2], pre[1::2])  # max(t̃_{2k-1}, t̃_{2k})
            expected.append(model.out_proj.weight @ t)
        assert_close(model(src, None, tgt_in)[0], torch.stack(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("score", ["dot", "general", "concat"])
@pytest.mark.parametrize("feeding", [True, False])
def test_luong_equals_the_papers_equations_written_out(score, feeding):
    """Luong et al.: the decoder LSTM starts from the encoder's final states and reads
    [E y_{t-1}; h̃_{t-1}] (input feeding) or E y_{t-1}; score(h_t, h̄_s) is h_tᵀ h̄_s,
    h_tᵀ W_a h̄_s or v_aᵀ tanh(W_a [h_t; h̄_s]); h̃_t = tanh(W_c [c_t; h_t]); W_s h̃_t."""
    model = _model("luong_general", luong_score=score, input_feeding=feeding)
    assert isinstance(model, LuongNMT)
    src = torch.randint(4, VOCAB, (1, 6))
    tgt_in = torch.randint(4, VOCAB, (1, 4))
    att = model.attention
    with torch.no_grad():
        memory, (h, c) = model.encoder(model.src_embed(src))  # h̄ (1, S, H); (L, 1, H)
        hbar = memory[0]
        feed = torch.zeros(1, 1, model.config.d_model)
        expected = []
        for y in tgt_in[0]:
            x = model.tgt_embed.weight[y].view(1, 1, -1)
            top, (h, c) = model.decoder(torch.cat([x, feed], -1) if feeding else x, (h, c))
            ht = top[0, 0]
            if score == "dot":
                e = hbar @ ht
            elif score == "general":
                e = (att.key_proj.weight @ hbar.T).T @ ht
            else:
                w_q, w_k = att.query_proj.weight, att.key_proj.weight
                w_a = torch.cat([w_q, w_k], 1)  # W_a [h_t; h̄_s]
                e = torch.stack(
                    [att.v.weight[0] @ torch.tanh(w_a @ torch.cat([ht, hs])) for hs in hbar]
                )
            ct = torch.softmax(e, 0) @ hbar
            tilde = torch.tanh(model.combine.weight @ torch.cat([ct, ht]))
            feed = tilde.view(1, 1, -1)
            expected.append(model.out_proj.weight @ tilde)
        assert_close(model(src, None, tgt_in)[0], torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_rnnsearch_deviations_start_at_the_paper_and_dropout_0_is_its_model():
    """The tagged deviations of RNNsearch: the biases of s_0 and of the deep output, which
    appendix A's equations do not have, are 0 in a fresh model, so that it computes
    s_0 = tanh(W_s h←_1) and t̃_i = U_o s_i + V_o E y_{i-1} + C_o c_i exactly; the preset's
    dropout is the run's 0.1, and model.dropout = 0 (the paper's: none) makes training
    compute what evaluation does."""
    torch.manual_seed(0)
    config = config_from_dict({"preset": "rnnsearch", "model": {"vocab_size": VOCAB}}).model
    assert config.dropout == 0.1
    fresh = build_model(config)
    assert isinstance(fresh, RNNSearch)
    assert not fresh.init_state.bias.any() and not fresh.deep_output.bias.any()
    src = torch.randint(4, VOCAB, (1, 6))
    tgt_in = torch.randint(4, VOCAB, (1, 4))
    with torch.no_grad():
        encoded = fresh.encode(src, None)
        n = fresh.hidden_size
        s0 = torch.tanh(fresh.init_state.weight @ encoded.memory[0, 0, n:])  # no bias
        assert_close(fresh._start(encoded, None, 4, 1).states[0][0], s0)
    for dropout, same in ((0.0, True), (0.1, False)):
        model = _model("bahdanau", dropout=dropout)
        with torch.no_grad():
            evaluated = model.eval()(src, None, tgt_in)
            torch.manual_seed(2)
            trained = model.train()(src, None, tgt_in)
        assert torch.equal(trained, evaluated) is same
