import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from aiayn.data.batching import TokenBatchSampler
from aiayn.data.collate import BOS_ID, EOS_ID, PAD_ID, UNK_ID, collate_pairs
from aiayn.data.corpus import Corpus, load_manifest, tokenizer_path
from aiayn.data.prepare import prepare_data
from aiayn.data.tokenizer import Tokenizer, train_tokenizer
from aiayn.errors import UserError
from tests.helpers import write_upper_reversed

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
)


def _write(prefix: Path, n: int, seed: int) -> Path:
    return write_upper_reversed(prefix, n, seed, WORDS, max_words=14)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    prepare_data(
        _write(root / "train", 500, 1), _write(root / "valid", 30, 2), None, "xx", "yy", 90,
        root / "data",
    )  # fmt: skip
    return root / "data"


def _assert_same_batch(a, b):
    for name in ("src_ids", "src_pad", "tgt_in", "tgt_out"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_batch_equals_collate_pairs_of_the_same_pairs(data_dir):
    corpus = Corpus.open(data_dir, "train")
    rng = np.random.default_rng(0)
    for size in (1, 2, 7, 40):
        indices = rng.choice(len(corpus), size=size, replace=False)
        batch = corpus.batch(indices)
        pairs = [corpus.pair(int(i)) for i in indices]
        reference = collate_pairs([s.tolist() for s, _ in pairs], [t.tolist() for _, t in pairs])
        _assert_same_batch(batch, reference)
        assert batch.src_ids.dtype == torch.long
        assert int(batch.src_ids[0, corpus.src_lengths[indices[0]]]) == EOS_ID
        assert int(batch.tgt_in[0, 0]) == BOS_ID


def test_batches_from_the_sampler_fit_the_budget(data_dir):
    corpus = Corpus.open(data_dir, "train")
    sampler = TokenBatchSampler(corpus.src_lengths, corpus.tgt_lengths, 200, seed=1)
    total = 0
    for indices in sampler:
        batch = corpus.batch(indices)
        assert batch.src_ids.numel() <= 200 and batch.tgt_out.numel() <= 200
        total += batch.n_tgt_tokens
    assert total == int(corpus.tgt_lengths.sum()) + len(corpus)  # every target token + EOS


def test_lengths_and_pairs_agree(data_dir):
    corpus = Corpus.open(data_dir, "valid")
    assert len(corpus) == 30 == len(corpus.src_lengths) == len(corpus.tgt_lengths)
    tokenizer = Tokenizer.load(tokenizer_path(data_dir))
    for i, (src_text, tgt_text) in enumerate(
        zip(corpus.src_texts(), corpus.tgt_texts(), strict=True)
    ):
        src, tgt = corpus.pair(i)
        assert type(src) is np.ndarray and src.dtype == np.int64
        assert src.tolist() == tokenizer.encode(src_text)
        assert tgt.tolist() == tokenizer.encode(tgt_text)
        assert PAD_ID not in src.tolist() and EOS_ID not in tgt.tolist()
    with pytest.raises(IndexError):
        corpus.pair(30)


def test_corpus_pickles_without_copying_the_arrays(data_dir):
    corpus = Corpus.open(data_dir, "train")
    data = pickle.dumps(corpus)
    assert len(data) < 1000  # paths only; workers reopen the memory maps
    clone = pickle.loads(data)
    _assert_same_batch(clone.batch([0, 1, 2]), corpus.batch([0, 1, 2]))


def test_missing_split_or_directory_is_a_user_error(data_dir, tmp_path):
    with pytest.raises(UserError, match="no 'test' split"):
        Corpus.open(data_dir, "test")
    with pytest.raises(UserError, match="not a prepared data directory"):
        Corpus.open(tmp_path, "train")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match=r"manifest\.json, line 1"):
        load_manifest(tmp_path)


def test_damaged_token_file_is_a_user_error(data_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    (copy / "valid.yy.bin").write_bytes((copy / "valid.yy.bin").read_bytes()[:-2])
    with pytest.raises(UserError, match=r"valid\.yy"):
        Corpus.open(copy, "valid")


def test_a_token_id_outside_the_vocabulary_names_the_file_and_line(data_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    corpus = Corpus.open(copy, "train")
    ids = np.memmap(copy / "train.yy.bin", dtype=load_manifest(copy)["dtype"], mode="r+")
    line = 37  # from 0: the 38th line of train.yy
    ids[int(corpus._tgt_off[line]) + 1] = corpus.vocab_size
    ids.flush()
    corpus = Corpus.open(copy, "train")
    corpus.batch([0, 1, 36, 38])  # the lines around it are read
    vocab = corpus.vocab_size
    message = rf"train\.yy\.bin: the sentence of line 38 of train\.yy holds token id {vocab}, "
    with pytest.raises(UserError, match=message):
        corpus.batch([3, line, 9])
    # Separate vocabularies: the target side is checked against its own size.
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tgt_vocab_size"] = corpus.vocab_size + 10
    (copy / "manifest.json").write_text(json.dumps(manifest))
    Corpus.open(copy, "train").batch([3, line, 9])
    ids[int(corpus._tgt_off[line]) + 1] = corpus.vocab_size + 10
    ids.flush()
    beyond = vocab + 10
    with pytest.raises(UserError, match=rf"id {beyond}, outside the vocabulary of {beyond}:"):
        Corpus.open(copy, "train").batch([line])
    # And the source side against its own: an id the target vocabulary has is refused there.
    ids[int(corpus._tgt_off[line]) + 1] = 4
    ids.flush()
    source = np.memmap(copy / "train.xx.bin", dtype=load_manifest(copy)["dtype"], mode="r+")
    source[int(corpus._src_off[line])] = vocab + 5
    source.flush()
    with pytest.raises(UserError, match=rf"train\.xx\.bin: .* id {vocab + 5}, outside .* {vocab}:"):
        Corpus.open(copy, "train").batch([line])


def test_tokenizer_round_trips_and_keeps_the_special_ids(tmp_path):
    text = tmp_path / "text.txt"
    rng = random.Random(3)
    lines = [" ".join(rng.choices(WORDS, k=rng.randint(2, 9))) for _ in range(300)]
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = train_tokenizer([text], 60, tmp_path / "spm")
    assert tokenizer.vocab_size == 60
    assert [tokenizer.piece(i) for i in (PAD_ID, UNK_ID, BOS_ID, EOS_ID)] == [
        "<pad>",
        "<unk>",
        "<s>",
        "</s>",
    ]
    for line in lines[:20]:
        ids = tokenizer.encode(line)
        assert ids and BOS_ID not in ids and EOS_ID not in ids
        assert tokenizer.decode(ids) == line
        assert tokenizer.decode([BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]) == line
    clone = Tokenizer.from_bytes(tokenizer.to_bytes())
    assert clone.encode(lines[0]) == tokenizer.encode(lines[0])
    assert Tokenizer.load(tmp_path / "spm.model").to_bytes() == tokenizer.to_bytes()
    assert tokenizer.encode_batch(lines[:5]) == [tokenizer.encode(x) for x in lines[:5]]
    assert UNK_ID in tokenizer.encode("ω")  # a character never seen in training


def test_tokenizer_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        Tokenizer.load(tmp_path / "missing.model")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(UserError, match="not a usable sentencepiece model"):
        Tokenizer.load(tmp_path / "bad.model")
    text = tmp_path / "t.txt"
    text.write_text("abc def ghi jkl mno pqr stu vwx yz\n" * 5)
    with pytest.raises(UserError, match="smaller than"):
        train_tokenizer([text], 10, tmp_path / "m")
