import random
from pathlib import Path

import numpy as np
import pytest
import torch

from aiayn.data.batching import TokenBatchSampler
from aiayn.data.collate import BOS_ID, EOS_ID, PAD_ID
from aiayn.data.corpus import Corpus, load_manifest, tokenizer_path
from aiayn.data.prepare import prepare_data
from aiayn.data.sampling import BpeDropoutPairs, check_bpe_dropout
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import ConfigError
from aiayn.inference import loading
from aiayn.model.families import build_model
from aiayn.training.trainer import Trainer
from tests.helpers import tiny_config

WORDS = "understanding translation sentences attention positional encoding".split()
VOCAB = 120


def _write(prefix: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(1, 8))
        src.append(" ".join(words))
        tgt.append(" ".join(w.upper() for w in reversed(words)))
    Path(f"{prefix}.xx").write_text("".join(s + "\n" for s in src), encoding="utf-8")
    Path(f"{prefix}.yy").write_text("".join(t + "\n" for t in tgt), encoding="utf-8")
    return prefix


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    prepare_data(
        _write(root / "train", 300, 1), _write(root / "valid", 20, 2), None, "xx", "yy", VOCAB,
        root / "data",
    )  # fmt: skip
    return root / "data"


def _pairs(data_dir, dropout=0.3, max_len=256, seed=1):
    corpus = Corpus.open(data_dir, "train")
    tokenizer = Tokenizer.load(tokenizer_path(data_dir))
    return BpeDropoutPairs(corpus, tokenizer, dropout, seed=seed, max_len=max_len), tokenizer


def _rows(ids, lead):
    """The token rows of a padded matrix, without padding, BOS or EOS."""
    rows = []
    for row in ids.tolist():
        row = [t for t in row if t != PAD_ID]
        rows.append(row[1:] if lead else row[:-1])
    return rows


def test_samples_keep_the_text_and_change_with_the_epoch(data_dir):
    pairs, tokenizer = _pairs(data_dir)
    corpus = pairs.corpus
    idx = np.arange(40)
    first = pairs.batch(idx)
    assert torch.equal(first.src_ids, pairs.batch(idx).src_ids)  # same epoch, same draw
    assert (first.src_ids[first.src_ids != PAD_ID] != BOS_ID).all()
    plain = corpus.batch(idx)
    # More pieces than the one segmentation, and the same sentences.
    assert first.n_src_tokens > plain.n_src_tokens and first.n_tgt_tokens > plain.n_tgt_tokens
    sources, targets = corpus.src_texts(), corpus.tgt_texts()
    for i, (src, tgt_in, tgt_out) in enumerate(
        zip(
            _rows(first.src_ids, False),
            _rows(first.tgt_in, True),
            _rows(first.tgt_out, False),
            strict=True,
        )
    ):
        assert tgt_in == tgt_out
        assert tokenizer.decode(src) == sources[i]
        assert tokenizer.decode(tgt_in) == targets[i]
    assert (first.tgt_out == EOS_ID).sum() == len(idx)
    pairs.set_epoch(1)
    assert not torch.equal(first.src_ids, pairs.batch(idx).src_ids)


def test_a_sample_longer_than_max_len_keeps_the_prepared_ids(data_dir):
    corpus = Corpus.open(data_dir, "train")
    longest = int(max(corpus.src_lengths.max(), corpus.tgt_lengths.max()))
    pairs, _ = _pairs(data_dir, dropout=0.9, max_len=longest)
    idx = np.argsort(-corpus.src_lengths)[:20]
    batch = pairs.batch(idx)
    src = _rows(batch.src_ids, False)
    assert max(map(len, src)) <= longest
    kept = [row for row, i in zip(src, idx, strict=True) if row == corpus.pair(int(i))[0].tolist()]
    assert kept  # the longest sentences, sampled at p = 0.9, fell back


def test_bpe_dropout_needs_a_bpe_vocabulary(data_dir):
    manifest = load_manifest(data_dir)
    tokenizer = Tokenizer.load(tokenizer_path(data_dir))
    check_bpe_dropout(0.1, manifest, tokenizer)
    manifest["tokenizer_options"]["model_type"] = "unigram"
    with pytest.raises(ConfigError, match="needs a BPE vocabulary"):
        check_bpe_dropout(0.1, manifest, tokenizer)
    with pytest.raises(ConfigError, match="bpe_dropout"):
        tiny_config("data.bpe_dropout=1.0")


def _trainer(data_dir, run_dir, steps):
    config = tiny_config(
        f"model.vocab_size={VOCAB}", "data.bpe_dropout=0.2", "data.max_tokens=200",
        f"train.max_steps={steps}", "train.save_interval_steps=5",
    )  # fmt: skip
    torch.manual_seed(config.train.seed)
    pairs, _ = _pairs(data_dir, dropout=0.2, seed=config.train.seed)
    sampler = TokenBatchSampler(pairs.src_lengths, pairs.tgt_lengths, 200, seed=1)
    model = build_model(config.model)
    return Trainer(config, model, pairs, sampler, run_dir, show_progress=False, tensorboard=False)


@pytest.mark.usefixtures("single_thread")
def test_resume_draws_the_same_samples(data_dir, tmp_path):
    # 300 short pairs in batches of 200 tokens: about 12 batches an epoch, so 30 updates
    # cross epochs, and the resumed half starts inside one.
    straight = _trainer(data_dir, tmp_path / "a", 30)
    straight.train()
    first = _trainer(data_dir, tmp_path / "b", 15)
    first.train()
    _, state = loading.latest_valid_checkpoint(tmp_path / "b")
    torch.manual_seed(77)
    second = _trainer(data_dir, tmp_path / "b", 30)
    second.load_state_dict(state)
    second.train()
    assert straight.epoch == second.epoch >= 2
    assert straight.corpus.epoch == second.corpus.epoch == straight.epoch  # told by the trainer
    for (name, a), (_, b) in zip(
        straight.model.state_dict().items(), second.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    for trainer in (straight, first, second):
        trainer.close()
