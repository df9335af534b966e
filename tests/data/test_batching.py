import numpy as np
import pytest

from aiayn.data.batching import TokenBatchSampler


def _lengths(n: int, seed: int = 0, high: int = 60) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(1, high, size=n)
    # Targets correlated with the source, as in real pairs, but not equal.
    tgt = np.clip(src + rng.integers(-5, 6, size=n), 1, None)
    return src, tgt


def _epoch(sampler: TokenBatchSampler) -> list[np.ndarray]:
    return [b.copy() for b in sampler]


@pytest.mark.parametrize("max_tokens", [70, 500, 4096])
def test_padded_tokens_never_exceed_the_budget(max_tokens):
    src, tgt = _lengths(3000)
    sampler = TokenBatchSampler(src, tgt, max_tokens, seed=3)
    for batch in _epoch(sampler):
        assert len(batch) >= 1
        # Padded size per side: rows x longest row, counting EOS (source) and BOS/EOS (target).
        assert len(batch) * int((src[batch] + 1).max()) <= max_tokens
        assert len(batch) * int((tgt[batch] + 1).max()) <= max_tokens


def test_every_pair_exactly_once_per_epoch():
    src, tgt = _lengths(2500, seed=1)
    sampler = TokenBatchSampler(src, tgt, 700, seed=5)
    for _ in range(2):
        seen = np.concatenate(_epoch(sampler))
        assert len(seen) == len(src)
        assert np.array_equal(np.sort(seen), np.arange(len(src)))


def test_same_seed_and_epoch_give_the_same_batches_and_epochs_differ():
    src, tgt = _lengths(1000, seed=2)
    a = TokenBatchSampler(src, tgt, 400, seed=7)
    b = TokenBatchSampler(src, tgt, 400, seed=7)
    a.set_epoch(4)
    b.set_epoch(4)
    batches_a, batches_b = _epoch(a), _epoch(b)
    assert len(batches_a) == len(batches_b)
    assert all(np.array_equal(x, y) for x, y in zip(batches_a, batches_b, strict=True))
    c = TokenBatchSampler(src, tgt, 400, seed=7)
    c.set_epoch(5)
    assert [x.tolist() for x in _epoch(c)] != [x.tolist() for x in batches_a]
    d = TokenBatchSampler(src, tgt, 400, seed=8)
    d.set_epoch(4)
    assert [x.tolist() for x in _epoch(d)] != [x.tolist() for x in batches_a]


def test_batches_group_similar_lengths():
    src, tgt = _lengths(4000, seed=4, high=120)
    sampler = TokenBatchSampler(src, tgt, 2000, seed=1)
    padded = sum(len(b) * int((src[b] + 1).max()) for b in _epoch(sampler))
    real = int((src + 1).sum())
    # A random grouping of these lengths wastes about half of the padded slots; sorted by length
    # the waste is a few percent.
    assert padded / real < 1.1


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("n", [37, 1000])
def test_rank_shards_are_disjoint_equally_long_and_cover_everything(world_size, n):
    src, tgt = _lengths(n, seed=n)
    shards = []
    for rank in range(world_size):
        sampler = TokenBatchSampler(src, tgt, 300, seed=9, rank=rank, world_size=world_size)
        sampler.set_epoch(2)
        batches = _epoch(sampler)
        assert len(batches) == len(sampler) > 0
        shards.append(batches)
    assert len({len(s) for s in shards}) == 1
    flat = [np.concatenate(s) for s in shards]
    everything = np.concatenate(flat)
    assert np.array_equal(np.sort(everything), np.arange(n))  # disjoint and complete
    for batches in shards:
        for batch in batches:
            assert len(batch) * int((src[batch] + 1).max()) <= 300


def test_resume_mid_epoch_continues_with_the_same_batches():
    src, tgt = _lengths(1500, seed=6)
    reference = TokenBatchSampler(src, tgt, 500, seed=2, rank=1, world_size=2)
    reference.set_epoch(3)
    full = _epoch(reference)
    assert len(full) > 6

    first = TokenBatchSampler(src, tgt, 500, seed=2, rank=1, world_size=2)
    first.set_epoch(3)
    iterator = iter(first)
    head = [next(iterator).copy() for _ in range(5)]
    state = first.state_dict()
    assert state == {"epoch": 3, "position": 5}
    assert all(type(v) is int for v in state.values())

    resumed = TokenBatchSampler(src, tgt, 500, seed=2, rank=1, world_size=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # a trainer calling set_epoch with the same epoch keeps the position
    tail = _epoch(resumed)
    assert len(head) + len(tail) == len(full)
    assert all(np.array_equal(x, y) for x, y in zip(head + tail, full, strict=True))
    # The epoch ended: the next one starts at 0.
    assert resumed.state_dict() == {"epoch": 4, "position": 0}
    reference.set_epoch(4)
    next_epoch = _epoch(reference)
    assert all(np.array_equal(x, y) for x, y in zip(_epoch(resumed), next_epoch, strict=True))


def test_set_epoch_to_a_new_epoch_restarts_the_position():
    src, tgt = _lengths(300, seed=8)
    sampler = TokenBatchSampler(src, tgt, 200, seed=1)
    iterator = iter(sampler)
    next(iterator)
    sampler.set_epoch(7)
    assert sampler.state_dict() == {"epoch": 7, "position": 0}


def test_unshuffled_batches_are_in_length_order():
    src, tgt = _lengths(500, seed=10)
    sampler = TokenBatchSampler(src, tgt, 300, shuffle=False)
    order = np.concatenate(_epoch(sampler))
    assert np.all(np.diff(src[order]) >= 0)


def test_bad_arguments_are_rejected():
    src, tgt = _lengths(50, seed=11, high=30)
    with pytest.raises(ValueError, match="longest sentence"):
        TokenBatchSampler(src, tgt, 10)
    with pytest.raises(ValueError, match="rank"):
        TokenBatchSampler(src, tgt, 100, rank=2, world_size=2)
    with pytest.raises(ValueError, match="equal"):
        TokenBatchSampler(src, tgt[:-1], 100)
    with pytest.raises(ValueError, match="ranks"):
        TokenBatchSampler(src[:3], tgt[:3], 100, world_size=4)
    sampler = TokenBatchSampler(src, tgt, 100)
    with pytest.raises(ValueError, match="outside"):
        sampler.load_state_dict({"epoch": 0, "position": len(sampler) + 1})
