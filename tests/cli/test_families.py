"""The lm and classify tasks through the command line: prepare, train, resume, fine-tune from a
pre-trained encoder, generate, classify and score."""

import io
import json
import random
import re
import shutil

import pytest
import torch

from aiayn.cli import main
from aiayn.errors import UserError
from aiayn.inference import loading
from aiayn.inference.classifier import TextClassifier
from aiayn.training.tasks import score_split
from tests.helpers import TINY

pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = "sun moon star sky sea land fire water stone wind rain snow cloud light dark".split()
QUICK = [
    "train.warmup_steps=10",
    "train.save_interval_steps=5",
    "train.save_interval_minutes=0",
    "train.valid_interval=5",
    "train.log_interval=1000",
    "train.average_last=2",
    "train.label_smoothing=0",
    "model.max_positions=64",
    "data.max_tokens=256",
    "train.update_tokens=200",
    "--no-progress",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Prepared lm and classify data (labels: whether a line mentions fire)."""
    folder = tmp_path_factory.mktemp("families")
    rng = random.Random(1)

    def write(name: str, n: int, labelled: bool) -> str:
        lines = []
        for _ in range(n):
            text = " ".join(rng.choices(WORDS, k=rng.randint(3, 10)))
            lines.append(f"{'hot' if 'fire' in text else 'cold'}\t{text}" if labelled else text)
        (folder / name).write_text("".join(line + "\n" for line in lines))
        return str(folder / name)

    for task, ext in (("lm", "txt"), ("classify", "tsv")):
        train, valid = write(f"train.{ext}", 300, task == "classify"), write(f"v.{ext}", 30, True)
        if task == "lm":
            valid = write("valid.txt", 30, False)
        args = ["prepare", "--task", task, "--train", train, "--valid", valid, "--test", valid]
        assert main([*args, "--vocab-size", "60", "--out", str(folder / task)]) == 0
    return folder


def test_lm_trains_resumes_and_generates(data, tmp_path, capsys, monkeypatch):
    run = tmp_path / "lm"
    args = ["train", "--config", TINY, "--data", str(data / "lm"), "--out", str(run)]
    assert main([*args, "model.task=lm", "train.max_steps=6", *QUICK]) == 0
    assert main([*args, "model.task=lm", "train.max_steps=10", *QUICK]) == 0  # resumes
    err = capsys.readouterr().err
    assert "resuming from" in err and "valid @ 10: loss" in err
    assert "training tiny with model.max_positions=64, model.task=lm (" in err  # not tiny's own
    state = loading.load_checkpoint(run / "averaged.pt")
    assert state["config"]["model"]["task"] == "lm" and state["step"] == 10
    assert main(["generate", str(run), "sun moon", "--seed", "1", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sun moon") and out.endswith("\n")
    assert main(["generate", str(run), "sun", "--beam", "3", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("sun")
    # Scoring a split gives what the run's own validation gave for the same model.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in records if r["kind"] == "valid" and r["step"] == 10)
    scored = score_split(run / "checkpoints" / "step_00000010.pt", data / "lm", "valid")
    for key in ("loss", "nll", "ppl"):
        assert scored[key] == pytest.approx(logged[key], rel=1e-6), key
    assert main(["generate", str(run), "--data", str(data / "lm")]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"test: loss [0-9.]+, nll [0-9.]+ per token, perplexity [0-9.]+\n", out)
    for bad, message in (
        (["sun", "--data", str(data / "lm")], "a prompt goes with generating"),
        (["--data", str(data / "lm"), "--greedy"], "--greedy goes with generating"),
        (["--data", str(data / "lm"), "--seed", "1", "--top-k", "3"], "--top-k, --seed go with"),
        (["sun", "--split", "valid"], "--split goes with --data"),
        (["--data", str(data / "classify")], "prepared with another tokenizer than"),
    ):
        assert main(["generate", str(run), *bad]) == 2
        assert message in capsys.readouterr().err
    # Prompts from stdin, a line each: a line that is not UTF-8 is named as translate names it.
    stdin = io.TextIOWrapper(io.BytesIO(b"sun\r\nmo\xe9n\n"))
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["generate", str(run), "--greedy", "--max-new-tokens", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("sun") and captured.out.count("\n") == 1
    assert "stdin: line 2 is not valid UTF-8 (byte 3: b'\\xe9')" in captured.err
    # A prompt too long for the model: refused before anything is written; from stdin, that
    # line is answered with an empty one and the next is read.
    long = " ".join(["sun moon"] * 80)
    assert main(["generate", str(run), long, "--greedy", "--max-new-tokens", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "the model reads at most 64" in captured.err
    stdin = io.TextIOWrapper(io.BytesIO(f"sun\n{long}\nmoon\n".encode()))
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["generate", str(run), "--greedy", "--max-new-tokens", "2"]) == 2
    captured = capsys.readouterr()
    lines = captured.out.split("\n")
    assert lines[0].startswith("sun") and lines[1] == "" and lines[2].startswith("moon")
    assert "aiayn generate: error: stdin: line 2: the prompt has" in captured.err
    # The wrong command for the model says which one serves it, in one line.
    for command in (["classify", str(run)], ["translate", str(run)]):
        assert main([*command, "--input", str(data / "valid.txt")]) == 2
        err = capsys.readouterr().err
        assert "aiayn generate" in err and len(err.strip().splitlines()) == 1, err
    # A language model goes on training on new text with its own vocabulary and shape.
    more = tmp_path / "more"
    new = ["prepare", "--task", "lm", "--train", str(data / "valid.txt")]
    new += ["--valid", str(data / "valid.txt"), "--tokenizer", str(run), "--out", str(more)]
    assert main(new) == 0
    go_on = ["train", "--config", TINY, "--data", str(more), "--out", str(tmp_path / "lm2")]
    go_on += ["model.task=lm", f"train.init_from={run / 'averaged.pt'}", *QUICK]
    assert main([*go_on, "train.max_steps=1", "train.lr_scale=0"]) == 0
    again = loading.load_checkpoint(tmp_path / "lm2" / "averaged.pt")
    assert again["config"]["model"] == state["config"]["model"]
    for name, tensor in state["model"].items():
        assert torch.equal(again["model"][name], tensor), name
    capsys.readouterr()
    for bad, message in (
        (["--beam", "0"], "beam size must be at least 1"),
        (
            ["--beam", "2", "--alpha", "-1"],
            "alpha (the length penalty) must be a number from 0 to 10",
        ),
        (["--greedy", "--samples", "2"], "--samples goes with sampling"),
        (["--beam", "2", "--top-p", "0.5"], "--top-p sets the sampling; drop it"),
        (
            ["--greedy", "--top-k", "5", "--seed", "1"],
            "--top-k, --seed set the sampling; drop them",
        ),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    ):
        assert main(["generate", str(run), "sun", *bad]) == 2
        assert message in capsys.readouterr().err


def test_classifier_fine_tunes_from_a_pretrained_encoder(data, tmp_path, capsys):
    mlm, clf = tmp_path / "mlm", tmp_path / "clf"
    common = ["--config", TINY, "--data", str(data / "classify"), *QUICK]
    assert main(["train", *common, "--out", str(mlm), "model.task=mlm", "train.max_steps=5"]) == 0
    pretrained = loading.load_checkpoint(mlm / "averaged.pt")["model"]
    over = ["model.task=classify", "train.max_steps=5", "train.update_tokens=16"]
    init = f"train.init_from={mlm / 'averaged.pt'}"
    assert main(["train", *common, "--out", str(clf), *over, init, "train.max_steps=0"]) == 2
    assert "no stopping rule" in capsys.readouterr().err
    # Fine-tuning starts from the pre-trained weights exactly: an update of learning rate 0.
    assert main(["train", *common, "--out", str(clf), *over, init, "train.lr_scale=0"]) == 0
    assert "encoder initialised from" in capsys.readouterr().err
    tuned = loading.load_checkpoint(clf / "averaged.pt")
    assert tuned["labels"] == ["cold", "hot"]
    for name, tensor in pretrained.items():
        if name.startswith(("embed.", "encoder.")):
            assert torch.equal(tuned["model"][name], tensor), name
    png = tmp_path / "new" / "folder" / "confusion.png"  # its folders made
    score = ["classify", str(clf), "--data", str(data / "classify"), "--split", "test"]
    assert main([*score, "--confusion", str(png)]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "macro-F1" in out and "hot" in out
    assert png.stat().st_size > 1000
    # The library's scoring of the prepared split reads the accuracy the command printed.
    accuracy = float(re.search(r"accuracy ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert score_split(clf, data / "classify", "test", "auto")["accuracy"] == pytest.approx(
        accuracy, abs=5e-5
    )
    # Options of the other mode are refused, not ignored; a --confusion that cannot be
    # written is refused before the scoring.
    for extra, message in (
        ([*score, "--top", "2"], "--top goes with texts to classify, not --data"),
        ([*score, "--input", "x.txt"], "--input goes with texts"),
        ([*score, "--confusion", str(tmp_path)], "is a directory"),
        (["classify", str(clf), "--split", "valid"], "--split goes with --data"),
    ):
        assert main(extra) == 2
        assert message in capsys.readouterr().err
    # A vocabulary taken from the pre-trained run: the same tokenizer as its data's.
    again = tmp_path / "again"
    train, valid = str(data / "train.tsv"), str(data / "v.tsv")
    prepare = ["prepare", "--task", "classify", "--train", train, "--valid", valid]
    assert main([*prepare, "--tokenizer", str(mlm), "--out", str(again)]) == 0
    spm = (data / "classify" / "spm.model").read_bytes()
    assert (again / "spm.model").read_bytes() == spm
    # Other classes with that tokenizer: the model's class indices would mean others.
    other = tmp_path / "other.tsv"
    other.write_text("".join(f"{'wet' if i % 2 else 'dry'}\tsun moon fire\n" for i in range(20)))
    prepare = ["prepare", "--task", "classify", "--train", str(other), "--valid", str(other)]
    assert main([*prepare, "--tokenizer", str(mlm), "--out", str(tmp_path / "other")]) == 0
    with pytest.raises(UserError, match=r"the classes of .*other are not those of .*\(cold, hot"):
        score_split(clf, tmp_path / "other", "valid")
    capsys.readouterr()
    texts = tmp_path / "texts.txt"
    texts.write_text("fire fire sun\n\nsnow rain\n  \n")
    assert main(["classify", str(clf), "--input", str(texts), "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(lines[i].count(":") == 2 for i in (0, 2))
    assert lines[1] == lines[3] == ""  # empty texts: empty lines, as translate gives
    # A text longer than the model's 64 positions is cut, with a warning naming its line (as
    # translate's); a corpus's long texts beyond the first few are counted.
    texts.write_text("sun\n\n" + " ".join(["fire"] * 80) + "\n")
    assert main(["classify", str(clf), "--input", str(texts)]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^warning: line 3: \d+ tokens \(\+ BOS, EOS\) exceed the model's 64 ", err)
    assert "classifying the first 62" in err and len(err.splitlines()) == 1, err
    classifier = TextClassifier.from_checkpoint(clf)
    said: list[str] = []
    classifier.warn = said.append
    classifier.probabilities([" ".join(["sun"] * (70 + i)) for i in range(5)])
    assert said[0].startswith("text 1: ") and said[2].startswith("text 3: ") and len(said) == 4
    assert said[3] == (
        "2 more texts exceed the model's 64 positions; each is classified by its first 62 tokens"
    )


def test_init_from_refuses_another_tokenizer_or_task(data, tmp_path, capsys):
    lm = tmp_path / "lm"
    lm_args = ["--config", TINY, "--data", str(data / "lm"), *QUICK, "train.max_steps=1"]
    assert main(["train", *lm_args, "--out", str(lm), "model.task=lm"]) == 0
    common = ["--config", TINY, "--data", str(data / "classify"), *QUICK, "train.max_steps=1"]
    clf = ["train", *common, "--out", str(tmp_path / "c"), "model.task=classify"]
    assert main([*clf, f"train.init_from={lm / 'averaged.pt'}"]) == 2
    assert "encoder-only" in capsys.readouterr().err
    # A pre-trained model that is not there: the setting named, and the way around it.
    assert main([*clf, f"train.init_from={tmp_path / 'nowhere.pt'}"]) == 2
    err = capsys.readouterr().err
    assert f"train.init_from={tmp_path / 'nowhere.pt'}: checkpoint" in err
    assert "train.init_from=none trains from scratch" in err
    assert not (tmp_path / "c").exists()  # no directory left holding only the run's lock
    # An encoder pre-trained on other data has another vocabulary.
    mlm = tmp_path / "mlm"
    assert main(["train", *lm_args, "--out", str(mlm), "model.task=mlm"]) == 0
    assert main([*clf, f"train.init_from={mlm / 'averaged.pt'}"]) == 2
    assert "another tokenizer" in capsys.readouterr().err
    # Translation presets refuse text data, in one line.
    assert main(["train", *common, "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "model.task=translation needs parallel text" in err
    # A translation checkpoint is not a language model.
    from tests.helpers import make_reverse_data

    pairs = make_reverse_data(tmp_path / "text", n_train=200, n_valid=10)
    t_args = ["train", "--config", TINY, "--data", str(pairs), "--out", str(tmp_path / "tr")]
    assert main([*t_args, "train.max_steps=1", "train.valid_interval=0", "--no-progress"]) == 0
    assert main(["generate", str(tmp_path / "tr"), "alpha"]) == 2
    err = capsys.readouterr().err
    assert "translation task" in err and "aiayn translate" in err


def test_classify_data_of_one_class_is_refused_saying_so(data, tmp_path, capsys):
    """Data prepared with one label (by an older prepare, or a manifest edited by hand): the
    refusal says it has one class, not none."""
    one = tmp_path / "one"
    shutil.copytree(data / "classify", one)
    manifest = json.loads((one / "manifest.json").read_text())
    manifest["labels"] = manifest["labels"][:1]
    (one / "manifest.json").write_text(json.dumps(manifest))
    args = ["train", "--config", TINY, "--data", str(one), "--out", str(tmp_path / "run")]
    assert main([*args, "model.task=classify", "train.max_steps=1", *QUICK]) == 2
    assert "has one class label ('cold')" in capsys.readouterr().err
