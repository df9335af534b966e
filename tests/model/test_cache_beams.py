"""A cache with ``beam_size`` rows per sentence (memory projected once per sentence) decodes
exactly like a cache over the memory repeated ``beam_size`` times."""

import torch
from torch.testing import assert_close

from aiayn.config import ModelConfig
from aiayn.model.transformer import Transformer


def _model() -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=40, d_model=32, d_ff=64, n_heads=4, n_layers=2, dropout=0.0)
    return Transformer(config).eval()


def test_grouped_beams_equal_repeated_memory_through_reorder_and_keep():
    model = _model()
    k = 3
    src_ids = torch.randint(4, 40, (4, 7))
    src_pad = torch.zeros_like(src_ids, dtype=torch.bool)
    src_pad[1, 5:] = True
    src_pad[3, 2:] = True
    tokens = torch.randint(4, 40, (4 * k, 6))
    with torch.no_grad():
        memory = model.encode(src_ids, src_pad)
        grouped = model.init_cache(memory, src_pad, max_len=6, beam_size=k)
        repeated = model.init_cache(
            memory.repeat_interleave(k, 0), src_pad.repeat_interleave(k, 0), max_len=6
        )
        for t in range(2):
            assert_close(
                model.decode_step(tokens[:, t], grouped),
                model.decode_step(tokens[:, t], repeated),
            )
        # Beam search moves rows only within a sentence's group of k rows.
        rows = torch.tensor([2, 2, 0, 3, 5, 4, 8, 6, 6, 11, 9, 10])
        grouped.reorder(rows)
        repeated.reorder(rows)
        tokens = tokens[rows]
        assert_close(
            model.decode_step(tokens[:, 2], grouped), model.decode_step(tokens[:, 2], repeated)
        )
        # Sentences 1 and 3 finish: keep the groups of sentences 2 and 0, in that order.
        keep = torch.tensor([7, 6, 8, 1, 0, 2])
        grouped.keep(keep)
        repeated.keep(keep)
        tokens = tokens[keep]
        assert grouped.batch_size == repeated.batch_size == 6
        assert grouped.layers[0].cross_k.size(0) == 2
        for t in range(3, 6):
            assert_close(
                model.decode_step(tokens[:, t], grouped),
                model.decode_step(tokens[:, t], repeated),
            )


def test_reorder_moves_lineage_not_keys_and_values():
    model = _model()
    src_ids = torch.randint(4, 40, (2, 5))
    with torch.no_grad():
        cache = model.init_cache(model.encode(src_ids, None), None, max_len=4, beam_size=2)
        model.decode_step(torch.tensor([2, 2, 2, 2]), cache)
        layer = cache.layers[0]
        keys = layer.self_k[:, :, :1].clone()  # the written position (the rest is unset)
        pointer = layer.self_k.data_ptr()
        cache.reorder(torch.tensor([1, 1, 2, 3]))
        # Slots stay where they were; sentence 0's two rows now both descend from slot 1.
        assert layer.self_k.data_ptr() == pointer and torch.equal(layer.self_k[:, :, :1], keys)
        assert cache.lineage is not None
        assert cache.lineage[:, 0].tolist() == [1, 1, 0, 1]
        mask = cache.self_attention_mask()  # for position 1: keys (j=0: b0, b1; j=1: b0, b1)
        assert mask is not None and mask.shape == (2, 1, 2, 4)
        allowed = (mask[0, 0] == 0).tolist()
        assert allowed == [[False, True, True, False], [False, True, False, True]]


def test_keep_moves_only_the_rows_that_change_place():
    """keep() in any order (duplicates too) gives what index_select would, in the same
    buffers; search's order keeps every sentence that stays among the first n in place."""
    from aiayn.inference.search import kept_in_place

    done = torch.tensor([False, True, False, False, True, False, False])
    order = kept_in_place(done)
    assert order.tolist() == [0, 5, 2, 3, 6]  # 1 and 4 finished: 5 and 6 take their places
    assert kept_in_place(torch.tensor([False, False])).tolist() == [0, 1]
    assert kept_in_place(torch.tensor([True, True])).numel() == 0
    model = _model()
    src_ids = torch.randint(4, 40, (7, 5))
    for rows in (order, torch.tensor([3, 0, 0, 6]), torch.tensor([6, 5, 4, 3, 2, 1, 0])):
        with torch.no_grad():
            cache = model.init_cache(model.encode(src_ids, None), None, max_len=4)
            for _ in range(2):
                model.decode_step(torch.randint(4, 40, (7,)), cache)
        layer = cache.layers[0]
        expected = [t.index_select(0, rows).clone() for t in (layer.self_k, layer.cross_v)]
        pointers = layer.self_k.data_ptr(), layer.cross_v.data_ptr()
        cache.keep(rows)
        assert (layer.self_k.data_ptr(), layer.cross_v.data_ptr()) == pointers
        assert torch.equal(layer.self_k[:, :, :2], expected[0][:, :, :2])
        assert torch.equal(layer.cross_v, expected[1])


def test_search_with_autograd_on_drops_finished_sentences_too():
    """With autograd recording, keep() gathers into new tensors (the cross-attention keys and
    values are views autograd will not let change in place) and decodes as without it."""
    from aiayn.inference.search import beam_search, greedy_search

    model = _model()
    src_ids = torch.randint(4, 40, (3, 5))
    limits = torch.tensor([2, 10, 5])  # sentences stop at different steps: keep() runs
    results = []
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            memory = model.encode(src_ids, None)
            cache = model.init_cache(memory, None, 11)
            greedy = greedy_search(model.log_probs_step, cache, 3, max_len=limits)
            cache = model.init_cache(memory, None, 11, beam_size=2)
            beams = beam_search(model.log_probs_step, cache, 3, beam_size=2, max_len=limits)
        results.append(([h.tokens for h in greedy], [h[0].tokens for h in beams]))
    assert results[0] == results[1]


def test_a_bfloat16_model_caches_in_bfloat16_and_steps_equal_teacher_forcing():
    """The cache keeps keys and values in the dtype of the model's projections (the
    accelerated model on the CPU keeps float32: tests/accel); cached steps give the
    teacher-forced logits, and the log-probabilities are float32."""
    model = _model().to(torch.bfloat16)
    src_ids = torch.randint(4, 40, (3, 7))
    src_pad = torch.zeros_like(src_ids, dtype=torch.bool)
    src_pad[1, 4:] = True
    tgt_in = torch.randint(4, 40, (3, 5))
    with torch.inference_mode():
        full = model(src_ids, src_pad, tgt_in)  # (3, 5, V), bfloat16
        cache = model.init_cache(model.encode(src_ids, src_pad), src_pad, max_len=5)
        layer = cache.layers[0]
        assert {layer.self_k.dtype, layer.self_v.dtype, layer.cross_k.dtype} == {torch.bfloat16}
        for t in range(4):
            assert_close(model.decode_step(tgt_in[:, t], cache), full[:, t])
        log_probs = model.log_probs_step(tgt_in[:, 4], cache)
    assert log_probs.dtype == torch.float32
    assert_close(log_probs, torch.log_softmax(full[:, 4].float(), -1))
