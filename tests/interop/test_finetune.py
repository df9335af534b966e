"""Fine-tuning a model imported from Marian with ``aiayn prepare --tokenizer`` and
``aiayn train`` (``train.init_from``): the data is encoded as MarianTokenizer encodes it, the
run starts from the imported weights exactly, and it learns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[interop]')"
)

from aiayn.cli import main  # noqa: E402
from aiayn.data.collate import PAD_ID  # noqa: E402
from aiayn.data.corpus import Corpus, load_manifest  # noqa: E402
from aiayn.inference import loading  # noqa: E402
from tests.interop.test_marian import DE, EN, _hf_tokenizer, _marian_dir, _marian_ids  # noqa: E402

QUICK = ["--no-progress", "train.log_interval=1", "train.save_interval_minutes=0"]


def _texts(folder: Path) -> None:
    """Parallel text in the Marian model's own words: 60 training and 6 validation pairs."""
    folder.mkdir()
    for split, rows in (("train", slice(0, 60)), ("valid", slice(0, 6))):
        (folder / f"{split}.en").write_text("\n".join(EN[rows]) + "\n", encoding="utf-8")
        (folder / f"{split}.de").write_text("\n".join(DE[rows]) + "\n", encoding="utf-8")


def _valid_nll(checkpoint: Path, data: Path) -> float:
    """The mean NLL per target token of a checkpoint on the valid split of ``data``."""
    model = loading.load_model(checkpoint).model.eval()
    corpus = Corpus.open(data, "valid")
    batch = corpus.batch(list(range(len(corpus))))
    with torch.no_grad():
        logits = model(batch.src_ids, batch.src_pad, batch.tgt_in)
    return float(
        torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD_ID
        )
    )


def test_fine_tune_an_imported_marian_model(tmp_path, capsys):
    directory = _marian_dir(tmp_path, "swish", separate=True, logits_bias=True)
    imported = tmp_path / "opus.pt"
    assert main(["import-marian", str(directory), "--out", str(imported)]) == 0
    _texts(tmp_path / "text")
    data = tmp_path / "data"
    text = str(tmp_path / "text")
    prepare = ["prepare", "--train", f"{text}/train", "--valid", f"{text}/valid"]
    prepare += ["--src", "en", "--tgt", "de", "--out", str(data)]
    assert main([*prepare, "--tokenizer", str(imported), "--vocab-size", "100"]) == 2
    assert "--tokenizer brings its own vocabulary; drop --vocab-size" in capsys.readouterr().err
    assert main([*prepare, "--tokenizer", str(imported)]) == 0
    out = capsys.readouterr().out
    state = torch.load(imported, weights_only=True)
    tokenizer_bytes = bytes(state["tokenizer"].numpy().tobytes())
    assert (data / "spm.model").read_bytes() == tokenizer_bytes
    manifest = load_manifest(data)
    model_config = state["config"]["model"]
    assert manifest["vocab_size"] == model_config["vocab_size"]
    assert manifest["tgt_vocab_size"] == model_config["tgt_vocab_size"] != manifest["vocab_size"]
    assert f"from {imported.resolve()}" in out

    # Both sides encoded as MarianTokenizer encodes them (target ids from target_vocab.json).
    from aiayn.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(data / "spm.model")
    hf_tok = _hf_tokenizer(directory)
    corpus = Corpus.open(data, "valid")
    for i in range(len(corpus)):
        src, tgt = corpus.pair(i)
        theirs_src = hf_tok(EN[i]).input_ids
        theirs_tgt = hf_tok(text_target=DE[i]).input_ids
        assert _marian_ids(tokenizer, [*src.tolist()], hf_tok, False) == theirs_src[:-1]
        assert _marian_ids(tokenizer, [*tgt.tolist()], hf_tok, True) == theirs_tgt[:-1]

    # A run from the imported model takes its [model] section; with learning rate 0 its
    # weights stay the imported ones exactly.
    run = ["train", "--config", "tiny", "--data", str(data), *QUICK]
    init = f"train.init_from={imported}"
    still = tmp_path / "still"
    frozen = ["train.lr_scale=0", "train.max_steps=1", "train.valid_interval=0"]
    assert main([*run, "--out", str(still), init, *frozen, "model.dropout=0.0"]) == 0
    assert "model initialised from" in capsys.readouterr().err
    saved = loading.load_checkpoint(still / "averaged.pt")
    stored = {**model_config, "dropout": 0.0}
    assert saved["config"]["model"] == stored
    for name, tensor in state["model"].items():
        assert torch.equal(saved["model"][name], tensor), name

    # Fine-tuning: the validation loss falls from the imported model's, and the result
    # translates with the imported tokenizer.
    tuned = tmp_path / "tuned"
    steps = ["train.max_steps=120", "train.warmup_steps=10", "train.lr_scale=0.2"]
    steps += ["train.valid_interval=120", "train.average_last=0", "train.valid_bleu=false"]
    assert main([*run, "--out", str(tuned), init, *steps]) == 0
    before, after = _valid_nll(imported, data), _valid_nll(tuned, data)
    assert after < 0.5 * before, (before, after)
    source = tmp_path / "in.en"
    source.write_text("\n".join(EN[:6]) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", str(tuned), "-i", str(source), "--beam", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    close = sum(hyp == ref for hyp, ref in zip(lines, DE[:6], strict=True))
    assert close >= 3, lines
    # Resuming the fine-tuned run needs nothing from the imported checkpoint.
    imported.unlink()
    config = (tuned / "config.toml").read_text(encoding="utf-8")
    assert "init_from" in config
    more = ["train", "--out", str(tuned), "--no-progress", "train.max_steps=121"]
    assert main(more) == 0
    assert json.loads((tuned / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 121


def test_init_from_refuses_data_of_another_tokenizer_or_shape(tmp_path, capsys):
    directory = _marian_dir(tmp_path, "relu", separate=False, logits_bias=False)
    imported = tmp_path / "opus.pt"
    assert main(["import-marian", str(directory), "--out", str(imported)]) == 0
    _texts(tmp_path / "text")
    text = str(tmp_path / "text")
    prepare = ["prepare", "--train", f"{text}/train", "--valid", f"{text}/valid"]
    prepare += ["--src", "en", "--tgt", "de"]
    own, borrowed = tmp_path / "own", tmp_path / "borrowed"
    assert main([*prepare, "--out", str(own), "--vocab-size", "60"]) == 0
    assert main([*prepare, "--out", str(borrowed), "--tokenizer", str(imported)]) == 0
    capsys.readouterr()
    run = ["train", "--config", "tiny", *QUICK, "train.max_steps=1", f"train.init_from={imported}"]
    # Data with its own vocabulary: refused before training, naming the remedy.
    assert main([*run, "--data", str(own), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert f"prepare the data with --tokenizer {imported}" in err
    # The model's shape is the imported one; the run may change only its dropout.
    assert main([*run, "--data", str(borrowed), "--out", str(tmp_path / "b"), "model.d_ff=16"]) == 2
    err = capsys.readouterr().err
    assert "in its own shape" in err and "model.d_ff is 64 in it, 16 in this run" in err
    # A model of another task is not a starting point.
    lm = ["model.task=lm"]
    assert main([*run, "--data", str(borrowed), "--out", str(tmp_path / "c"), *lm]) == 2
    assert "a translation model" in capsys.readouterr().err
