import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

from aiayn.data import prepare as prepare_module
from aiayn.data.corpus import Corpus, load_manifest, tokenizer_path
from aiayn.data.prepare import prepare_data
from aiayn.data.raw_text import count_lines
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import UserError
from aiayn.lock import PREPARE_LOCK_NAME

WORDS = (
    "the a one dog cat bird runs sees eats big small red blue green house tree river man woman "
    "child walks near under over quickly slowly"
).split()
VOCAB = 120


def make_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(3, 12))
        # A deterministic "translation": reversed order, each word mirrored and capitalised.
        target = [w[::-1].capitalize() for w in reversed(words)]
        pairs.append((" ".join(words), " ".join(target)))
    return pairs


def write_side(path: Path, lines: list[str]) -> None:
    path.write_bytes("".join(f"{line}\n" for line in lines).encode("utf-8"))


def write_prefix(prefix: Path, pairs: list[tuple[str, str]], src: str = "en", tgt: str = "de"):
    write_side(Path(f"{prefix}.{src}"), [s for s, _ in pairs])
    write_side(Path(f"{prefix}.{tgt}"), [t for _, t in pairs])
    return prefix


@pytest.fixture
def text(tmp_path):
    """train (400 pairs) and valid (40 pairs) prefixes in tmp_path."""
    train = write_prefix(tmp_path / "train", make_pairs(400, seed=1))
    valid = write_prefix(tmp_path / "valid", make_pairs(40, seed=2))
    return train, valid


def _prepare(train, valid, out, test=None, **kw):
    return prepare_data(train, valid, test, "en", "de", VOCAB, out, **kw)


def test_prepare_writes_a_readable_data_dir(text, tmp_path):
    train, valid = text
    test = write_prefix(tmp_path / "test", make_pairs(30, seed=3))
    out = tmp_path / "data"
    manifest = _prepare(train, valid, out, test=test)
    assert manifest == load_manifest(out)
    assert (manifest["src"], manifest["tgt"], manifest["vocab_size"]) == ("en", "de", VOCAB)
    assert {s: manifest["splits"][s]["pairs"] for s in manifest["splits"]} == {
        "train": 400,
        "valid": 40,
        "test": 30,
    }
    tokenizer = Tokenizer.load(tokenizer_path(out))
    for split, n_lines in (("train", 400), ("valid", 40), ("test", 30)):
        corpus = Corpus.open(out, split)
        assert len(corpus) == n_lines
        sources = Path(f"{tmp_path / split}.en").read_text().splitlines()
        targets = Path(f"{tmp_path / split}.de").read_text().splitlines()
        assert corpus.src_texts() == sources and corpus.tgt_texts() == targets
        for i in range(0, n_lines, 7):
            src_ids, tgt_ids = corpus.pair(i)
            assert tokenizer.decode(src_ids.tolist()) == sources[i]
            assert tokenizer.decode(tgt_ids.tolist()) == targets[i]
            assert (corpus.src_lengths[i], corpus.tgt_lengths[i]) == (len(src_ids), len(tgt_ids))
        info = manifest["splits"][split]
        assert info["tokens"] == {
            "en": int(corpus.src_lengths.sum()),
            "de": int(corpus.tgt_lengths.sum()),
        }
    assert not list(out.glob(".prepare-*"))
    for name, size in manifest["files"].items():
        assert (out / name).stat().st_size == size


def test_empty_and_whitespace_lines_are_dropped_in_pairs_and_counted(tmp_path):
    pairs = make_pairs(200, seed=4)
    src = [s for s, _ in pairs]
    tgt = [t for _, t in pairs]
    src[3] = ""  # empty source
    tgt[10] = "   \t "  # whitespace-only target
    src[20] = tgt[20] = ""  # both
    write_side(tmp_path / "train.en", src)
    write_side(tmp_path / "train.de", tgt)
    valid = write_prefix(tmp_path / "valid", make_pairs(20, seed=5))
    manifest = _prepare(tmp_path / "train", valid, tmp_path / "data")
    assert manifest["splits"]["train"]["dropped"]["empty"] == 3
    assert manifest["dropped"]["empty"] == 3
    assert manifest["splits"]["train"]["pairs"] == 197
    kept = [i for i in range(200) if i not in (3, 10, 20)]
    corpus = Corpus.open(tmp_path / "data", "train")
    assert corpus.src_texts() == [src[i] for i in kept]
    assert corpus.tgt_texts() == [tgt[i] for i in kept]


def test_different_line_counts_name_both_files_and_counts(text, tmp_path):
    train, valid = text
    lines = Path(f"{valid}.de").read_text().splitlines()
    write_side(Path(f"{valid}.de"), lines[:-3])
    with pytest.raises(UserError) as err:
        _prepare(train, valid, tmp_path / "data")
    message = str(err.value)
    assert f"{valid}.en" in message and f"{valid}.de" in message
    assert "40" in message and "37" in message
    assert not (tmp_path / "data").exists()  # checked before anything was written


def test_invalid_utf8_names_file_and_line_or_is_replaced_and_counted(text, tmp_path):
    train, valid = text
    path = Path(f"{train}.de")
    lines = path.read_bytes().split(b"\n")
    lines[6] = lines[6][:4] + b"\xff\xfe" + lines[6][4:]
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(UserError, match=rf"{path}, line 7: invalid UTF-8"):
        _prepare(train, valid, tmp_path / "data")
    manifest = _prepare(train, valid, tmp_path / "data", encoding_errors="replace")
    assert manifest["splits"]["train"]["utf8_replaced_lines"] == {"en": 0, "de": 1}
    assert "\ufffd" in Corpus.open(tmp_path / "data", "train").tgt_texts()[6]


def test_a_byte_order_mark_is_dropped_and_a_nul_or_gzip_named(text, tmp_path):
    import gzip

    train, valid = text
    src = Path(f"{train}.en")
    plain = src.read_bytes()
    src.write_bytes(b"\xef\xbb\xbf" + plain)  # as some Windows editors save UTF-8
    _prepare(train, valid, tmp_path / "data")
    first = Corpus.open(tmp_path / "data", "train").src_texts()[0]
    assert first == plain.split(b"\n")[0].decode() and "\ufeff" not in first
    # A NUL: refused with its line, or made U+FFFD and counted.
    lines = plain.split(b"\n")
    lines[4] = lines[4][:3] + b"\x00" + lines[4][3:]
    src.write_bytes(b"\n".join(lines))
    with pytest.raises(UserError, match=rf"{src}, line 5: a NUL byte \(at byte 4"):
        _prepare(train, valid, tmp_path / "nul")
    manifest = _prepare(train, valid, tmp_path / "nul", encoding_errors="replace")
    assert manifest["splits"]["train"]["utf8_replaced_lines"] == {"en": 1, "de": 0}
    # A gzip-compressed file is said to be one.
    src.write_bytes(gzip.compress(plain))
    with pytest.raises(UserError, match=rf"{src}: the file is gzip-compressed"):
        _prepare(train, valid, tmp_path / "gz")


def test_a_utf16_or_utf32_file_is_named_before_the_line_counts(text, tmp_path):
    # Its NUL bytes would count one line more than the UTF-8 side has.
    train, valid = text
    tgt = Path(f"{train}.de")
    plain = tgt.read_text(encoding="utf-8")
    for encoding, name in (("utf-16", "UTF-16"), ("utf-16-be", None), ("utf-32", "UTF-32")):
        data = plain.encode(encoding)
        if name is None:  # big-endian with its mark written out
            data, name = b"\xfe\xff" + data, "UTF-16"
        tgt.write_bytes(data)
        with pytest.raises(UserError, match=rf"^{tgt}: the file is {name} text .*iconv -f {name}"):
            _prepare(train, valid, tmp_path / "wide")


def test_a_second_prepare_into_a_busy_directory_is_refused(text, tmp_path):
    from aiayn.lock import RunDirectoryBusy, prepare_lock

    train, valid = text
    out = tmp_path / "data"
    out.mkdir()
    with prepare_lock(out):  # as a running prepare holds it, its staging directory beside it
        live = out / ".prepare-live"
        live.mkdir()
        with pytest.raises(
            RunDirectoryBusy, match=f"{out} is in use by another aiayn process preparing data"
        ):
            _prepare(train, valid, out)
        assert live.is_dir()
    _prepare(train, valid, out)  # once it ends; a staging directory left behind is cleared
    assert not live.exists()
    # An up-to-date directory is reused without the lock (it may be read-only, or busy).
    with prepare_lock(out):
        assert _prepare(train, valid, out) == load_manifest(out)
    # A first prepare that fails leaves no directory, its lock file included.
    Path(f"{valid}.de").write_text("\n" * (Path(f"{valid}.en").read_text().count("\n")))
    with pytest.raises(UserError, match="no valid pairs left"):
        _prepare(train, valid, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_a_valid_split_with_no_pairs_left_is_refused(text, tmp_path):
    train, valid = text
    for side in ("en", "de"):
        Path(f"{valid}.{side}").write_text("\n   \n\n")  # three lines, all empty
    with pytest.raises(UserError, match=rf"{valid}\.en, {valid}\.de: no valid pairs left"):
        _prepare(train, valid, tmp_path / "data")
    assert not (tmp_path / "data" / "manifest.json").exists()


def test_missing_file_is_a_user_error(text, tmp_path):
    train, _ = text
    with pytest.raises(UserError, match=r"nowhere\.en: file not found"):
        _prepare(train, tmp_path / "nowhere", tmp_path / "data")


def test_unwritable_output_directory_is_a_user_error(text, tmp_path):
    train, valid = text
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match="file"):
        _prepare(train, valid, blocker / "data")
    with pytest.raises(UserError, match="not a directory"):
        _prepare(train, valid, blocker)


def test_vocabulary_larger_than_the_text_allows(text, tmp_path):
    train, valid = text
    with pytest.raises(
        UserError,
        match=r"vocabulary size 5000 is larger .*at most \d+ for .*train\.en and .*train\.de",
    ):
        prepare_data(train, valid, None, "en", "de", 5000, tmp_path / "data")
    assert not list((tmp_path / "data").glob(".prepare-*"))
    assert not (tmp_path / "data" / "manifest.json").exists()


def test_length_limits_drop_training_pairs_only(tmp_path):
    pairs = make_pairs(300, seed=6)
    long_src = " ".join(["river"] * 200)
    pairs[5] = (long_src, "Revir")  # too long on one side, and a bad ratio
    pairs[9] = ("dog", "God tac eno eno eno eno eno eno eno eno")  # ratio only
    train = write_prefix(tmp_path / "train", pairs)
    valid_pairs = make_pairs(20, seed=7)
    valid_pairs[0] = (long_src, "Revir")
    valid = write_prefix(tmp_path / "valid", valid_pairs)
    manifest = _prepare(train, valid, tmp_path / "data", max_len=100, max_len_ratio=3.0)
    dropped = manifest["splits"]["train"]["dropped"]
    assert dropped["too_long"] == 1 and dropped["length_ratio"] >= 1
    corpus = Corpus.open(tmp_path / "data", "train")
    assert long_src not in corpus.src_texts()
    assert "dog" not in corpus.src_texts()
    assert len(corpus) == 300 - dropped["too_long"] - dropped["length_ratio"]
    assert int(corpus.src_lengths.max()) <= 100 and int(corpus.tgt_lengths.max()) <= 100
    lengths = np.stack([corpus.src_lengths, corpus.tgt_lengths])
    assert np.all(lengths.max(0) <= 3.0 * lengths.min(0))
    # valid keeps everything, so BLEU is computed against every reference.
    assert manifest["splits"]["valid"]["pairs"] == 20
    assert Corpus.open(tmp_path / "data", "valid").src_texts()[0] == long_src


def test_rerun_with_same_inputs_reuses_everything(text, tmp_path, monkeypatch):
    train, valid = text
    out = tmp_path / "data"
    first = _prepare(train, valid, out)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != PREPARE_LOCK_NAME}

    def fail(*args, **kwargs):
        raise AssertionError("should not retrain or re-encode")

    monkeypatch.setattr(prepare_module, "train_tokenizer", fail)
    monkeypatch.setattr(prepare_module, "_encode_split", fail)
    messages: list[str] = []
    second = _prepare(train, valid, out, log=messages.append)
    assert second == first
    assert any("up to date" in m for m in messages)
    assert {
        p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != PREPARE_LOCK_NAME
    } == mtimes


def test_changed_filter_reuses_the_tokenizer_changed_text_retrains(text, tmp_path):
    train, valid = text
    out = tmp_path / "data"
    first = _prepare(train, valid, out)
    model = tokenizer_path(out).read_bytes()
    messages: list[str] = []
    second = _prepare(train, valid, out, max_len=5, log=messages.append)
    assert any("reusing" in m and "spm.model" in m for m in messages)
    assert tokenizer_path(out).read_bytes() == model
    assert second["splits"]["train"]["pairs"] < first["splits"]["train"]["pairs"]
    assert Corpus.open(out, "train").src_lengths.max() <= 5

    write_prefix(train, make_pairs(400, seed=99))
    messages.clear()
    third = _prepare(train, valid, out, log=messages.append)
    assert any("training" in m for m in messages)
    assert third["fingerprint"] != first["fingerprint"]


def test_same_text_elsewhere_reuses_the_tokenizer(text, tmp_path):
    train, valid = text
    out = tmp_path / "data"
    _prepare(train, valid, out)
    model = tokenizer_path(out).read_bytes()
    # The same training text in other files (other path, other time stamp): the inputs
    # changed, so the splits are encoded again, but the vocabulary is reused.
    (tmp_path / "copy").mkdir()
    moved = tmp_path / "copy" / "train"
    for lang in ("en", "de"):
        Path(f"{moved}.{lang}").write_bytes(Path(f"{train}.{lang}").read_bytes())
    messages: list[str] = []
    _prepare(moved, valid, out, log=messages.append)
    assert any("reusing" in m and "spm.model" in m for m in messages)
    assert not any("up to date" in m for m in messages)
    assert tokenizer_path(out).read_bytes() == model


def test_interrupted_run_leaves_nothing_a_later_run_trusts(text, tmp_path, monkeypatch):
    train, valid = text
    out = tmp_path / "data"
    good = _prepare(train, valid, out)

    # Interrupted while encoding: the previous, complete directory is untouched.
    original_encode = prepare_module._encode_split

    def interrupted_encode(*args, **kwargs):
        original_encode(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "_encode_split", interrupted_encode)
    with pytest.raises(KeyboardInterrupt):
        _prepare(train, valid, out, max_len=6)
    assert load_manifest(out) == good
    assert len(Corpus.open(out, "train")) == good["splits"]["train"]["pairs"]
    assert not list(out.glob(".prepare-*"))
    monkeypatch.setattr(prepare_module, "_encode_split", original_encode)

    # Interrupted while moving files into place: no manifest, so nothing is trusted.
    original_replace = os.replace
    moved = []

    def interrupted_replace(src, dst):
        if len(moved) == 3:
            raise KeyboardInterrupt
        moved.append(dst)
        original_replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted_replace)
    with pytest.raises(KeyboardInterrupt):
        _prepare(train, valid, out, max_len=6)
    monkeypatch.setattr(os, "replace", original_replace)
    with pytest.raises(UserError, match="not a prepared data directory"):
        Corpus.open(out, "train")

    # A later run redoes the work and is consistent again.
    again = _prepare(train, valid, out, max_len=6)
    assert again["filters"]["max_len"] == 6
    assert len(Corpus.open(out, "train")) == again["splits"]["train"]["pairs"]


def test_manifest_is_plain_json_with_reasons(text, tmp_path):
    train, valid = text
    _prepare(train, valid, tmp_path / "data")
    raw = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert (
        set(raw["dropped"]) == set(raw["dropped_reasons"]) == {"empty", "too_long", "length_ratio"}
    )
    assert raw["tokenizer"] == "spm.model"
    assert raw["tokenizer_options"]["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert raw["dtype"] == "uint16"


def test_count_lines_counts_a_last_line_without_newline(tmp_path):
    path = tmp_path / "f"
    for content, expected in ((b"", 0), (b"a", 1), (b"a\n", 1), (b"a\nb", 2), (b"\n\n", 2)):
        path.write_bytes(content)
        assert count_lines(path) == expected
        with path.open("rb") as handle:
            assert sum(1 for _ in handle) == expected


def test_inputs_inside_the_output_directory_are_not_overwritten(tmp_path):
    train = write_prefix(tmp_path / "train", make_pairs(50, seed=8))
    valid = write_prefix(tmp_path / "valid", make_pairs(10, seed=9))
    before = Path(f"{train}.en").read_bytes()
    with pytest.raises(UserError, match="would be overwritten"):
        _prepare(train, valid, tmp_path)
    assert Path(f"{train}.en").read_bytes() == before


def test_same_languages_are_rejected(text, tmp_path):
    train, valid = text
    with pytest.raises(UserError, match="both"):
        prepare_data(train, valid, None, "en", "en", VOCAB, tmp_path / "data")


def test_write_failure_midway_is_a_user_error(text, tmp_path, monkeypatch):
    train, valid = text

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepare_module, "_encode_split", disk_full)
    with pytest.raises(UserError, match=r"no space left on the device of .*data \("):
        _prepare(train, valid, tmp_path / "data")
    assert not list((tmp_path / "data").glob(".prepare-*"))


def test_copies_of_one_language_and_training_files_as_valid_are_warned_of(text, tmp_path):
    train, valid = text
    messages: list[str] = []
    _prepare(train, valid, tmp_path / "plain", log=messages.append)
    assert not [m for m in messages if m.startswith("warning:")]
    Path(f"{train}.de").write_bytes(Path(f"{train}.en").read_bytes())
    messages.clear()
    _prepare(train, train, tmp_path / "copies", log=messages.append)
    warned = [m for m in messages if m.startswith("warning:")]
    assert warned == [
        "warning: the valid split reads the training files: its scores will not tell how the "
        "model does on text it has not seen",
        f"warning: 400 of the 400 train pairs are the same text on both sides: are {train}.en "
        f"and {train}.de in one language?",
        f"warning: 400 of the 400 valid pairs are the same text on both sides: are {train}.en "
        f"and {train}.de in one language?",
    ]
