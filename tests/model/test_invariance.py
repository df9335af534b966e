"""Incremental decoding, causality, padding and batch invariance of the whole model."""

import pytest
import torch
from torch.testing import assert_close

from aiayn.config import load_config
from aiayn.model import Transformer


def _model(*overrides):
    config = load_config(overrides=["preset=tiny", *overrides]).model
    return Transformer(config).eval()


def _batch():
    lengths = [7, 3, 5, 1]
    src_ids = torch.randint(4, 64, (4, 7))
    src_pad = torch.arange(7)[None, :] >= torch.tensor(lengths)[:, None]
    tgt_in = torch.randint(4, 64, (4, 6))
    return src_ids.masked_fill(src_pad, 0), src_pad, tgt_in


def _step_all(model, src_ids, src_pad, tgt_in, cache=None):
    memory = model.encode(src_ids, src_pad)
    cache = model.init_cache(memory, src_pad, max_len=tgt_in.size(1))
    return torch.stack([model.decode_step(tgt_in[:, t], cache) for t in range(tgt_in.size(1))], 1)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model.positional=learned",),
        ("model.pre_norm=true",),
        ("model.share_embeddings=false",),
        ("model.d_k=4", "model.d_v=12"),
    ],
)
def test_cached_decoding_equals_forward_at_every_position(overrides):
    model = _model(*overrides)
    src_ids, src_pad, tgt_in = _batch()
    with torch.no_grad():
        assert_close(_step_all(model, src_ids, src_pad, tgt_in), model(src_ids, src_pad, tgt_in))


def test_reorder_and_keep_preserve_cached_decoding():
    model = _model()
    src_ids, src_pad, tgt_in = _batch()
    with torch.no_grad():
        full = model(src_ids, src_pad, tgt_in)
        cache = model.init_cache(model.encode(src_ids, src_pad), src_pad, max_len=6)
        for t in range(2):
            model.decode_step(tgt_in[:, t], cache)
        # reorder: rows now hold old rows [2, 0, 0, 3] (rows may repeat, as in beam search)
        rows = torch.tensor([2, 0, 0, 3])
        cache.reorder(rows)
        logits = model.decode_step(tgt_in[rows, 2], cache)
        assert_close(logits, full[rows, 2])
        # keep: drop two rows; the batch shrinks and the survivors are unchanged
        keep = torch.tensor([3, 0])
        cache.keep(keep)
        assert cache.batch_size == 2
        survivors = rows[keep]
        for t in range(3, 6):
            logits = model.decode_step(tgt_in[survivors, t], cache)
            assert_close(logits, full[survivors, t])


def test_cache_is_preallocated_and_bounded():
    model = _model()
    src_ids, src_pad, tgt_in = _batch()
    cache = model.init_cache(model.encode(src_ids, src_pad), src_pad, max_len=2)
    buffer = cache.layers[0].self_k
    assert buffer.shape[2] == 2
    with torch.no_grad():
        model.decode_step(tgt_in[:, 0], cache)
        model.decode_step(tgt_in[:, 1], cache)
        assert cache.layers[0].self_k.data_ptr() == buffer.data_ptr()  # written in place
        with pytest.raises(ValueError, match="cache is full"):
            model.decode_step(tgt_in[:, 0], cache)


def test_changing_a_target_token_leaves_earlier_logits_bit_identical():
    model = _model()
    src_ids, src_pad, tgt_in = _batch()
    with torch.no_grad():
        before = model(src_ids, src_pad, tgt_in)
        for t in range(1, tgt_in.size(1)):
            changed = tgt_in.clone()
            changed[:, t] = (changed[:, t] + 7) % 60 + 4
            after = model(src_ids, src_pad, changed)
            assert torch.equal(before[:, :t], after[:, :t])
            assert not torch.equal(before[:, t], after[:, t])


def test_padding_and_batch_invariance():
    model = _model()
    src_ids, src_pad, tgt_in = _batch()
    with torch.no_grad():
        batched = model(src_ids, src_pad, tgt_in)
        for i in range(src_ids.size(0)):
            n = int((~src_pad[i]).sum())
            alone = model(src_ids[i : i + 1, :n], None, tgt_in[i : i + 1])
            assert_close(alone, batched[i : i + 1])
            # Extra padding changes nothing either.
            wider = torch.cat([src_ids[i : i + 1, :n], torch.zeros(1, 9, dtype=torch.long)], 1)
            wider_pad = wider == 0
            assert_close(model(wider, wider_pad, tgt_in[i : i + 1]), alone)


def test_dropout_is_active_only_in_training():
    model = _model("model.dropout=0.5")
    src_ids, src_pad, tgt_in = _batch()
    with torch.no_grad():
        model.train()
        a, b = model(src_ids, src_pad, tgt_in), model(src_ids, src_pad, tgt_in)
        assert not torch.equal(a, b)
        model.eval()
        assert torch.equal(model(src_ids, src_pad, tgt_in), model(src_ids, src_pad, tgt_in))


def test_log_probs_step_is_the_log_softmax_of_decode_step():
    # log_probs_step writes the log-softmax over the logits (out= aliasing its input).
    model = _model()
    src_ids, src_pad, tgt_in = _batch()
    with torch.no_grad():
        memory = model.encode(src_ids, src_pad)
        a = model.init_cache(memory, src_pad, max_len=3)
        b = model.init_cache(memory, src_pad, max_len=3)
        for t in range(3):
            expected = torch.log_softmax(model.decode_step(tgt_in[:, t], b), dim=-1)
            assert torch.equal(model.log_probs_step(tgt_in[:, t], a), expected)


def test_log_probs_step_keeps_autograd_working():
    model = _model()
    src_ids, src_pad, tgt_in = _batch()
    cache = model.init_cache(model.encode(src_ids, src_pad), src_pad, max_len=1)
    log_probs = model.log_probs_step(tgt_in[:, 0], cache)
    log_probs[:, 5].sum().backward()
    assert model.out_proj.weight.grad is not None


def test_log_probs_steps_through_keep_equal_teacher_forcing():
    model = _model()
    src_ids, src_pad, tgt_in = _batch()
    with torch.no_grad():
        full = torch.log_softmax(model(src_ids, src_pad, tgt_in), dim=-1)
        cache = model.init_cache(model.encode(src_ids, src_pad), src_pad, max_len=6)
        assert_close(model.log_probs_step(tgt_in[:, 0], cache), full[:, 0])
        assert_close(model.log_probs_step(tgt_in[:, 1], cache), full[:, 1])
        keep = torch.tensor([3, 1])
        cache.keep(keep)
        assert_close(model.log_probs_step(tgt_in[keep, 2], cache), full[keep, 2])


def test_log_probs_step_under_autocast_projects_as_decode_step_does():
    model = _model()
    src_ids, src_pad, tgt_in = _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        memory = model.encode(src_ids, src_pad)
        a = model.init_cache(memory, src_pad, max_len=2)
        b = model.init_cache(memory, src_pad, max_len=2)
        for t in range(2):
            expected = torch.log_softmax(model.decode_step(tgt_in[:, t], b).float(), dim=-1)
            assert torch.equal(model.log_probs_step(tgt_in[:, t], a), expected)
