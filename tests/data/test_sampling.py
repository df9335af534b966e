from pathlib import Path

import numpy as np
import pytest
import torch

from aiayn.data.batching import TokenBatchSampler
from aiayn.data.collate import EOS_ID, PAD_ID
from aiayn.data.corpus import Corpus, load_manifest, tokenizer_path
from aiayn.data.prepare import prepare_data
from aiayn.data.sampling import BpeDropoutPairs, check_bpe_dropout
from aiayn.data.tokenizer import Tokenizer, train_tokenizer
from aiayn.errors import ConfigError
from aiayn.inference import loading
from aiayn.model.families import build_model
from aiayn.training.trainer import Trainer
from tests.helpers import tiny_config, write_upper_reversed

WORDS = "understanding translation sentences attention positional encoding".split()
VOCAB = 120


def _write(prefix: Path, n: int, seed: int) -> Path:
    return write_upper_reversed(prefix, n, seed, WORDS, max_words=8)


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


def test_samples_keep_the_text_and_change_with_the_epoch_and_seed(data_dir):
    pairs, tokenizer = _pairs(data_dir)
    corpus = pairs.corpus
    idx = np.arange(40)
    first = pairs.batch(idx)
    again = pairs.batch(idx)  # same seed, epoch and pairs: the same draw
    for name in ("src_ids", "tgt_in", "tgt_out"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    plain = corpus.batch(idx)
    # More pieces than the one segmentation, and the same sentences.
    assert first.n_src_tokens > plain.n_src_tokens and first.n_tgt_tokens > plain.n_tgt_tokens
    sources, targets = corpus.src_texts(), corpus.tgt_texts()
    rows = zip(
        _rows(first.src_ids, False),
        _rows(first.tgt_in, True),
        _rows(first.tgt_out, False),
        strict=True,
    )
    for i, (src, tgt_in, tgt_out) in enumerate(rows):
        assert tgt_in == tgt_out
        assert tokenizer.decode(src) == sources[i]
        assert tokenizer.decode(tgt_in) == targets[i]
    assert (first.tgt_out == EOS_ID).sum() == len(idx)
    pairs.set_epoch(1)
    assert not torch.equal(first.src_ids, pairs.batch(idx).src_ids)
    other, _ = _pairs(data_dir, seed=2)
    assert not torch.equal(first.tgt_in, other.batch(idx).tgt_in)


def test_the_text_lines_are_the_prepared_sentences(data_dir):
    pairs, tokenizer = _pairs(data_dir)
    corpus = pairs.corpus
    for i in range(len(corpus)):
        src, tgt = corpus.pair(i)
        assert tokenizer.encode(pairs.src_texts[i]) == src.tolist()
        assert tokenizer.encode(pairs.tgt_texts[i]) == tgt.tolist()


def test_a_sample_longer_than_max_len_keeps_the_prepared_ids_on_both_sides(data_dir):
    corpus = Corpus.open(data_dir, "train")
    longest = int(max(corpus.src_lengths.max(), corpus.tgt_lengths.max()))
    pairs, _ = _pairs(data_dir, dropout=0.9, max_len=longest)
    idx = np.argsort(-corpus.src_lengths)[:20]
    batch = pairs.batch(idx)
    src, tgt = _rows(batch.src_ids, False), _rows(batch.tgt_in, True)
    fell_back = 0
    for s, t, i in zip(src, tgt, idx.tolist(), strict=True):
        assert len(s) <= longest and len(t) <= longest
        prepared_src, prepared_tgt = corpus.pair(i)
        if s == prepared_src.tolist():
            assert t == prepared_tgt.tolist()
            fell_back += 1
    assert fell_back  # the longest sentences, sampled at p = 0.9, are too long


def test_bpe_dropout_needs_a_bpe_vocabulary(data_dir, tmp_path):
    check_bpe_dropout(0.1, Tokenizer.load(tokenizer_path(data_dir)))
    text = _write(tmp_path / "text", 300, 3)
    unigram = train_tokenizer([Path(f"{text}.xx")], 20, tmp_path / "uni", "unigram")
    with pytest.raises(ConfigError, match=r"needs a BPE vocabulary .*, not a unigram"):
        check_bpe_dropout(0.1, unigram)
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


def test_training_caps_samples_at_the_prepared_length_and_the_positions(data_dir):
    from aiayn.training.launch import _bpe_dropout_pairs

    corpus = Corpus.open(data_dir, "train")
    tokenizer = Tokenizer.load(tokenizer_path(data_dir))
    longest = int(max(corpus.src_lengths.max(), corpus.tgt_lengths.max()))
    for positions, cap in ((1024, 256), (longest + 1, longest)):  # prepare's --max-len: 256
        config = tiny_config("data.bpe_dropout=0.5", f"model.max_positions={positions}")
        pairs = _bpe_dropout_pairs(load_manifest(data_dir), corpus, tokenizer, config)
        assert pairs.max_len == cap
    batch = pairs.batch(np.arange(len(corpus)))
    assert batch.src_ids.size(1) <= longest + 1 and batch.tgt_in.size(1) <= longest + 1


@pytest.mark.usefixtures("single_thread")
def test_a_resumed_run_says_its_samples_are_not_the_uninterrupted_runs(data_dir, tmp_path, capsys):
    from aiayn.cli import main
    from tests.helpers import TINY

    args = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(tmp_path / "run")]
    args += ["--no-progress", "data.bpe_dropout=0.1", "train.valid_interval=0"]
    args += ["train.save_interval_steps=2", "train.average_last=0"]
    assert main([*args, "train.max_steps=2"]) == 0
    assert "note: data.bpe_dropout" not in capsys.readouterr().err
    assert main([*args, "train.max_steps=4"]) == 0
    err = capsys.readouterr().err
    assert "resuming from" in err and "does not repeat the uninterrupted one exactly" in err
