"""Export to Hugging Face transformers (``aiayn export-hf``): ``MarianMTModel`` and
``MarianTokenizer`` load the directory and give what aiayn gives, for each special-token,
position and embedding layout aiayn trains: the same source tokens, teacher-forced logits to
float32 rounding, the same greedy tokens and text, and the same beams where the two beam
searches' rules agree (α = 0 and the fairseq rule; transformers' ``length_penalty=0``,
``early_stopping=True``). ``aiayn import-marian`` reads the directory back to the same logits;
CTranslate2's converter for transformers models reads it and translates as ``export-ct2``'s
model does. Writing is atomic; what cannot export is refused in one line.

The models are tiny and trained for a few dozen updates to reverse word sequences, so that
their hypotheses end with EOS at various lengths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'aiayn[interop]')"
)

from aiayn.cli import main  # noqa: E402
from aiayn.config import DecodeConfig, RunConfig, load_config  # noqa: E402
from aiayn.data.collate import BOS_ID, EOS_ID, PAD_ID, collate_pairs  # noqa: E402
from aiayn.data.tokenizer import Tokenizer  # noqa: E402
from aiayn.errors import UserError  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.interop.hf import HF_BOS, export_hf, hf_ids, hf_order  # noqa: E402
from aiayn.interop.marian import import_marian  # noqa: E402
from aiayn.model.transformer import Transformer  # noqa: E402
from aiayn.training.checkpoint import (  # noqa: E402
    bytes_to_tensor,
    model_checkpoint,
    model_state,
    save_atomic,
)
from tests.interop.reversal import trained_model  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses"),
]
_PAD = torch.tensor([PAD_ID])
transformers.logging.set_verbosity_error()


def hf_logits(hf: Any, sources: list[list[int]], targets: list[list[int]], size: int) -> Any:
    """transformers' teacher-forced logits of aiayn-id sources and targets, in aiayn's ids."""
    to_hf = torch.tensor(hf_ids(size))
    batch = collate_pairs(sources, targets)
    src = to_hf[batch.src_ids].masked_fill(batch.src_pad, size - 1)
    with torch.inference_mode():
        logits = hf(
            input_ids=src, attention_mask=~batch.src_pad, decoder_input_ids=to_hf[batch.tgt_in]
        ).logits
    return logits[..., to_hf], batch


def hf_search(hf: Any, hf_tokenizer: Any, line: str, limit: int, **settings: Any) -> list[int]:
    """transformers' output for one line, in aiayn's ids, without start, EOS and padding:
    at most ``limit`` output tokens, then EOS (forced_eos_token_id), as aiayn's limit."""
    size = hf.config.decoder_vocab_size
    order = hf_order(size)
    inputs = hf_tokenizer([line], return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=limit + 1, do_sample=False, **settings)
    return [order[j] for j in out[0, 1:].tolist() if order[j] not in (EOS_ID, PAD_ID)]


VARIANTS = {
    "the paper's (interleaved sinusoids, shared, LayerNorm 1e-6)": (),
    "learned positions, untied projection": ("model.positional=learned", "model.tie_output=false"),
    "separate embeddings, no attention bias, GELU": (
        "model.share_embeddings=false",
        "model.attention_bias=false",
        "model.activation=gelu",
    ),
    "Marian's (halves, Swish, LayerNorm 1e-5, logits bias, BOS no output)": (
        "model.positional_layout=halves",
        "model.activation=swish",
        "model.layer_norm_eps=1e-5",
        "model.final_logits_bias=true",
        "model.bos_output=false",
    ),
}


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=list(VARIANTS))
def test_transformers_translates_as_aiayn(
    overrides: tuple[str, ...], tokenizer: Tokenizer, lines: list[str], tmp_path: Path
) -> None:
    model = trained_model(tokenizer, *overrides)
    if model.out_proj.bias is not None:  # a bias that matters
        model.out_proj.bias.data = torch.randn(model.out_proj.bias.shape) * 0.5
    out = export_hf(model, tmp_path / "hf", tokenizer=tokenizer)
    hf = transformers.MarianMTModel.from_pretrained(out).eval()
    hf_tokenizer = transformers.MarianTokenizer.from_pretrained(out)
    size = tokenizer.vocab_size
    sources = [tokenizer.encode(line) for line in lines]
    order = hf_order(size)
    for line, ids in zip(lines, sources, strict=True):  # the same tokens, EOS appended
        assert [order[j] for j in hf_tokenizer(line).input_ids] == [*ids, EOS_ID]

    # Teacher-forced logits to float32 rounding (BOS's, where it is no output: biased by
    # NO_OUTPUT_BIAS, out of the softmax, as aiayn decodes it).
    targets = [ids[::-1] for ids in sources]
    theirs, batch = hf_logits(hf, sources, targets, size)
    with torch.inference_mode():
        ours = model(batch.src_ids, batch.src_pad, batch.tgt_in)
    real = batch.tgt_out != PAD_ID
    if not model.config.bos_output:
        assert (theirs[..., BOS_ID] < -9e3).all()
        theirs[..., BOS_ID] = ours[..., BOS_ID]
    assert (theirs - ours)[real].abs().max() < 2e-5

    compared = 0
    for beam in (1, 4):
        decode = DecodeConfig(beam_size=beam, alpha=0.0, beam_rule="fairseq", max_len_b=5)
        engine = Translator(model, tokenizer, decode, accelerated=False)
        ours_hyps = engine.translate_nbest(lines)
        settings = {"num_beams": beam}
        if beam > 1:  # the rules agree: no length penalty, stop once the beam has
            # finished; no forced EOS, which transformers' beam search scores as free
            settings |= {"length_penalty": 0.0, "early_stopping": True}
            settings["forced_eos_token_id"] = None
        for line, ids, hyps in zip(lines, sources, ours_hyps, strict=True):
            limit = len(ids) + 5
            # Greedy search always agrees; beam search where aiayn's best hypothesis ended
            # before the limit (at the limit the two searches end their beams differently).
            if beam > 1 and len(hyps[0].tokens) >= limit:
                continue
            tokens = hf_search(hf, hf_tokenizer, line, limit, **settings)
            assert tokens == hyps[0].tokens, (beam, line)
            if beam == 1:
                hf_out = [hf_ids(size)[i] for i in tokens]
                assert hf_tokenizer.decode(hf_out, skip_special_tokens=True) == hyps[0].text
            compared += beam > 1
    assert compared >= 5  # most beams end with EOS before the limit


def test_the_directory_and_its_generation_config(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """PAD and BOS are never output, EOS ends every hypothesis, the files are Marian's."""
    model = trained_model(tokenizer)
    out = export_hf(model, tmp_path / "hf", tokenizer=tokenizer)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md"} <= names
    assert {"vocab.json", "source.spm", "target.spm", "tokenizer_config.json"} <= names
    assert not any(name.startswith(".") for name in names)
    size = tokenizer.vocab_size
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    assert (vocab["</s>"], vocab["<unk>"], vocab["<s>"], vocab["<pad>"]) == (0, 1, 2, size - 1)
    assert sorted(vocab.values()) == list(range(size))
    assert all(vocab[tokenizer.piece(i)] == i - 1 for i in range(4, size))
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["bad_words_ids"] == [[size - 1], [HF_BOS]]
    hf = transformers.MarianMTModel.from_pretrained(out).eval()
    assert hf.config.decoder_start_token_id == HF_BOS and hf.config.pad_token_id == size - 1
    assert not hf.model.decoder.embed_tokens.weight[HF_BOS].any()  # the start row is zero
    # As the model card shows it: the generation config's settings, greedy search.
    hf_tokenizer = transformers.MarianTokenizer.from_pretrained(out)
    engine = Translator(model, tokenizer, DecodeConfig(beam_size=1), accelerated=False)
    # Lines whose translation ends before aiayn's limit, source tokens + max_len_b
    # (transformers' is the model's positions): which lines do depends on the CPU the model
    # was trained on.
    candidates = ["alpha bravo charlie", "golf hotel india", "echo", "delta echo", "hotel golf"]
    nbest = engine.translate_nbest(candidates)
    ours = {
        line: hyps[0].text
        for line, hyps in zip(candidates, nbest, strict=True)
        if len(hyps[0].tokens) < len(tokenizer.encode(line)) + engine.decode.max_len_b
    }
    assert len(ours) >= 2, nbest
    lines = list(ours)
    inputs = hf_tokenizer(lines, return_tensors="pt", padding=True)
    with torch.inference_mode():
        generated = hf.generate(**inputs, num_beams=1)
    texts = hf_tokenizer.batch_decode(generated, skip_special_tokens=True)
    assert texts == list(ours.values())


@pytest.mark.parametrize("overrides", [(), VARIANTS[list(VARIANTS)[3]]], ids=["paper", "marian"])
def test_import_marian_reads_it_back(
    overrides: tuple[str, ...], tokenizer: Tokenizer, lines: list[str], tmp_path: Path
) -> None:
    model = trained_model(tokenizer, *overrides)
    out = export_hf(model, tmp_path / "hf", tokenizer=tokenizer)
    back, _, back_tokenizer = import_marian(out)
    assert back_tokenizer.vocab_size == tokenizer.vocab_size
    assert [back_tokenizer.piece(i) for i in range(tokenizer.vocab_size)] == [
        tokenizer.piece(i) for i in range(tokenizer.vocab_size)
    ]
    assert back.config.bos_output  # the exported BOS logit carries what bos_output=false did
    sources = [back_tokenizer.encode(line) for line in lines]
    assert sources == [tokenizer.encode(line) for line in lines]
    batch = collate_pairs(sources, [ids[::-1] for ids in sources])
    with torch.inference_mode():
        ours = model(batch.src_ids, batch.src_pad, batch.tgt_in)
        theirs = back(batch.src_ids, batch.src_pad, batch.tgt_in)
    real = batch.tgt_out != PAD_ID
    if not model.config.bos_output:
        assert (theirs[..., BOS_ID] < -9e3).all()
        theirs = theirs.clone()
        theirs[..., BOS_ID] = ours[..., BOS_ID]
    assert (theirs - ours)[real].abs().max() < 2e-5


@pytest.mark.parametrize("separate", [False, True], ids=["shared", "separate vocabularies"])
def test_a_model_imported_from_marian_exports_back(separate: bool, tmp_path: Path) -> None:
    """Marian → import-marian → export-hf: transformers' greedy outputs are the original's."""
    from tests.interop.test_marian import SENTENCES, _hf_tokenizer, _marian_dir

    directory = _marian_dir(tmp_path, "swish", separate, True)
    model, config, tokenizer = import_marian(directory)
    out = export_hf(model, tmp_path / "hf", tokenizer=tokenizer, config=config)
    assert (out / "target_vocab.json").is_file() == separate
    texts = []
    for path, hf_tokenizer in (
        (directory, _hf_tokenizer(directory)),
        (out, transformers.MarianTokenizer.from_pretrained(out)),
    ):
        hf = transformers.MarianMTModel.from_pretrained(path).eval()
        inputs = hf_tokenizer(SENTENCES, return_tensors="pt", padding=True)
        never = [[hf.config.pad_token_id]] + ([[HF_BOS]] if path == out else [])
        with torch.inference_mode():
            generated = hf.generate(
                **inputs, num_beams=1, max_new_tokens=20, forced_eos_token_id=None,
                bad_words_ids=never,
            )  # fmt: skip
        texts.append(hf_tokenizer.batch_decode(generated, skip_special_tokens=True))
    assert texts[1] == texts[0] and len(set(texts[0])) > 1


def test_ctranslate2_converts_it_as_export_ct2(
    tokenizer: Tokenizer, lines: list[str], tmp_path: Path
) -> None:
    ctranslate2 = pytest.importorskip("ctranslate2", reason="CTranslate2 is not installed")
    from aiayn.interop.ct2 import export_ct2

    model = trained_model(tokenizer)
    export_hf(model, tmp_path / "hf", tokenizer=tokenizer)
    converter = ctranslate2.converters.TransformersConverter(str(tmp_path / "hf"))
    converter.convert(str(tmp_path / "converted"))
    export_ct2(model, tmp_path / "ct2", tokenizer=tokenizer)
    converted = ctranslate2.Translator(str(tmp_path / "converted"), intra_threads=1)
    exported = ctranslate2.Translator(str(tmp_path / "ct2"), intra_threads=1)
    pieces = [[tokenizer.piece(i) for i in tokenizer.encode(line)] for line in lines]
    for beam in (1, 4):
        settings = {"beam_size": beam, "max_decoding_length": 20, "length_penalty": 0.0}
        theirs = converted.translate_batch(
            [[*p, "</s>"] for p in pieces], suppress_sequences=[["<s>"]], **settings
        )
        ours = exported.translate_batch(pieces, suppress_sequences=[["<pad>"], ["<s>"]], **settings)
        assert [r.hypotheses[0] for r in theirs] == [r.hypotheses[0] for r in ours]
        assert any(len(r.hypotheses[0]) < 19 for r in ours)
    # The converter drops <pad> from the vocabulary, as for every Marian model: its
    # log-probabilities are aiayn's renormalised without PAD (which is never output).
    sources = [tokenizer.encode(line) for line in lines]
    targets = [ids[::-1] for ids in sources]
    scored = converted.score_batch(
        [[*p, "</s>"] for p in pieces], [[tokenizer.piece(i) for i in t] for t in targets]
    )
    batch = collate_pairs(sources, targets)
    with torch.inference_mode():
        logits = model(batch.src_ids, batch.src_pad, batch.tgt_in).index_fill(-1, _PAD, -1e9)
    expected = torch.log_softmax(logits, -1).gather(-1, batch.tgt_out[..., None])[..., 0]
    for row, result in enumerate(scored):
        theirs_lp = torch.tensor(result.log_probs)
        assert torch.allclose(theirs_lp, expected[row, : len(theirs_lp)], atol=2e-5, rtol=0)


def save(model: Transformer, tokenizer: Tokenizer, path: Path, config: RunConfig) -> Path:
    spm = bytes_to_tensor(tokenizer.to_bytes())
    save_atomic(model_checkpoint(config, model_state(model), spm, 0, 0), path)
    return path


def a_run(tokenizer: Tokenizer, folder: Path) -> Path:
    """A run directory as ``aiayn train`` leaves it: averaged.pt, metrics.jsonl, run.json
    pointing at a data directory with its manifest."""
    model = trained_model(tokenizer)
    run, data = folder / "run", folder / "data"
    run.mkdir()
    data.mkdir()
    manifest = {
        "src": "en",
        "tgt": "de",
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_options": {"model_type": "word"},
        "splits": {"train": {"pairs": 4800, "inputs": {"en": "/x/train.en", "de": "/x/train.de"}}},
    }
    (data / "manifest.json").write_text(json.dumps(manifest))
    record = {"data": str(data), "world_size": 1, "host": "Test CPU, 2 logical CPUs"}
    (run / "run.json").write_text(json.dumps(record))
    records = [
        {"kind": "train", "step": 60, "epoch": 0, "minutes": 1.5, "tokens": 4800},
        {"kind": "valid", "step": 60, "minutes": 1.6, "ppl": 1.25},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = load_config(overrides=["preset=tiny", f"model.vocab_size={tokenizer.vocab_size}"])
    config = RunConfig(model=model.config, decode=config.decode, preset="tiny")
    save(model, tokenizer, run / "averaged.pt", config)
    return run


def test_export_command_and_model_card(
    tokenizer: Tokenizer, lines: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = a_run(tokenizer, tmp_path)
    src, ref = tmp_path / "test.en", tmp_path / "test.de"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ref.write_text("\n".join(" ".join(line.split()[::-1]) for line in lines) + "\n")
    out = tmp_path / "hf"
    args = ["export-hf", str(run), "--out", str(out), "--evaluate", str(src), str(ref)]
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == str(out)
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "language:\n- en\n- de" in card and "# en→de" in card
    assert "| train | 4,800 | train.en | train.de |" in card
    assert "training time: 1.5 minutes" in card and "updates: 60" in card
    assert "host: Test CPU, 2 logical CPUs" in card
    assert "last validation perplexity: 1.25" in card
    assert 'preset = "tiny"' in card
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in card  # BLEU's signature
    assert "chrF2|nrefs:1" in card
    metadata = json.loads((out / "aiayn-export.json").read_text())
    assert metadata["checkpoint"]["path"] == str(run / "averaged.pt")
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert (tokenizer_config["source_lang"], tokenizer_config["target_lang"]) == ("en", "de")
    # An existing directory: refused in one line, replaced with --force.
    assert main(["export-hf", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not empty (--force" in err and len(err.splitlines()) == 1
    (out / "stale.txt").write_text("old")
    assert main(["export-hf", str(run / "averaged.pt"), "--out", str(out), "--force"]) == 0
    assert not (out / "stale.txt").exists()
    assert "No test scores" in (out / "README.md").read_text(encoding="utf-8")


def test_writing_is_atomic(
    tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure half-way leaves neither a directory nor a temporary one; with --force the
    directory that was there stays whole."""
    import safetensors.torch

    model = trained_model(tokenizer)
    out = tmp_path / "hf"

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.raises(UserError, match=r"cannot write .*No space left"):
        export_hf(model, out, tokenizer=tokenizer)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    export_hf(model, out, tokenizer=tokenizer)
    before = sorted(p.name for p in out.iterdir())
    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.raises(UserError, match="cannot write"):
        export_hf(model, out, tokenizer=tokenizer, force=True)
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


REFUSED = {
    "pre-norm": (("model.pre_norm=true",), "Marian's layers are post-norm"),
    "local attention": (("model.encoder_attention=local",), "Marian has full attention only"),
    "d_k": (("model.d_k=4", "model.d_v=4"), "split d_model = 32 evenly"),
}


@pytest.mark.parametrize("overrides, message", REFUSED.values(), ids=list(REFUSED))
def test_what_cannot_export_is_refused_in_one_line(
    overrides: tuple[str, ...], message: str, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    config = load_config(
        overrides=["preset=tiny", f"model.vocab_size={tokenizer.vocab_size}", *overrides]
    )
    with pytest.raises(UserError, match=message) as err:
        export_hf(Transformer(config.model), tmp_path / "hf", tokenizer=tokenizer)
    assert len(str(err.value).splitlines()) == 1
    assert not (tmp_path / "hf").exists()


def test_other_families_are_refused_in_one_line(
    tokenizer: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiayn.model.families import build_model

    spm = bytes_to_tensor(tokenizer.to_bytes())
    size = f"model.vocab_size={tokenizer.vocab_size}"
    small = ("model.n_layers=1", "model.d_model=32", "model.d_ff=64")
    for preset, words in (("rnnsearch", "holds an RNN model"), ("gpt_small", "lm task")):
        config = load_config(overrides=[f"preset={preset}", *small, size])
        path = tmp_path / f"{preset}.pt"
        save_atomic(
            model_checkpoint(config, model_state(build_model(config.model)), spm, 0, 0), path
        )
        assert main(["export-hf", str(path), "--out", str(tmp_path / preset)]) == 2
        err = capsys.readouterr().err
        assert words in err and "Hugging Face" in err and len(err.splitlines()) == 1
        if preset == "rnnsearch":  # the model object too
            with pytest.raises(UserError, match="object does not export to Hugging Face"):
                export_hf(build_model(config.model), tmp_path / "object", tokenizer=tokenizer)  # type: ignore[arg-type]
