"""Export to CTranslate2 of models imported from Hugging Face Marian (``model.bos_output =
false``), proven by equality with aiayn's PyTorch engine: random Marian models built here
(tests/interop/test_marian.py's), imported, exported to float32, and decoded by both engines
to the same token ids, greedily and with beam search, with the same teacher-forced
log-probabilities; the exported directory carries Marian's sentencepiece models and its
README's tokenisation gives aiayn's pieces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ctranslate2 = pytest.importorskip(
    "ctranslate2", reason="CTranslate2 is not installed (pip install 'aiayn[interop]')"
)
pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[interop]')"
)

from aiayn.cli import main  # noqa: E402
from aiayn.config import DecodeConfig  # noqa: E402
from aiayn.data.collate import BOS_ID, PAD_ID, collate_pairs  # noqa: E402
from aiayn.data.tokenizer import PieceVocabTokenizer  # noqa: E402
from aiayn.errors import UserError  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.interop.ct2 import NO_OUTPUT_BIAS, export_ct2  # noqa: E402
from aiayn.interop.ct2_translator import Ct2Translator  # noqa: E402
from aiayn.interop.marian import import_marian  # noqa: E402
from aiayn.model.transformer import Transformer  # noqa: E402
from tests.interop.test_marian import DE, EN, SENTENCES, _marian_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

LINES = [*SENTENCES, *EN[:6], "the green park", "a woman reads under the tree"]
LIMIT = 20  # output tokens before EOS


def decode_config(beam: int, alpha: float = 0.0) -> DecodeConfig:
    return DecodeConfig(
        beam_size=beam, alpha=alpha, beam_rule="fairseq", max_len_a=0.0, max_len_b=LIMIT
    )


def renormalised_log_probs(
    model: Transformer, sources: list[list[int]], targets: list[list[int]]
) -> torch.Tensor:
    """aiayn's teacher-forced log-probabilities of ``targets`` (and EOS) for a model that
    never outputs BOS: renormalised without BOS."""
    batch = collate_pairs(sources, targets)
    with torch.inference_mode():
        log_probs = torch.log_softmax(model(batch.src_ids, batch.src_pad, batch.tgt_in), -1)
    log_probs = log_probs - torch.log1p(-log_probs[..., BOS_ID : BOS_ID + 1].exp())
    return log_probs.gather(-1, batch.tgt_out[..., None])[..., 0]


CASES = [
    pytest.param("swish", True, True, id="swish-separate-bias"),
    pytest.param("swish", False, True, id="swish-shared-bias"),
    pytest.param("relu", False, False, id="relu-shared"),
]


@pytest.mark.parametrize(("activation", "separate", "logits_bias"), CASES)
def test_an_imported_marian_model_decodes_as_in_pytorch(
    tmp_path: Path, activation: str, separate: bool, logits_bias: bool
) -> None:
    model, config, tokenizer = import_marian(
        _marian_dir(tmp_path, activation, separate, logits_bias)
    )
    assert not config.model.bos_output and config.model.share_embeddings is not separate
    out = export_ct2(model, tmp_path / "ct2", tokenizer=tokenizer)
    sources = [tokenizer.encode(line) for line in LINES]
    compared = 0
    for beam, alpha in ((1, 0.0), (4, 0.0), (4, 0.6)):
        decode = decode_config(beam, alpha)
        ours = Translator(model, tokenizer, decode, nbest=beam, accelerated=False)
        theirs = Ct2Translator(out, tokenizer, decode, config.model, nbest=beam, threads=1)
        for mine, other in zip(ours.search_ids(sources), theirs.search_ids(sources), strict=True):
            # Greedy search always agrees, at the limit too; beam search where aiayn's
            # hypotheses all ended before it (docs/interop.md, where the engines differ).
            if beam == 1 or all(len(h.tokens) < LIMIT for h in mine):
                assert [h.tokens for h in other] == [h.tokens for h in mine]
                for a, b in zip(mine, other, strict=True):
                    assert b.log_prob == pytest.approx(a.log_prob, abs=1e-4)
                    assert b.score == pytest.approx(a.score, abs=1e-4)
                compared += beam > 1
            assert all(BOS_ID not in h.tokens and PAD_ID not in h.tokens for h in other)
    if logits_bias:  # EOS is likelier there: the beams end before the limit
        assert compared >= 8
    # Teacher-forced: CTranslate2's log-probabilities are aiayn's renormalised ones.
    greedy = Translator(model, tokenizer, decode_config(1), accelerated=False)
    targets = [hyps[0].tokens if hyps else [] for hyps in greedy.search_ids(sources)]
    engine = ctranslate2.Translator(str(out), intra_threads=1)
    scored = engine.score_batch(
        [[tokenizer.source_vocab[i] for i in s] for s in sources],
        [[tokenizer.target_vocab[i] for i in t] for t in targets],
    )
    expected = renormalised_log_probs(model, sources, targets)
    for row, result in enumerate(scored):
        got = torch.tensor(result.log_probs)
        assert len(got) == len(targets[row]) + 1  # and EOS
        assert torch.allclose(got, expected[row, : len(got)], atol=2e-5, rtol=0)


def test_the_exported_directory_of_an_imported_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _marian_dir(tmp_path, "swish", True, True)
    model, _, tokenizer = import_marian(directory)
    assert isinstance(tokenizer, PieceVocabTokenizer)
    out = export_ct2(model, tmp_path / "ct2", tokenizer=tokenizer)
    names = {p.name for p in out.iterdir()}
    assert {"source_vocabulary.json", "target_vocabulary.json", "source.spm", "target.spm"} <= names
    assert "sentencepiece.model" not in names and "shared_vocabulary.json" not in names
    # Marian's own sentencepiece models, and its vocabularies in aiayn's order.
    for name in ("source.spm", "target.spm"):
        assert (out / name).read_bytes() == (directory / name).read_bytes()
    assert json.loads((out / "source_vocabulary.json").read_text()) == tokenizer.source_vocab
    assert json.loads((out / "target_vocabulary.json").read_text()) == tokenizer.target_vocab
    config = json.loads((out / "config.json").read_text())
    assert config["decoder_start_token"] == config["bos_token"] == "<s>"
    assert config["layer_norm_epsilon"] == pytest.approx(1e-5)
    readme = (out / "README.md").read_text()
    assert "source.spm" in readme and "target.spm" in readme and f"{NO_OUTPUT_BIAS:g}" in readme
    # The README's tokenisation (language code included) gives aiayn's pieces, and its
    # recipe aiayn's greedy translations.
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    setup = code.split("translator = ", 1)[0].replace(
        'lines = ["A man rides a bicycle down the street."]', f"lines = {LINES!r}"
    )
    monkeypatch.chdir(out)
    namespace: dict[str, object] = {}
    exec(setup, namespace)
    sources = namespace["sources"]
    assert isinstance(sources, list)
    known = set(tokenizer.source_vocab)
    assert [[p if p in known else "<unk>" for p in s] for s in sources] == [
        [tokenizer.source_vocab[i] for i in tokenizer.encode(line)] for line in LINES
    ]
    assert sources[3][0] == ">>deu<<"
    engine = ctranslate2.Translator(".", device="cpu", intra_threads=1)
    results = engine.translate_batch(
        sources,
        beam_size=1,
        max_decoding_length=LIMIT,  # EOS included: aiayn's first LIMIT tokens
        min_decoding_length=0,
        suppress_sequences=[["<pad>"], ["<s>"]],
    )
    target = namespace["target"]
    theirs = [target.decode(r.hypotheses[0]) for r in results]  # type: ignore[attr-defined]
    ours = Translator(model, tokenizer, decode_config(1)).translate(LINES)
    assert theirs == ours and len(set(ours)) > 1


def test_import_export_and_translate_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``import-marian``, then ``export-ct2`` (no longer refused) and ``translate --engine
    ctranslate2``, which prints what the PyTorch engine prints."""
    checkpoint = tmp_path / "opus.pt"
    directory = _marian_dir(tmp_path, "swish", True, True)
    assert main(["import-marian", str(directory), "--out", str(checkpoint)]) == 0
    assert main(["export-ct2", str(checkpoint), "--out", str(tmp_path / "ct2")]) == 0
    assert (tmp_path / "ct2" / "target.spm").is_file()
    source = tmp_path / "src.txt"
    source.write_text("\n".join([*LINES, "", *DE[:2]]) + "\n", encoding="utf-8")
    capsys.readouterr()
    outputs = []
    for engine in ("torch", "ctranslate2"):
        args = ["translate", str(checkpoint), "-i", str(source), "--engine", engine]
        limits = ["--max-len-a", "0", "--max-len-b", str(LIMIT), "--beam-rule", "fairseq"]
        assert main([*args, *limits, "--beam", "1", "--threads", "1", "--device", "cpu"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert len(outputs[0].splitlines()) == len(LINES) + 3 and any(outputs[0].splitlines())


def test_bos_is_out_of_the_softmax(tmp_path: Path) -> None:
    """The exported projection's bias: the final-logits bias, and NO_OUTPUT_BIAS at BOS
    (so that CTranslate2 gives BOS no probability); unchanged for other models."""
    from aiayn.interop.ct2 import transformer_spec, vocabularies

    model, _, tokenizer = import_marian(_marian_dir(tmp_path, "swish", False, True))
    source, target = vocabularies(tokenizer)
    spec = transformer_spec(model, source, target)
    bias = spec.decoder.projection.bias
    bias = bias.numpy() if hasattr(bias, "numpy") else bias
    expected = model.out_proj.bias.detach().numpy().copy()
    assert expected[BOS_ID] == expected[PAD_ID] != NO_OUTPUT_BIAS  # Marian's pad, twice
    expected[BOS_ID] = NO_OUTPUT_BIAS
    assert (bias == expected).all()
    # A piece listed twice (here Marian's own "<s>" beside aiayn's BOS) is refused.
    with pytest.raises(UserError, match=r"target vocabulary lists '<s>' twice \(ids 2 and 9\)"):
        transformer_spec(model, source, [*target[:9], "<s>", *target[10:]])
