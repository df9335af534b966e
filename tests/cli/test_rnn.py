"""The attention-RNN baselines through the command line: train (with validation BLEU,
checkpoints and averaging), translate with beam and greedy search, score, draw the attention;
export to CTranslate2 is refused.
That they learn: tests/model/test_rnn.py."""

import importlib.util

import pytest

from aiayn.cli import main
from aiayn.inference import loading
from aiayn.model.rnn import LuongNMT, RNNSearch
from tests.helpers import TINY

pytestmark = pytest.mark.usefixtures("single_thread")

QUICK = [
    "train.max_steps=30",
    "train.valid_interval=15",
    "train.save_interval_steps=15",
    "train.log_interval=1000",
    "train.clip_norm=1",
    "--no-progress",
]


@pytest.mark.parametrize(("arch", "kind"), [("bahdanau", RNNSearch), ("luong", LuongNMT)])
def test_an_rnn_model_trains_translates_and_draws_its_attention(
    arch, kind, reverse_data_dir, tmp_path, capsys
):
    run = tmp_path / "run"
    args = ["train", "--config", TINY, "--data", str(reverse_data_dir), "--out", str(run)]
    assert main([*args, f"model.arch={arch}", *QUICK]) == 0
    out = capsys.readouterr().out
    assert "reached train.max_steps=30" in out and "averaged model" in out
    assert isinstance(loading.load_model(run).model, kind)  # averaged.pt

    sources = (reverse_data_dir / "valid.src").read_text().splitlines()[:20]
    references = (reverse_data_dir / "valid.tgt").read_text().splitlines()[:20]
    source, reference = tmp_path / "src.txt", tmp_path / "ref.txt"
    source.write_text("\n".join(sources) + "\n")
    reference.write_text("\n".join(references) + "\n")
    for beam in ("1", "3"):
        assert main(["translate", str(run), "-i", str(source), "--beam", beam]) == 0
        hypotheses = capsys.readouterr().out.splitlines()
        assert len(hypotheses) == len(sources)  # (30 updates teach it little: no score)
    hypothesis = tmp_path / "hyp.txt"
    hypothesis.write_text("\n".join(hypotheses) + "\n")
    assert main(["bleu", str(hypothesis), str(reference)]) == 0
    assert "BLEU" in capsys.readouterr().out

    pictures = tmp_path / "attention"
    assert main(["attention", str(run), sources[0], "--out", str(pictures)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1:] == [str(pictures / "cross_layer1.png")]  # one layer, one head
    assert (pictures / "cross_layer1.png").read_bytes()[:4] == b"\x89PNG"
    if importlib.util.find_spec("ctranslate2") is not None:  # export: Transformers only
        assert main(["export-ct2", str(run), "--out", str(tmp_path / "ct2")]) != 0
        assert f"model.arch={arch}" in capsys.readouterr().err
        # The CTranslate2 engine refuses it before it says it exports, and leaves nothing.
        engine = ["translate", str(run), "-i", sources[0], "--engine", "ctranslate2"]
        assert main(engine) != 0
        err = capsys.readouterr().err
        assert f"model.arch={arch}" in err and "exporting" not in err, err
        assert not [p for p in run.iterdir() if "ct2" in p.name]
