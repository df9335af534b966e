"""User mistakes on the command line end in one line naming what is wrong (exit status 2),
never in a traceback: bad config values and files, devices, output paths, empty inputs, a
closed output pipe, and overrides given after options."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiayn.cli import _parse as parse_command_line
from aiayn.cli import build_parser, main
from aiayn.devices import pick_device
from aiayn.errors import UserError
from tests.helpers import ROOT, TINY, cli_env

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def data_dir(reverse_data_dir):
    return reverse_data_dir


def _fails(argv: list[str], capsys: pytest.CaptureFixture, message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_overrides_may_follow_options():
    argv = ["train", "--config", "c.toml", "--out", "o", "train.max_steps=5", "--no-progress"]
    args = parse_command_line(build_parser(), [*argv, "train.valid_interval=0"])
    assert args.overrides == ["train.max_steps=5", "train.valid_interval=0"]
    assert args.no_progress
    with pytest.raises(SystemExit):  # anything else left over is still an error
        parse_command_line(build_parser(), [*argv, "--bogus"])
    with pytest.raises(SystemExit):  # and so is a KEY=VALUE for a command without overrides
        parse_command_line(build_parser(), ["average", "run", "a=b"])


def test_bad_config_values_and_files(data_dir, tmp_path, capsys):
    args = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(tmp_path / "run")]
    _fails([*args, "train.warmup_steps=0"], capsys, "train.warmup_steps must be positive, got 0")
    _fails([*args, "model.n_heads=0"], capsys, "model.n_heads must be positive, got 0")
    _fails([*args, "decode.beam_size=0"], capsys, "decode.beam_size must be positive")
    config_dir = tmp_path / "configs"
    config_dir.mkdir()
    args = ["train", "--data", str(data_dir), "--out", str(tmp_path / "run")]
    _fails([*args, "--config", str(config_dir)], capsys, "is a directory")
    assert not (tmp_path / "run").exists()


def test_devices_that_do_not_exist_here():
    with pytest.raises(UserError, match="unknown device 'gpu'"):
        pick_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA is not available"):
            pick_device("cuda")
        with pytest.raises(UserError, match="CUDA is not available"):
            pick_device("cuda:1")
        assert pick_device("auto") == torch.device("cpu")
    assert pick_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_translate_on_a_missing_gpu(tmp_path, capsys):
    _fails(["translate", str(tmp_path / "x.pt"), "--device", "cuda"], capsys, "CUDA")


def test_output_paths_of_the_wrong_kind(data_dir, tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x\n")
    train = ["train", "--config", TINY, "--data", str(data_dir)]
    _fails([*train, "--out", str(a_file)], capsys, "is a file, not a directory")
    _fails([*train, "--out", str(a_file / "run")], capsys, "is a file, not a directory")
    _fails(["average", str(tmp_path), "--out", str(tmp_path)], capsys, "is a directory")
    _fails(["attention", "x.pt", "a b", "--out", str(a_file)], capsys, "is a file")
    _fails(["plot", str(tmp_path), "--out", str(tmp_path)], capsys, "is a directory")
    assert a_file.read_text() == "x\n"


def test_resume_with_nothing_to_resume(data_dir, tmp_path, capsys):
    _fails(["train", "--out", str(tmp_path / "nowhere"), "--resume"], capsys, "does not exist")
    _fails(["train", "--out", str(tmp_path), "--resume"], capsys, "holds no checkpoint")
    # A run killed before its first checkpoint left its config: --resume starts it again.
    run = tmp_path / "run"
    quick = ["train.max_steps=2", "train.valid_interval=0", "train.average_last=0"]
    assert (
        main(["train", "--config", TINY, "--data", str(data_dir), "--out", str(run), *quick]) == 0
    )
    shutil.rmtree(run / "checkpoints")
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0
    assert "reached train.max_steps=2" in capsys.readouterr().out


def test_missing_tokenizer_model(data_dir, tmp_path, capsys):
    broken = tmp_path / "data"
    shutil.copytree(data_dir, broken)
    (broken / "spm.model").unlink()
    argv = ["train", "--config", TINY, "--data", str(broken), "--out", str(tmp_path / "run")]
    _fails(argv, capsys, "spm.model: tokenizer model not found")


def test_bleu_of_empty_files(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _fails(["bleu", str(empty), str(empty)], capsys, "has no lines: nothing to score")


def test_a_closed_output_pipe_ends_quietly():
    command = f"{sys.executable} -m aiayn params | head -1"
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.startswith("preset")
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_under_stdout_is_one_line():
    command = f"{sys.executable} -m aiayn params > /dev/full"
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr == ("aiayn params: error: cannot write: No space left on device\n"), (
        done.stderr
    )


def test_bleu_reads_past_a_byte_order_mark(tmp_path, capsys):
    reference = tmp_path / "ref.txt"
    reference.write_bytes(b"\xef\xbb\xbfthe cat sat on the mat today\na dog ran in the park\n")
    hypothesis = tmp_path / "hyp.txt"
    hypothesis.write_text("the cat sat on the mat today\na dog ran in the park\n")
    assert main(["bleu", str(hypothesis), str(reference)]) == 0
    assert "= 100.00 100.0/100.0/100.0/100.0" in capsys.readouterr().out


def test_small_frictions_of_a_first_hour(data_dir, tmp_path, capsys):
    # --version, and which vocabulary params assumes
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("aiayn ")
    assert main(["params", "small", "--vocab-size", "8000"]) == 0
    assert "vocabulary of 8,000: --vocab-size)" in capsys.readouterr().out
    assert main(["params", "small", "nonexistent"]) == 2  # refused before any line
    assert capsys.readouterr().out == ""
    # A prefix given with its language suffix: the hint says what the prefix is.
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in ("train.en", "train.de"):
        (folder / name).write_text("a b\n")
    argv = ["prepare", "--train", str(folder / "train.en"), "--valid", str(folder / "train")]
    _fails(
        [*argv, "--src", "en", "--tgt", "de", "--out", str(tmp_path / "d")],
        capsys,
        f"--train {folder / 'train'} (for {folder / 'train'}.en and",
    )
    assert not (tmp_path / "d").exists()  # no empty DATA_DIR left by the failure
    (folder / "bad.en").write_bytes(b"\xff\n")
    (folder / "bad.de").write_text("x\n")
    bad = ["prepare", "--train", str(folder / "bad"), "--valid", str(folder / "train")]
    _fails([*bad, "--src", "en", "--tgt", "de", "--out", str(tmp_path / "e")], capsys, "UTF-8")
    assert not (tmp_path / "e").exists()
    # Output limits that would give nothing are refused, not translated into empty lines.
    config = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(tmp_path / "r")]
    _fails([*config, "decode.max_len_b=-5"], capsys, "decode.max_len_b must be 0 or more")
    _fails([*config, "decode.max_len_a=0", "decode.max_len_b=0"], capsys, "both 0")
    # A run file that is not UTF-8: named in one line by train too.
    (tmp_path / "bad8.toml").write_bytes(b'preset = "tiny"\n[train]\nmax_steps = 5\n\xff\n')
    bad8 = ["train", "--config", str(tmp_path / "bad8.toml"), "--data", str(data_dir)]
    _fails([*bad8, "--out", str(tmp_path / "r8")], capsys, "bad8.toml: not UTF-8")


def test_translate_refuses_output_limits_that_give_nothing(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(run)]
    assert main([*argv, "train.max_steps=1", "train.valid_interval=0", "--no-progress"]) == 0
    text = tmp_path / "in.txt"
    text.write_text("alpha bravo\n")
    for limits in (["--max-len-b", "-5"], ["--max-len-a", "0", "--max-len-b", "0"]):
        _fails(["translate", str(run), "--input", str(text), *limits], capsys, "max_len")


def test_advice_that_works_when_followed(data_dir, tmp_path, capsys):
    """A valid sentence longer than the model's positions: the advice is not --max-len (which
    filters training pairs only), and following it works. Resuming a run with data of another
    vocabulary says so, instead of asking to drop a key the user never set."""
    from aiayn.data.prepare import prepare_data
    from tests.helpers import WORDS, write_reverse_text

    write_reverse_text(tmp_path, "long", 300, seed=4)  # 2 to 6 words a line
    short = tmp_path / "short"  # training pairs of at most 4 tokens; valid kept whole
    prepare_data(tmp_path / "long", tmp_path / "long", None, "src", "tgt", len(WORDS) + 4,
                 short, model_type="word", max_len=4)  # fmt: skip
    argv = ["train", "--config", TINY, "--data", str(short), "--out", str(tmp_path / "a"),
            "model.max_positions=6", "train.max_steps=1", "--no-progress"]  # fmt: skip
    assert main(argv) == 2  # advice: train.valid_interval=0, not --max-len
    err = capsys.readouterr().err
    where = re.search(r"the valid split .* \(with BOS/EOS, line (\d+) of (\S+)\)", err)
    assert where is not None, err
    lines = Path(where.group(2)).read_text().splitlines()
    assert len(lines[int(where.group(1)) - 1].split()) == max(len(t.split()) for t in lines) == 6
    assert main([*argv, "train.valid_interval=0"]) == 0  # the advice, followed
    base = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(tmp_path / "b")]
    assert main([*base, "train.max_steps=1", "train.valid_interval=0", "--no-progress"]) == 0
    other = tmp_path / "other"

    write_reverse_text(tmp_path, "t", 200, seed=3)
    prepare_data(tmp_path / "t", tmp_path / "t", None, "src", "tgt", 40, other, model_type="bpe")
    _fails(
        ["train", "--out", str(tmp_path / "b"), "--data", str(other), "train.max_steps=2"],
        capsys, "resume it with the data it was trained on",
    )  # fmt: skip
    # Data of another kind (text for a language model): named as such, not by its vocabulary.
    text = tmp_path / "text.txt"
    text.write_text("".join(f"{w} {w}\n" for w in WORDS * 5))
    assert main(["prepare", "--task", "lm", "--train", str(text), "--valid", str(text),
                 "--vocab-size", "30", "--out", str(tmp_path / "lm")]) == 0  # fmt: skip
    _fails(
        ["train", "--out", str(tmp_path / "b"), "--data", str(tmp_path / "lm")],
        capsys, f"holds text data for the lm task; resume the run in {tmp_path / 'b'} with the",
    )  # fmt: skip


def test_arguments_that_are_not_utf8(tmp_path, capsys):
    """Python hands an argument's invalid bytes on as lone surrogates: each command refuses
    them in one line that names the argument, before any work (and before a traceback from
    sentencepiece or the manifest's writer)."""
    bad = "bad \udcff"  # what Python makes of the bytes b"bad \xff"
    _fails(["generate", str(tmp_path), bad], capsys, "argument 3 ('bad \\xff') is not valid UTF-8")
    _fails(["attention", str(tmp_path), bad], capsys, "(byte 5: b'\\xff')")
    corpus = ["--src", "en", "--tgt", "de", "--vocab-size", "500"]
    out = str(tmp_path / "d\udcff")
    _fails(["prepare", "--train", "a", "--valid", "b", *corpus, "--out", out], capsys, "UTF-8")
    assert list(tmp_path.iterdir()) == []
    # The bytes as a shell passes them, through the real entry point.
    argv = [b"prepare", b"--train", b"\xe9t\xe9/train", b"--valid", b"\xe9t\xe9/dev"]
    argv += [item.encode() for item in corpus] + [b"--out", b"OUT"]
    done = subprocess.run(
        [sys.executable, "-m", "aiayn", *argv], capture_output=True, cwd=tmp_path, env=cli_env()
    )
    assert done.returncode == 2
    assert done.stderr.decode() == (
        "aiayn prepare: error: argument 3 ('\\xe9t\\xe9/train') is not valid UTF-8 "
        "(byte 1: b'\\xe9'); give text and file names in UTF-8\n"
    )


def test_a_recipe_path_outside_the_repository(data_dir, tmp_path, capsys):
    """``--config configs/base.toml`` where there is no configs/: the hint names the recipe
    that ships with aiayn."""
    argv = ["train", "--data", str(data_dir), "--out", str(tmp_path / "run")]
    missing = tmp_path / "configs" / "base.toml"
    _fails(
        [*argv, "--config", str(missing)],
        capsys,
        f"config file {missing} does not exist; the recipe base ships with aiayn, from any "
        "directory: --config base",
    )
    _fails([*argv, "--config", str(tmp_path / "mine.toml")], capsys, "mine.toml does not exist")
    assert "ships with aiayn" not in capsys.readouterr().err


@pytest.mark.slow  # 25 s: a subprocess trains one update of the base model
def test_the_readme_steps_from_an_empty_directory(tmp_path):
    """The README's "Your own data", run where there is no repository: prepare, then train
    with --config base (shrunk to one small update by overrides, nothing else changed)."""
    import shlex

    from tests.helpers import write_reverse_text

    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Your own data", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    steps = [line.split("#")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    prepare = next(s for s in steps if s.startswith("aiayn prepare"))
    train = next(s for s in steps if s.startswith("aiayn train"))
    assert "--config base" in train
    work = tmp_path / "empty"
    (work / "corpus").mkdir(parents=True)
    for split, seed in (("train", 1), ("dev", 2), ("test", 3)):
        write_reverse_text(work / "corpus", split, 200, seed=seed)
        for side, lang in (("src", "en"), ("tgt", "de")):
            (work / "corpus" / f"{split}.{side}").rename(work / "corpus" / f"{split}.{lang}")
    shrink = ["--vocab-size", "40"]
    small = ["train.max_steps=1", "train.update_tokens=64", "data.max_tokens=64"]
    small += ["train.valid_interval=0", "train.average_last=0", "train.compile_step=false"]
    for command, extra in ((prepare, shrink), (train, [*small, "--no-progress"])):
        argv = shlex.split(command)[1:] + extra
        done = subprocess.run(
            [sys.executable, "-m", "aiayn", *argv],
            capture_output=True, text=True, cwd=work, env=cli_env(),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert (work / "runs" / "en-de" / "checkpoints").is_dir()


def test_counts_of_one_are_singular(tmp_path, capsys):
    (tmp_path / "a.en").write_text("one line\n")
    (tmp_path / "a.de").write_text("eine zeile\nzwei\n")
    argv = ["prepare", "--train", str(tmp_path / "a"), "--valid", str(tmp_path / "a")]
    argv += ["--src", "en", "--tgt", "de", "--out", str(tmp_path / "d")]
    _fails(argv, capsys, f"{tmp_path / 'a.en'} has 1 line but {tmp_path / 'a.de'} has 2:")
    _fails(["bleu", str(tmp_path / "a.de"), str(tmp_path / "a.en")], capsys, "a.en has 1 line but")


def test_a_full_disk_while_preparing_says_what_it_takes(tmp_path, capsys, monkeypatch):
    """A full disk under DATA_DIR: one line that says so, with the room free and the input's
    size (exit status 2), whether the write reported ENOSPC or, as numpy's and
    sentencepiece's do, a short write without an error number."""
    import errno

    import aiayn.data.prepare as prepare
    from aiayn.data import staging

    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in ("train.en", "train.de"):
        (folder / name).write_text("a b c\n" * 50)
    argv = ["prepare", "--train", str(folder / "train"), "--valid", str(folder / "train")]
    argv += ["--src", "en", "--tgt", "de", "--vocab-size", "20", "--out", str(tmp_path / "d")]

    def no_room(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare, "_clean_split", no_room)
    _fails(argv, capsys, f"no space left on the device of {tmp_path / 'd'} (")
    message = f"the prepared data takes about twice the input text ({1.2:.1f} kB"
    monkeypatch.setattr(staging, "_mb", lambda n: f"{n / 1e3:.1f} kB")
    _fails(argv, capsys, message)

    def short_write(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError("434353 requested and 90112 written")

    monkeypatch.setattr(prepare, "_clean_split", short_write)
    _fails(argv, capsys, "434353 requested")  # room enough: the error as it came
    monkeypatch.setattr(staging, "_free", lambda folder: 4096)
    _fails(argv, capsys, "(4.1 kB free) to prepare the data; the prepared data takes about")


def test_resuming_with_the_data_of_another_directory(data_dir, tmp_path, capsys):
    """Another --data with a tokenizer of the same size: the refusal names the directory the
    run was trained on, not "the data was prepared again since"."""
    from aiayn.data.prepare import prepare_data
    from tests.helpers import WORDS, write_reverse_text

    run = tmp_path / "run"
    argv = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(run)]
    assert main([*argv, "train.max_steps=1", "train.valid_interval=0", "--no-progress"]) == 0
    write_reverse_text(tmp_path, "t", 300, seed=5)
    other = tmp_path / "other"
    prepare_data(tmp_path / "t", tmp_path / "t", None, "src", "tgt", len(WORDS) + 4, other,
                 model_type="word")  # fmt: skip
    capsys.readouterr()
    _fails(
        ["train", "--out", str(run), "--data", str(other), "train.max_steps=2"],
        capsys,
        f"the run in {run} was trained on {Path(data_dir).resolve()}, and {other} has another "
        f"tokenizer; resume it with --data {Path(data_dir).resolve()}, or train into a new",
    )
