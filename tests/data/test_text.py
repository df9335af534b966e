import math
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from aiayn.data.batching import TokenBatchSampler
from aiayn.data.collate import BOS_ID, EOS_ID, MASK_ID, PAD_ID, LabelBatch, TokenBatch
from aiayn.data.corpus import Corpus, data_kind, load_manifest, tokenizer_path
from aiayn.data.sources import bible
from aiayn.data.sources.bible_text import (
    BIBLE_BOOKS,
    BIBLE_GENRES,
    CHAPTER_SHARE,
    LM_TEST_BOOKS,
    LM_VALID_BOOKS,
    book_genre,
    book_split,
    canonical_order,
    chapter_splits,
)
from aiayn.data.text import TextCorpus, TextExamples, mask_tokens, prepare_bible_text, prepare_text
from aiayn.data.text import prepare as text_prepare_module
from aiayn.data.text.examples import FIRST_ORDINARY_ID
from aiayn.data.tokenizer import MASK_PIECE, Tokenizer, train_tokenizer
from aiayn.errors import ConfigError, UserError
from aiayn.lock import PREPARE_LOCK_NAME

WORDS = (
    "river stone light cloud green small runs sees under over quickly slowly house tree "
    "bird child woman man"
).split()


def _doc(rng: random.Random, longest: int = 40) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(1, longest)))


def _write(path: Path, lines: list[str]) -> Path:
    path.write_bytes("".join(line + "\n" for line in lines).encode("utf-8"))
    return path


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    """A prepared lm directory: 200 training documents of 1-40 words."""
    root = tmp_path_factory.mktemp("lm")
    rng = random.Random(1)
    train = _write(root / "train.txt", [_doc(rng) for _ in range(200)])
    valid = _write(root / "valid.txt", [_doc(rng) for _ in range(20)])
    prepare_text("lm", train, valid, None, root / "data", 100)
    return root / "data"


@pytest.fixture(scope="module")
def classify_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("classify")
    rng = random.Random(2)
    labels = ["wet", "dry", "mixed"]
    train = _write(root / "train.tsv", [f"{rng.choice(labels)}\t{_doc(rng)}" for _ in range(90)])
    valid = _write(root / "valid.tsv", [f"dry\t{_doc(rng)}", f"wet\t{_doc(rng)}"])
    prepare_text("classify", train, valid, None, root / "data", 100)
    return root / "data"


# -- the tokenizer ----------------------------------------------------------------------------


def test_text_tokenizers_carry_mask_at_its_id_translation_ones_do_not(tmp_path):
    text = _write(tmp_path / "t.txt", [_doc(random.Random(3)) for _ in range(50)])
    with_mask = train_tokenizer([text], 60, tmp_path / "a", user_defined_symbols=[MASK_PIECE])
    assert with_mask.piece(MASK_ID) == MASK_PIECE and with_mask.has_mask
    assert with_mask.encode(f"river {MASK_PIECE} stone").count(MASK_ID) == 1
    plain = train_tokenizer([text], 60, tmp_path / "b")
    assert not plain.has_mask and plain.piece(MASK_ID) != MASK_PIECE


def test_prepared_text_tokenizer_has_mask(lm_dir):
    tokenizer = Tokenizer.load(tokenizer_path(lm_dir))
    assert tokenizer.has_mask and tokenizer.vocab_size == 100
    assert load_manifest(lm_dir)["tokenizer_options"]["special_ids"]["mask"] == MASK_ID


# -- prepare_text -----------------------------------------------------------------------------


def test_lm_data_dir_holds_the_kept_lines(tmp_path):
    rng = random.Random(4)
    lines = [_doc(rng) for _ in range(60)]
    train = _write(tmp_path / "train.txt", [*lines[:30], "", "   ", *lines[30:]])
    valid = _write(tmp_path / "valid.txt", [_doc(rng) for _ in range(5)])
    test = _write(tmp_path / "test.txt", [_doc(rng) for _ in range(4)])
    manifest = prepare_text("lm", train, valid, test, tmp_path / "data", 80)
    assert manifest == load_manifest(tmp_path / "data") and data_kind(manifest) == "text"
    assert (manifest["kind"], manifest["task"], manifest["vocab_size"]) == ("text", "lm", 80)
    info = manifest["splits"]["train"]
    assert (info["lines"], info["input_lines"], info["dropped"]) == (60, 62, {"empty": 2})
    assert "labels" not in manifest
    corpus = TextCorpus.open(tmp_path / "data", "train")
    tokenizer = Tokenizer.load(tokenizer_path(tmp_path / "data"))
    assert len(corpus) == 60 and corpus.texts() == lines and corpus.labels is None
    for i in (0, 29, 30, 59):
        assert tokenizer.decode(corpus.ids(i).tolist()) == lines[i]
        assert corpus.lengths[i] == len(corpus.ids(i)) == len(tokenizer.encode(lines[i]))
    assert info["tokens"] == int(corpus.lengths.sum())
    assert info["longest"] == int(corpus.lengths.max())
    assert len(TextCorpus.open(tmp_path / "data", "test")) == 4
    restored = pickle.loads(pickle.dumps(corpus))
    assert np.array_equal(restored.ids(7), corpus.ids(7))


def test_classify_labels_come_from_train_sorted(classify_dir):
    manifest = load_manifest(classify_dir)
    assert manifest["labels"] == ["dry", "mixed", "wet"]
    train = TextCorpus.open(classify_dir, "train")
    raw = (classify_dir.parent / "train.tsv").read_text().splitlines()
    assert train.labels is not None and train.labels.dtype == np.int64
    assert [train.label_names[i] for i in train.labels] == [line.split("\t")[0] for line in raw]
    assert train.texts() == [line.split("\t", 1)[1] for line in raw]
    counts = manifest["splits"]["train"]["label_counts"]
    assert counts == {n: sum(line.startswith(n + "\t") for line in raw) for n in counts}
    valid = TextCorpus.open(classify_dir, "valid")
    assert valid.labels is not None and valid.labels.tolist() == [0, 2]


def test_classify_integer_labels_sort_numerically_given_labels_keep_their_order(tmp_path):
    train = _write(tmp_path / "train.tsv", [f"{n}\triver stone" for n in (10, 2, 1, 2)])
    valid = _write(tmp_path / "valid.tsv", ["1\tstone"])
    manifest = prepare_text("classify", train, valid, None, tmp_path / "a", 30)
    assert manifest["labels"] == ["1", "2", "10"]
    assert TextCorpus.open(tmp_path / "a", "train").labels.tolist() == [2, 1, 0, 1]
    given = ["10", "1", "2", "3"]
    manifest = prepare_text("classify", train, valid, None, tmp_path / "b", 30, labels=given)
    assert manifest["labels"] == given
    assert TextCorpus.open(tmp_path / "b", "train").labels.tolist() == [0, 2, 1, 2]
    assert manifest["splits"]["train"]["label_counts"]["3"] == 0
    with pytest.raises(UserError, match=r"train.tsv, line 1: label '10' is not one"):
        prepare_text("classify", train, valid, None, tmp_path / "c", 30, labels=["1", "2"])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("just text without a tab", "line 3: no tab"),
        ("\tsome text", "line 3: empty label"),
        ("wet\t   ", "line 3: empty text after the label 'wet'"),
    ],
)
def test_tsv_errors_name_file_and_line(tmp_path, line, message):
    train = _write(tmp_path / "train.tsv", ["wet\triver", "dry\tstone", line, "wet\ttree"])
    valid = _write(tmp_path / "valid.tsv", ["wet\triver"])
    with pytest.raises(UserError, match=f"{train}, {message}"):
        prepare_text("classify", train, valid, None, tmp_path / "out", 30)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_valid_label_unseen_in_train_is_an_error_naming_it(tmp_path):
    train = _write(tmp_path / "train.tsv", ["wet\triver", "dry\tstone"])
    valid = _write(tmp_path / "valid.tsv", ["wet\triver", "", "damp\tcloud"])
    with pytest.raises(UserError, match=rf"{valid}, line 3: label 'damp' is not one of the 2"):
        prepare_text("classify", train, valid, None, tmp_path / "out", 30)


def test_a_classifier_needs_two_classes(tmp_path):
    train = _write(tmp_path / "train.tsv", ["wet\triver", "wet\tstone"])
    with pytest.raises(UserError, match=rf"{re.escape(str(train))}: every line has the label"):
        prepare_text("classify", train, train, None, tmp_path / "out", 30)
    with pytest.raises(UserError, match=r"two label names or more, got \['wet'\]"):
        prepare_text("classify", train, train, None, tmp_path / "out", 30, labels=["wet"])
    given = ["dry", "wet"]  # both named, one used
    with pytest.raises(UserError, match=r"every line has the label 'wet'"):
        prepare_text("classify", train, train, None, tmp_path / "out", 30, labels=given)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_byte_order_mark_makes_no_class_of_its_own(tmp_path):
    rows = ["wet\triver", "dry\tstone", "wet\tcloud", "dry\tsand"] * 5
    train = tmp_path / "train.tsv"
    train.write_bytes(b"\xef\xbb\xbf" + "\n".join(rows).encode() + b"\n")
    valid = tmp_path / "valid.tsv"
    valid.write_bytes(b"\xef\xbb\xbf" + "\n".join(rows[:4]).encode() + b"\n")
    manifest = prepare_text("classify", train, valid, None, tmp_path / "out", 30)
    assert manifest["labels"] == ["dry", "wet"]


def test_an_empty_valid_file_is_refused(tmp_path):
    train = _write(tmp_path / "train.txt", ["river stone"] * 20)
    empty = _write(tmp_path / "empty.txt", ["", "  "])
    with pytest.raises(UserError, match=rf"{empty}: no valid lines left"):
        prepare_text("lm", train, empty, None, tmp_path / "out", 30)
    with pytest.raises(UserError, match=rf"{empty}: no test lines left"):
        prepare_text("lm", train, train, empty, tmp_path / "out", 30)


def test_invalid_utf8_names_file_and_line_or_is_replaced(tmp_path):
    train = tmp_path / "train.txt"
    train.write_bytes(b"river stone\nbad \xff byte\nlight cloud\n")
    valid = _write(tmp_path / "valid.txt", ["river"])
    with pytest.raises(UserError, match=rf"{train}, line 2: invalid UTF-8"):
        prepare_text("lm", train, valid, None, tmp_path / "out", 30)
    manifest = prepare_text(
        "lm", train, valid, None, tmp_path / "out", 30, encoding_errors="replace"
    )
    assert manifest["splits"]["train"]["utf8_replaced_lines"] == 1


def test_bad_arguments_are_user_errors(tmp_path):
    train = _write(tmp_path / "train.txt", ["river stone"] * 20)
    with pytest.raises(UserError, match="unknown text task 'mlm'"):
        prepare_text("mlm", train, train, None, tmp_path / "out", 30)
    with pytest.raises(UserError, match="label names go with the classify task"):
        prepare_text("lm", train, train, None, tmp_path / "out", 30, labels=["a"])
    with pytest.raises(UserError, match=r"missing\.txt: file not found"):
        prepare_text("lm", train, tmp_path / "missing.txt", None, tmp_path / "out", 30)
    with pytest.raises(UserError, match="would be overwritten"):
        prepare_text("lm", train, train, None, tmp_path, 30)
    empty = _write(tmp_path / "empty.txt", ["", " "])
    with pytest.raises(UserError, match="no training lines"):
        prepare_text("lm", empty, train, None, tmp_path / "out", 30)


def test_rerun_reuses_everything_force_redoes_it(tmp_path, monkeypatch):
    rng = random.Random(5)
    train = _write(tmp_path / "train.txt", [_doc(rng) for _ in range(40)])
    valid = _write(tmp_path / "valid.txt", [_doc(rng) for _ in range(5)])
    out = tmp_path / "data"
    first = prepare_text("lm", train, valid, None, out, 60)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != PREPARE_LOCK_NAME}

    def fail(*args, **kwargs):
        raise AssertionError("should not retrain or re-encode")

    with monkeypatch.context() as patch:
        patch.setattr(text_prepare_module, "train_tokenizer", fail)
        patch.setattr(text_prepare_module, "_encode_split", fail)
        messages: list[str] = []
        assert prepare_text("lm", train, valid, None, out, 60, log=messages.append) == first
        assert any("up to date" in m for m in messages)
        assert {
            p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != PREPARE_LOCK_NAME
        } == mtimes
        # Another validation file: encoded again, the vocabulary of the same train text kept.
        _write(valid, [_doc(rng) for _ in range(6)])
        with pytest.raises(AssertionError, match="re-encode"):
            prepare_text("lm", train, valid, None, out, 60)
    messages = []
    second = prepare_text("lm", train, valid, None, out, 60, log=messages.append)
    assert any("reusing" in m and "spm.model" in m for m in messages)
    assert second["splits"]["valid"]["lines"] == 6
    messages.clear()
    prepare_text("lm", train, valid, None, out, 60, force=True, log=messages.append)
    assert any("training a bpe vocabulary" in m for m in messages)


def test_corpus_open_refuses_text_data_text_corpus_refuses_parallel(lm_dir, reverse_data_dir):
    with pytest.raises(UserError, match=r"prepared for the lm task \(aiayn prepare --task lm\)"):
        Corpus.open(lm_dir, "train")
    with pytest.raises(UserError, match="parallel data for translation"):
        TextCorpus.open(reverse_data_dir, "train")
    assert data_kind(load_manifest(reverse_data_dir)) == "parallel"
    with pytest.raises(UserError, match="no 'test' split"):
        TextCorpus.open(lm_dir, "test")


def test_a_given_tokenizer_is_used_a_translation_one_refused(lm_dir, classify_dir, tmp_path):
    source = classify_dir.parent
    out = tmp_path / "data"
    given = tokenizer_path(lm_dir)
    manifest = prepare_text(
        "classify", source / "train.tsv", source / "valid.tsv", None, out, 9, tokenizer=given
    )
    assert tokenizer_path(out).read_bytes() == given.read_bytes()
    assert manifest["vocab_size"] == 100
    assert manifest["tokenizer_options"]["from"] == str(given.resolve())
    plain = train_tokenizer([source / "train.tsv"], 60, tmp_path / "plain")
    with pytest.raises(UserError, match="no <mask> at id 4"):
        prepare_text(
            "lm", source / "train.tsv", source / "valid.tsv", None, tmp_path / "x", 60,
            tokenizer=tmp_path / "plain.model",
        )  # fmt: skip
    assert not plain.has_mask
    # Taken from a checkpoint (written to a temporary file first): the checkpoint is named.
    with pytest.raises(UserError, match=r"^runs/mt/averaged\.pt: this tokenizer has no <mask>"):
        prepare_text(
            "lm", source / "train.tsv", source / "valid.tsv", None, tmp_path / "x", 60,
            tokenizer=tmp_path / "plain.model", tokenizer_source="runs/mt/averaged.pt",
        )  # fmt: skip


# -- examples ---------------------------------------------------------------------------------


def _stream(corpus: TextCorpus) -> np.ndarray:
    return np.concatenate([[BOS_ID, *corpus.ids(i).tolist(), EOS_ID] for i in range(len(corpus))])


def _doc_starts(corpus: TextCorpus) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(corpus.lengths, np.int64) + 2)[:-1]])


# Documents have up to 40 tokens: with max_positions=32 the longest ones are cut.
MAX_POSITIONS = 32
MODES = [(0, "blocks"), (12, "blocks"), (12, "documents"), (32, "documents")]


@pytest.mark.parametrize(("block_size", "pack"), MODES)
def test_lm_examples_are_shifted_spans_covering_every_target_once(lm_dir, block_size, pack):
    corpus = TextCorpus.open(lm_dir, "train")
    max_positions = MAX_POSITIONS
    assert corpus.lengths.max() + 2 > max_positions + 1  # some documents get cut
    stream = _stream(corpus)
    examples = TextExamples(
        corpus, "lm", block_size=block_size, pack=pack, max_positions=max_positions
    )
    limit = block_size or max_positions
    assert examples.lengths.dtype == np.int64 and 1 <= examples.lengths.min()
    assert examples.lengths.max() == limit
    batch = examples.batch(np.arange(len(examples)))
    assert isinstance(batch, TokenBatch)
    assert batch.inputs.shape == batch.targets.shape == (len(examples), limit)
    assert not (batch.targets == BOS_ID).any()
    covered = np.zeros(len(stream), dtype=np.int64)
    for i, (start, end) in enumerate(zip(examples.starts, examples.ends, strict=True)):
        n = examples.lengths[i]
        assert n == end - start - 1
        span = torch.from_numpy(stream[start:end])
        assert torch.equal(batch.inputs[i, :n], span[:-1])
        assert torch.equal(batch.targets[i, :n], torch.where(span[1:] == BOS_ID, PAD_ID, span[1:]))
        assert not batch.inputs[i, n:].any() and not batch.targets[i, n:].any()
        covered[start + 1 : end] += 1
    # Every token but BOS is predicted exactly once; BOS never.
    assert (covered[stream != BOS_ID] == 1).all()
    if block_size == 0 or pack == "documents":
        starts = set(_doc_starts(corpus).tolist())
        cut = [s for s in examples.starts.tolist() if s not in starts]
        # Spans start at documents; only the pieces of a long document do not.
        assert all(stream[s] != BOS_ID for s in cut) and cut
    if pack == "blocks" and block_size:
        assert np.array_equal(examples.starts, np.arange(0, len(stream) - 1, block_size))
    again = examples.batch([3, 1, 2])
    assert torch.equal(again.inputs, examples.batch([3, 1, 2]).inputs)
    assert torch.equal(again.targets[0], batch.targets[3, : again.targets.shape[1]])


@pytest.mark.parametrize(("block_size", "pack"), MODES)
def test_mlm_spans_partition_the_stream_and_mask_only_ordinary_tokens(lm_dir, block_size, pack):
    corpus = TextCorpus.open(lm_dir, "train")
    stream = _stream(corpus)
    examples = TextExamples(
        corpus, "mlm", block_size=block_size, pack=pack, max_positions=MAX_POSITIONS
    )
    assert examples.lengths.max() == (block_size or MAX_POSITIONS)
    assert np.array_equal(examples.lengths, examples.ends - examples.starts)
    # Consecutive, non-overlapping spans that cover the whole stream.
    assert examples.starts[0] == 0 and examples.ends[-1] == len(stream)
    assert np.array_equal(examples.starts[1:], examples.ends[:-1])
    if block_size == 0:
        starts = set(_doc_starts(corpus).tolist())
        assert starts <= set(examples.starts.tolist())
    batch = examples.batch(np.arange(len(examples)), torch.Generator().manual_seed(0))
    assert isinstance(batch, TokenBatch)
    chosen = batch.targets != PAD_ID
    original = torch.where(chosen, batch.targets, batch.inputs)
    for i, (start, end) in enumerate(zip(examples.starts, examples.ends, strict=True)):
        assert torch.equal(original[i, : end - start], torch.from_numpy(stream[start:end]))
        assert not original[i, end - start :].any()
    assert (batch.targets[chosen] >= FIRST_ORDINARY_ID).all()
    assert 0.1 < chosen.sum() / (original >= FIRST_ORDINARY_ID).sum() < 0.2


def test_mlm_batches_draw_from_the_generator_or_the_global_rng(lm_dir):
    examples = TextExamples(
        TextCorpus.open(lm_dir, "train"), "mlm", block_size=32, max_positions=64
    )
    one = examples.batch([0, 1, 2], torch.Generator().manual_seed(7))
    two = examples.batch([0, 1, 2], torch.Generator().manual_seed(7))
    other = examples.batch([0, 1, 2], torch.Generator().manual_seed(8))
    assert torch.equal(one.inputs, two.inputs) and torch.equal(one.targets, two.targets)
    assert not torch.equal(one.targets, other.targets)
    torch.manual_seed(3)
    three = examples.batch([0, 1, 2])
    torch.manual_seed(3)
    assert torch.equal(three.targets, examples.batch([0, 1, 2]).targets)


def test_mask_tokens_follows_15_percent_and_80_10_10():
    vocab = 1000
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (400, 512), generator=generator)
    ids[:, 450:] = PAD_ID  # padding at the end of every row
    inputs, targets = mask_tokens(ids, vocab, 0.15, torch.Generator().manual_seed(1))
    ordinary = ids >= FIRST_ORDINARY_ID
    chosen = targets != PAD_ID
    # Padding and the special ids (< 5) are never chosen, and stay as they are.
    assert not (chosen & ~ordinary).any()
    assert torch.equal(inputs[~ordinary], ids[~ordinary])
    assert torch.equal(targets[chosen], ids[chosen])

    def within_bounds(hits: int, trials: int, p: float) -> bool:
        return abs(hits - p * trials) < 5 * math.sqrt(trials * p * (1 - p))  # 5 sigma

    n_ordinary, n_chosen = int(ordinary.sum()), int(chosen.sum())
    assert within_bounds(n_chosen, n_ordinary, 0.15)
    masked = int((inputs[chosen] == MASK_ID).sum())
    kept = int((inputs[chosen] == ids[chosen]).sum())
    replaced = inputs[chosen & (inputs != MASK_ID) & (inputs != ids)]
    assert masked + kept + len(replaced) == n_chosen
    assert within_bounds(masked, n_chosen, 0.8)
    # A random replacement equals the original with probability 1 / (vocab - 5).
    assert within_bounds(kept, n_chosen, 0.1 + 0.1 / (vocab - FIRST_ORDINARY_ID))
    assert ((replaced >= FIRST_ORDINARY_ID) & (replaced < vocab)).all()
    # Positions left alone keep their token and take no loss.
    assert torch.equal(inputs[~chosen], ids[~chosen])
    again = mask_tokens(ids, vocab, 0.15, torch.Generator().manual_seed(1))
    assert torch.equal(again[0], inputs) and torch.equal(again[1], targets)
    with pytest.raises(ValueError, match="mask_prob"):
        mask_tokens(ids, vocab, 0.0)


def test_classify_examples_are_lines_truncated_to_max_positions(classify_dir):
    corpus = TextCorpus.open(classify_dir, "train")
    max_positions = 12
    examples = TextExamples(corpus, "classify", block_size=0, max_positions=max_positions)
    assert len(examples) == len(corpus)
    assert np.array_equal(examples.lengths, np.minimum(corpus.lengths, max_positions - 2) + 2)
    indices = [5, 0, 17]
    batch = examples.batch(indices)
    assert isinstance(batch, LabelBatch)
    assert batch.labels.tolist() == corpus.labels[indices].tolist()
    assert batch.inputs.shape[1] == examples.lengths[indices].max() <= max_positions
    for row, i in enumerate(indices):
        ids = corpus.ids(i)[: max_positions - 2].tolist()
        expected = [BOS_ID, *ids, EOS_ID]
        assert batch.inputs[row, : len(expected)].tolist() == expected
        assert not batch.inputs[row, len(expected) :].any()


@pytest.mark.parametrize("task", ["lm", "mlm", "classify"])
def test_a_token_id_outside_the_vocabulary_names_the_file_and_line(
    task, lm_dir, classify_dir, tmp_path
):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(classify_dir if task == "classify" else lm_dir, copy)
    corpus = TextCorpus.open(copy, "train")
    line = 11  # from 0: the 12th line
    ids = np.memmap(copy / "train.txt.bin", dtype=load_manifest(copy)["dtype"], mode="r+")
    ids[int(corpus.offsets[line])] = 60_000
    ids.flush()
    examples = TextExamples(TextCorpus.open(copy, "train"), task, block_size=0, max_positions=64)
    examples.batch([10, 12])
    with pytest.raises(UserError, match=r"txt\.bin: the sentence of line 12 of train\.txt holds"):
        examples.batch([10, line, 12])


def test_example_options_are_checked(lm_dir):
    corpus = TextCorpus.open(lm_dir, "train")
    with pytest.raises(ConfigError, match="block_size=65"):
        TextExamples(corpus, "lm", block_size=65, max_positions=64)
    with pytest.raises(ConfigError, match="unknown packing"):
        TextExamples(corpus, "lm", block_size=8, pack="sentences", max_positions=64)
    with pytest.raises(ConfigError, match="unknown text task"):
        TextExamples(corpus, "translation", block_size=8, max_positions=64)
    with pytest.raises(UserError, match="has no labels"):
        TextExamples(corpus, "classify", block_size=0, max_positions=64)


def test_lengths_feed_the_token_budget_sampler(lm_dir):
    examples = TextExamples(TextCorpus.open(lm_dir, "train"), "lm", block_size=0, max_positions=64)
    sampler = TokenBatchSampler(examples.lengths, examples.lengths, max_tokens=300, seed=1)
    seen = []
    for indices in sampler:
        batch = examples.batch(indices)
        assert batch.inputs.numel() <= 300
        seen += indices.tolist()
        if sampler.epoch:
            break
    assert sorted(seen) == list(range(len(examples)))
    restored = pickle.loads(pickle.dumps(examples))
    assert torch.equal(restored.batch([4, 2]).inputs, examples.batch([4, 2]).inputs)


# -- the Bible as text ------------------------------------------------------------------------


def test_every_book_has_its_genre():
    assert len(BIBLE_BOOKS) == len(set(BIBLE_BOOKS)) == 66
    genres = [book_genre(book) for book in BIBLE_BOOKS]
    assert {g: genres.count(g) for g in BIBLE_GENRES} == {
        "law": 5,
        "history": 13,
        "wisdom": 5,
        "prophets": 17,
        "gospels": 4,
        "epistles": 21,
        "apocalyptic": 1,
    }
    expected = {
        "Gen": "law", "Deut": "law", "Josh": "history", "Esth": "history", "Acts": "history",
        "Job": "wisdom", "Ps": "wisdom", "Song": "wisdom", "Isa": "prophets", "Lam": "prophets",
        "Mal": "prophets", "Matt": "gospels", "John": "gospels", "Rom": "epistles",
        "Heb": "epistles", "Jude": "epistles", "Rev": "apocalyptic",
    }  # fmt: skip
    assert {book: book_genre(book) for book in expected} == expected
    with pytest.raises(ValueError, match="unknown OSIS book"):
        book_genre("Tob")


def test_lm_split_holds_out_whole_books():
    assert {book_split(f"{b}.1.1") for b in LM_VALID_BOOKS} == {"valid"}
    assert {book_split(f"{b}.3.2+{b}.3.3") for b in LM_TEST_BOOKS} == {"test"}
    others = [b for b in BIBLE_BOOKS if b not in (*LM_VALID_BOOKS, *LM_TEST_BOOKS)]
    assert {book_split(f"{b}.2.7") for b in others} == {"train"}


def test_classify_split_keeps_chapters_together_and_holds_out_each_book():
    # Every verse of a made-up canon with each book's chapter count as in the corpus.
    counts = {"Gen": 50, "Ps": 150, "Rev": 22, "Ruth": 4, "Mark": 16, "Jude": 1, "Joel": 3}
    refs = [f"{b}.{c}.{v}" for b, n in counts.items() for c in range(1, n + 1) for v in (1, 2)]
    refs[3] = "Gen.2.2+Gen.2.3"
    splits = chapter_splits(refs)
    by_chapter: dict[str, set[str]] = {}
    for ref, split in zip(refs, splits, strict=True):
        by_chapter.setdefault(".".join(ref.split(".")[:2]), set()).add(split)
    assert all(len(s) == 1 for s in by_chapter.values())
    for book, n in counts.items():
        held_out = round(CHAPTER_SHARE * n + 1e-9)  # 5% of the chapters, half up
        book_splits = [next(iter(s)) for c, s in by_chapter.items() if c.startswith(book + ".")]
        assert book_splits.count("valid") == book_splits.count("test") == held_out, book
    assert chapter_splits(refs) == splits  # deterministic
    # A chapter's split does not depend on the order of the references.
    assert chapter_splits(refs[::-1]) == splits[::-1]


def test_canonical_order_sorts_books_chapters_and_verses():
    refs = ["Rev.1.1", "Gen.10.1", "Gen.2.10", "Gen.2.9", "Matt.1.1", "Gen.2.11+Gen.2.12"]
    assert sorted(refs, key=canonical_order) == [
        "Gen.2.9", "Gen.2.10", "Gen.2.11+Gen.2.12", "Gen.10.1", "Matt.1.1", "Rev.1.1",
    ]  # fmt: skip


@pytest.fixture
def bible_text_cache(request, tmp_path):
    """A cache with the Bible corpus (tests/conftest.py), or a skip without the SWORD modules."""
    if not bible.sword_paths(None):
        pytest.skip("the SWORD modules (sword-text-web, sword-text-sparv) are not installed")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "bible").symlink_to(request.getfixturevalue("bible_cache") / "bible")
    return cache


def test_prepare_bible_text_for_both_tasks(bible_text_cache, tmp_path):
    lm = prepare_bible_text(tmp_path / "lm", "lm", vocab_size=1000, cache_dir=bible_text_cache)
    assert (lm["task"], lm["vocab_size"]) == ("lm", 1000)
    lines = {
        split: (bible_text_cache / "bible-text" / "lm-en" / f"{split}.txt").read_text().splitlines()
        for split in ("train", "valid", "test")
    }
    assert {s: lm["splits"][s]["lines"] for s in lines} == {s: len(v) for s, v in lines.items()}
    assert lines["train"][0] == "In the beginning, God created the heavens and the earth."
    assert lines["valid"][0].startswith("In the days when the judges judged")  # Ruth 1:1
    assert 25_000 < len(lines["train"]) and 200 < len(lines["valid"]) and 200 < len(lines["test"])

    genre = prepare_bible_text(
        tmp_path / "genre", "classify", lang="es", vocab_size=1000, cache_dir=bible_text_cache
    )
    assert genre["labels"] == list(BIBLE_GENRES)
    train = TextCorpus.open(tmp_path / "genre", "train")
    first = [TextCorpus.open(tmp_path / "genre", s).texts()[0] for s in ("train", "valid", "test")]
    assert any(text.startswith("EN el principio crió Dios") for text in first)  # Genesis 1:1
    assert train.label_names[int(train.labels[0])] == "law"
    counts = genre["splits"]["train"]["label_counts"]
    assert all(counts[g] > 300 for g in BIBLE_GENRES)
    total = sum(genre["splits"][s]["lines"] for s in ("train", "valid", "test"))
    for split in ("valid", "test"):
        assert 0.03 < genre["splits"][split]["lines"] / total < 0.07
        assert all(genre["splits"][split]["label_counts"][g] > 0 for g in BIBLE_GENRES)
