"""Export to CTranslate2 and CTranslate2 as an engine of ``aiayn translate``: CTranslate2's
greedy and beam outputs equal aiayn's token for token, scores included (post-norm and
pre-norm, sinusoidal and learned positions, shared and separate embeddings, without attention
biases, with d_k·h ≠ d_model, with a LayerNorm epsilon large enough to matter), the exported
directory loads and translates as its README says, ``translate --engine ctranslate2`` prints
what the PyTorch engine prints, and its export cache is reused, checked by content and
rebuilt.

The models are tiny and trained for a few dozen updates to reverse word sequences, from
random weights: enough for their hypotheses to end with EOS at various lengths (random
weights alone seldom end a hypothesis, and at the output limit the two engines' beam searches
differ by design, docs/interop.md)."""

from __future__ import annotations

import json
import math
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ctranslate2 = pytest.importorskip(
    "ctranslate2", reason="CTranslate2 is not installed (pip install 'aiayn[interop]')"
)

from aiayn.cli import main  # noqa: E402
from aiayn.config import DecodeConfig, RunConfig, load_config  # noqa: E402
from aiayn.data.collate import BOS_ID, EOS_ID, PAD_ID, UNK_ID, collate_pairs  # noqa: E402
from aiayn.data.tokenizer import Tokenizer  # noqa: E402
from aiayn.errors import UserError  # noqa: E402
from aiayn.inference.search import gnmt_length_penalty  # noqa: E402
from aiayn.inference.translator import Translation, Translator  # noqa: E402
from aiayn.interop import ct2 as ct2_module  # noqa: E402
from aiayn.interop.ct2 import export_ct2, vocabularies  # noqa: E402
from aiayn.interop.ct2_translator import Ct2Translator, ranking_penalties  # noqa: E402
from aiayn.model.transformer import Transformer  # noqa: E402
from aiayn.training.checkpoint import (  # noqa: E402
    bytes_to_tensor,
    model_checkpoint,
    model_state,
    save_atomic,
)
from tests.interop.reversal import trained_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


def same_hypotheses(ours: list[Translation], theirs: list[Translation]) -> None:
    assert [h.tokens for h in theirs] == [h.tokens for h in ours]
    for a, b in zip(ours, theirs, strict=True):
        assert b.log_prob == pytest.approx(a.log_prob, abs=1e-4)
        assert b.score == pytest.approx(a.score, abs=1e-4)
        assert b.text == a.text


VARIANTS = {
    "post-norm": (),
    "pre-norm": ("model.pre_norm=true",),
    "learned positions": ("model.positional=learned",),
    "separate embeddings, no attention bias": (
        "model.share_embeddings=false",
        "model.attention_bias=false",
    ),
    "d_k = d_v = 4 with 4 heads of d_model 32": ("model.d_k=4", "model.d_v=4"),
    "LayerNorm epsilon 0.1, pre-norm": ("model.layer_norm_eps=0.1", "model.pre_norm=true"),
}


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=list(VARIANTS))
def test_ctranslate2_decodes_as_aiayn(
    overrides: tuple[str, ...], tokenizer: Tokenizer, lines: list[str], tmp_path: Path
) -> None:
    model = trained_model(tokenizer, *overrides)
    export_ct2(model, tmp_path / "ct2", tokenizer=tokenizer)
    limits = [len(tokenizer.encode(line)) + 5 for line in lines]
    compared = 0
    for beam in (1, 4):
        decode = DecodeConfig(beam_size=beam, beam_rule="fairseq", max_len_a=1.0, max_len_b=5)
        torch_engine = Translator(model, tokenizer, decode, nbest=beam, accelerated=False)
        ct2_engine = Ct2Translator(
            tmp_path / "ct2", tokenizer, decode, model.config, nbest=beam, threads=1
        )
        ours = torch_engine.translate_nbest(lines)
        theirs = ct2_engine.translate_nbest(lines)
        for mine, other, limit in zip(ours, theirs, limits, strict=True):
            # Greedy search always agrees; beam search where aiayn's finished all its
            # hypotheses before the limit (so its search stopped before it, as the fairseq
            # rule stops once the beam size have finished).
            if beam == 1 or all(len(h.tokens) < limit for h in mine):
                same_hypotheses(mine, other)
                compared += beam > 1
    assert compared >= 5  # most sentences: the beams do end with EOS
    # Teacher-forced, token by token: the same log-probabilities to float32 rounding.
    sources = [tokenizer.encode(line) for line in lines]
    targets = [hyps[0].tokens for hyps in ours]
    engine = ctranslate2.Translator(str(tmp_path / "ct2"), intra_threads=1)
    pieces = [[tokenizer.piece(i) for i in ids] for ids in sources]
    scored = engine.score_batch(pieces, [[tokenizer.piece(i) for i in t] for t in targets])
    batch = collate_pairs(sources, targets)
    with torch.inference_mode():
        logits = model(batch.src_ids, batch.src_pad, batch.tgt_in)
    expected = torch.log_softmax(logits, -1).gather(-1, batch.tgt_out[..., None])[..., 0]
    for row, result in enumerate(scored):
        theirs = torch.tensor(result.log_probs)
        assert torch.allclose(theirs, expected[row, : len(theirs)], atol=2e-5, rtol=0)


def test_output_limits_and_empty_inputs(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """Limits of 0 (only EOS may follow BOS), hypotheses cut at the limit (EOS forced after
    it, and scored) and empty sources give what aiayn gives."""
    model = trained_model(tokenizer)
    export_ct2(model, tmp_path / "ct2", tokenizer=tokenizer)
    sources = [[5, 6, 7], [], [8], [9, 10, 11, 12, 4, 5, 6], [7, 8]]
    for beam in (1, 3):
        decode = DecodeConfig(beam_size=beam, beam_rule="fairseq", max_len_a=0.5, max_len_b=0)
        torch_engine = Translator(model, tokenizer, decode, nbest=beam, accelerated=False)
        ct2 = Ct2Translator(tmp_path / "ct2", tokenizer, decode, model.config, nbest=beam)
        ours, theirs = torch_engine.search_ids(sources), ct2.search_ids(sources)
        assert theirs[1] == [] == ours[1]
        assert [h.tokens for h in theirs[2]] == [[]] == [h.tokens for h in ours[2]]  # limit 0
        assert theirs[2][0].log_prob == pytest.approx(ours[2][0].log_prob, abs=1e-4)
        if beam == 1:  # the others reach their limit: greedy search agrees all the same
            for mine, other in zip(ours, theirs, strict=True):
                assert [h.tokens for h in other] == [h.tokens for h in mine]
                for a, b in zip(mine, other, strict=True):
                    assert b.log_prob == pytest.approx(a.log_prob, abs=1e-4)
            assert any(
                len(h[0].tokens) == len(s) // 2 for h, s in zip(ours, sources, strict=True) if s
            )
        else:  # beam search cut at the limit: aiayn's live beams, each ended with EOS
            for mine, other in zip(ours[2:], theirs[2:], strict=True):
                assert [h.tokens for h in other] == [h.tokens for h in mine]
                for a, b in zip(mine, other, strict=True):
                    assert b.score == pytest.approx(a.score, abs=1e-4)
            cut = [
                len(h.tokens) == len(s) // 2
                for hs, s in zip(ours, sources, strict=True)
                for h in hs
            ]
            assert sum(cut) > 3  # hypotheses that reached the limit were compared


def test_the_exported_directory(tokenizer: Tokenizer, tmp_path: Path) -> None:
    model = trained_model(tokenizer, "model.layer_norm_eps=1e-5")
    out = export_ct2(model, tmp_path / "ct2", tokenizer=tokenizer)
    names = {p.name for p in out.iterdir()}
    assert {"model.bin", "config.json", "shared_vocabulary.json", "README.md"} <= names
    assert {"sentencepiece.model", "aiayn.json"} <= names and not any(
        n.startswith(".") for n in names
    )
    config = json.loads((out / "config.json").read_text())
    source, target = vocabularies(tokenizer)
    assert source == target == [tokenizer.piece(i) for i in range(tokenizer.vocab_size)]
    assert config["layer_norm_epsilon"] == pytest.approx(1e-5)
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == (
        target[BOS_ID],
        target[EOS_ID],
        target[UNK_ID],
    )
    assert config["decoder_start_token"] == target[BOS_ID] and config["add_source_eos"]
    assert json.loads((out / "shared_vocabulary.json").read_text()) == source
    # The README's recipe: ctranslate2 and sentencepiece alone, aiayn's greedy output.
    import sentencepiece as spm

    readme = (out / "README.md").read_text()
    assert "ctranslate2.Translator" in readme and "sentencepiece.model" in readme
    sp = spm.SentencePieceProcessor(model_file=str(out / "sentencepiece.model"))
    engine = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    line = "alpha golf bravo echo"
    pieces = sp.encode(line, out_type=str)
    [result] = engine.translate_batch(
        [pieces],
        beam_size=1,
        max_decoding_length=len(pieces) + 5,
        min_decoding_length=0,
        suppress_sequences=[[target[PAD_ID]], [target[BOS_ID]]],
    )
    decode = DecodeConfig(beam_size=1, max_len_a=1.0, max_len_b=5)
    assert (
        sp.decode(result.hypotheses[0]) == Translator(model, tokenizer, decode).translate([line])[0]
    )
    # The model is untouched by an int8 export (the specification quantizes copies).
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_ct2(model, tmp_path / "int8", "int8", tokenizer=tokenizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert json.loads((tmp_path / "int8" / "aiayn.json").read_text())["quantization"] == "int8"
    with pytest.raises(UserError, match="not empty"):
        export_ct2(model, out, tokenizer=tokenizer)
    with pytest.raises(UserError, match="unknown quantization"):
        export_ct2(model, tmp_path / "q", "int4", tokenizer=tokenizer)
    with pytest.raises(UserError, match="d_k=8 with d_v=4"):
        unequal = load_config(overrides=["preset=tiny", "model.d_v=4"]).model
        export_ct2(Transformer(unequal), tmp_path / "dv", tokenizer=tokenizer)


def save(model: Transformer, tokenizer: Tokenizer, path: Path) -> Path:
    config = RunConfig(model=model.config)
    spm = bytes_to_tensor(tokenizer.to_bytes())
    save_atomic(model_checkpoint(config, model_state(model), spm, 0, 0), path)
    return path


def test_export_command(
    tokenizer: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = save(trained_model(tokenizer), tokenizer, tmp_path / "m.pt")
    out = tmp_path / "out"
    assert main(["export-ct2", str(checkpoint), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    metadata = json.loads((out / "aiayn.json").read_text())
    assert metadata["checkpoint"]["size"] == checkpoint.stat().st_size
    assert metadata["config"]["model"]["vocab_size"] == tokenizer.vocab_size
    ctranslate2.Translator(str(out))  # loads
    assert main(["export-ct2", str(checkpoint), "--out", str(out)]) == 2
    assert "not empty (--force, or force=True from Python, replaces it)" in capsys.readouterr().err
    args = ["export-ct2", str(checkpoint), "--out", str(out), "--quantization", "int8", "--force"]
    assert main(args) == 0
    assert json.loads((out / "aiayn.json").read_text())["quantization"] == "int8"
    capsys.readouterr()
    # Another task's model is refused in one line.
    from aiayn.model.families import build_model

    lm = load_config(
        overrides=[
            "preset=gpt_small",
            *("model.n_layers=1", "model.d_model=32", "model.d_ff=64"),
            f"model.vocab_size={tokenizer.vocab_size}",
        ]
    )
    lm_path = tmp_path / "lm.pt"
    spm = bytes_to_tensor(tokenizer.to_bytes())
    save_atomic(model_checkpoint(lm, model_state(build_model(lm.model)), spm, 0, 0), lm_path)
    assert main(["export-ct2", str(lm_path), "--out", str(tmp_path / "lm")]) == 2
    err = capsys.readouterr().err
    assert "lm task" in err and "only translation models" in err and len(err.splitlines()) == 1


def test_without_ctranslate2(
    tokenizer: Tokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    checkpoint = save(trained_model(tokenizer), tokenizer, tmp_path / "m.pt")
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 fails
    assert main(["export-ct2", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'aiayn[interop]'" in err and len(err.splitlines()) == 1
    source = tmp_path / "src.txt"
    source.write_text("abc\n", encoding="utf-8")
    args = ["translate", str(checkpoint), "-i", str(source), "--engine", "ctranslate2"]
    assert main(args) == 2
    assert "pip install 'aiayn[interop]'" in capsys.readouterr().err


def translate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, str]:
    assert main(["translate", *args, "--threads", "1", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_translate_engine_prints_what_torch_prints(
    tokenizer: Tokenizer, lines: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = str(save(trained_model(tokenizer), tokenizer, tmp_path / "m.pt"))
    source = tmp_path / "src.txt"
    source.write_text("\n".join([lines[0], "", *lines[1:6], "  "]) + "\n", encoding="utf-8")
    common = [checkpoint, "-i", str(source), "--beam-rule", "fairseq"]
    for extra in (["--beam", "1"], ["--beam", "4"]):
        out, err = translate(capsys, *common, *extra)
        ct2_out, ct2_err = translate(capsys, *common, *extra, "--engine", "ctranslate2")
        assert ct2_out == out and len(out.splitlines()) == 8 and out.splitlines()[1] == ""
        assert "translated 8 lines" in err and "translated 8 lines" in ct2_err
        assert "(CTranslate2, float32)" in ct2_err
    # n-best: ranks and texts as printed, scores to the last printed digit.
    out, _ = translate(capsys, *common, "--beam", "4", "--nbest", "3")
    ct2_out, _ = translate(
        capsys, *common, "--beam", "4", "--nbest", "3", "--engine", "ctranslate2"
    )
    rows = [line.split("\t") for line in out.splitlines()]
    ct2_rows = [line.split("\t") for line in ct2_out.splitlines()]
    assert len(rows) == len(ct2_rows) == 8 * 3
    assert [(r[0], r[2]) for r in ct2_rows] == [(r[0], r[2]) for r in rows]
    for ours, theirs in zip(rows, ct2_rows, strict=True):
        assert float(theirs[1]) == pytest.approx(float(ours[1]), abs=1.5e-4)
    assert rows[3:6] == [["1", "0.0000", ""], ["2", "0.0000", ""], ["3", "0.0000", ""]]
    # int8 weights decode too (other numbers, so only the shape of the output is checked).
    out, err = translate(capsys, *common, "--quantize", "int8", "--engine", "ctranslate2")
    assert len(out.splitlines()) == 8 and "(CTranslate2, int8_float32)" in err


def test_translate_engine_refusals(
    tokenizer: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = str(save(trained_model(tokenizer), tokenizer, tmp_path / "m.pt"))
    source = tmp_path / "src.txt"
    source.write_text("abc\n", encoding="utf-8")
    base = ["translate", checkpoint, "-i", str(source), "--engine", "ctranslate2"]
    for extra, message in (
        (["--pack-weights"], "--pack-weights is an option of --engine torch"),
        (["--no-pack-weights"], "--no-pack-weights is an option of --engine torch"),
        (["--compiled-step"], "--compiled-step is an option of --engine torch"),
        (["--no-compiled-step"], "--no-compiled-step is an option of --engine torch"),
        (["--no-mmap"], "--no-mmap is an option of --engine torch"),
        (["--beam-rule", "paper"], "use --beam-rule fairseq, or --engine torch"),
        (["--device", "tpu"], "unknown device 'tpu' for CTranslate2"),
        (["--threads", "0"], "--threads must be at least 1"),
    ):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) == 1, err
    # decode_overrides named and typed as Translator's, before anything is exported.
    from aiayn.errors import ConfigError

    logged: list[str] = []
    with pytest.raises(ConfigError, match=r"unknown key\(s\) decode\.beam;"):
        Ct2Translator.from_checkpoint(checkpoint, decode_overrides={"beam": 2}, log=logged.append)
    assert logged == [] and not list(tmp_path.glob("*.ct2-*"))
    alpha = Ct2Translator.from_checkpoint(checkpoint, decode_overrides={"alpha": "0.5"})[0]
    assert alpha.decode.alpha == 0.5


def test_export_cache(
    tokenizer: Tokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    checkpoint = save(trained_model(tokenizer), tokenizer, run / "averaged.pt")
    source = tmp_path / "src.txt"
    source.write_text("alpha bravo\ncharlie delta echo\n", encoding="utf-8")
    exports: list[Path] = []
    real_export = ct2_module.export_ct2

    def counting(*args: object, **kwargs: object) -> Path:
        exports.append(Path(str(args[1])))
        return real_export(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ct2_module, "export_ct2", counting)
    args = [str(run), "-i", str(source), "--engine", "ctranslate2", "--beam", "1"]
    first, err = translate(capsys, *args)
    cache = run / "averaged.ct2-float32"
    assert exports == [cache] and "exporting" in err and (cache / "model.bin").is_file()
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no temporary left
    again, err = translate(capsys, *args)
    assert again == first and exports == [cache] and "exporting" not in err
    # Same bytes, new time: the SHA-256 says it is the same model; the time is remembered.
    stat = checkpoint.stat()
    os.utime(checkpoint, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert translate(capsys, *args)[0] == first and exports == [cache]
    key = json.loads((cache / "aiayn.json").read_text())["checkpoint"]
    assert key["mtime_ns"] == checkpoint.stat().st_mtime_ns
    # Another model in the same file: exported again, and its translations come out.
    save(trained_model(tokenizer, steps=30), tokenizer, checkpoint)
    changed, err = translate(capsys, *args)
    assert exports == [cache, cache] and "exporting" in err
    torch_out, _ = translate(capsys, str(checkpoint), "-i", str(source), "--beam", "1")
    assert changed == torch_out != first
    # int8 has its own cache directory.
    translate(capsys, *args, "--quantize", "int8")
    assert exports[-1] == run / "averaged.ct2-int8"


def test_export_where_the_checkpoint_folder_is_read_only(
    tokenizer: Tokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    checkpoint = save(trained_model(tokenizer), tokenizer, tmp_path / "m.pt")
    real_mkdir = Path.mkdir

    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        if self.parent == tmp_path and self.name.startswith(".m.ct2"):
            raise PermissionError(13, "Permission denied")
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", refuse)
    source = tmp_path / "src.txt"
    source.write_text("abc\n", encoding="utf-8")
    out, err = translate(capsys, str(checkpoint), "-i", str(source), "--engine", "ctranslate2")
    assert len(out.splitlines()) == 1
    assert "cannot write" in err and "for this run instead" in err
    assert not (tmp_path / "m.ct2-float32").exists()


def test_ranking_penalties_bracket_gnmt() -> None:
    low, high = ranking_penalties(0.6, 40)
    assert low == pytest.approx(0.1) and high == pytest.approx(0.6 * 40 / 45)
    # Every secant of GNMT's log-penalty against log length lies between the two.
    for a in range(1, 40):
        for b in range(a + 1, 41):
            secant = 0.6 * math.log((5 + b) / (5 + a)) / math.log(b / a)
            assert low <= secant <= high
    assert ranking_penalties(0.0, 40) == (1e-30, 1e-30)
    assert 1.0 ** ranking_penalties(0.0, 40)[0] == 1.0


class _Result:
    def __init__(self, hypotheses: list[list[str]], scores: list[float]) -> None:
        self.hypotheses, self.scores = hypotheses, scores


def _top(hyps: list[tuple[list[str], float]], n: int, rank: Callable[[int], float]) -> list:
    """The best ``n`` of (pieces with EOS, log P) by log P / rank(length)."""
    return sorted(hyps, key=lambda h: -h[1] / rank(len(h[0])))[:n]


class _CappedEngine:
    """The end of CTranslate2's beam search: of the hypotheses that finished (given per
    source, at most 2 · beam_size - 1), the best ``num_hypotheses`` by log P / length **
    length_penalty, with those scores in float32. Records each call's penalty and sources."""

    def __init__(self, finished: dict[str, list[tuple[list[str], float]]]) -> None:
        self.finished = finished
        self.calls: list[tuple[float, list[str]]] = []

    def translate_batch(
        self, pieces: list[list[str]], *, num_hypotheses: int, length_penalty: float, **_: object
    ) -> list[_Result]:
        self.calls.append((length_penalty, [" ".join(p) for p in pieces]))
        results = []
        for source in pieces:
            kept = _top(
                self.finished[" ".join(source)], num_hypotheses, lambda n: n**length_penalty
            )
            scores = [float(torch.tensor(lp / len(h) ** length_penalty)) for h, lp in kept]
            results.append(_Result([h for h, _ in kept], scores))
        return results


@pytest.mark.parametrize("nbest", [1, 4])
def test_gnmt_best_survives_ctranslate2s_cap(
    tokenizer: Tokenizer, tmp_path: Path, nbest: int
) -> None:
    """Where more than beam_size hypotheses finish, CTranslate2 keeps beam_size of them by its
    power-law penalty. The engine returns GNMT's best, and its second, whatever the finished
    set; it decodes a sentence again only where a hypothesis left out could matter (with
    nbest 1, seldom), and then ranks the union of both decodings as GNMT does."""
    export_ct2(trained_model(tokenizer), tmp_path / "ct2", tokenizer=tokenizer)
    k, alpha, limit = 4, 0.6, 39
    decode = DecodeConfig(
        beam_size=k, beam_rule="fairseq", alpha=alpha, max_len_a=0, max_len_b=limit
    )
    translator = Ct2Translator(tmp_path / "ct2", tokenizer, decode, RunConfig().model, nbest=nbest)
    eos = tokenizer.piece(EOS_ID)
    words = [tokenizer.piece(i) for i in range(4, tokenizer.vocab_size)]
    rng = random.Random(3)
    finished: dict[str, list[tuple[list[str], float]]] = {}
    for row in range(300):
        # As CTranslate2's search ends: fewer than K hypotheses finished before its last step
        # T, and up to K at it (lengths without EOS: T - 1).
        hyps: dict[tuple[str, ...], float] = {}
        if row == 0:  # the empty translation is GNMT's best; four long ones rank above it
            hyps[()] = -2.0  # under the power law with GNMT's slope at 15 tokens
            for j in range(4):
                hyps[tuple(rng.choice(words) for _ in range(14))] = -4.3 - 0.01 * j
        else:
            last = rng.randint(3, limit)
            shorter = rng.randint(0, k - 1)
            while len(hyps) < shorter:
                n = rng.randint(0, last - 2)
                hyps[tuple(rng.choice(words) for _ in range(n))] = -rng.uniform(0.2, 1.0) * (n + 1)
            total = shorter + rng.randint(k - shorter, k)
            while len(hyps) < total:
                n = last - 1
                hyps[tuple(rng.choice(words) for _ in range(n))] = -rng.uniform(0.2, 1.0) * (n + 1)
        # Row 0's source has 14 tokens: GNMT's slope at 15 tokens is what the engine used to
        # rank by, and that dropped the empty translation.
        source = " ".join(words[:14]) if row == 0 else f"{words[row % len(words)]} {row}"
        finished[source] = [([*h, eos], lp) for h, lp in hyps.items()]
    engine = _CappedEngine(finished)
    translator.engine = engine
    found = translator._search_group([source.split() for source in finished], limit)
    got = [[[*(tokenizer.piece(i) for i in h.tokens), eos] for h in hyps] for hyps in found]

    def gnmt(n: int) -> float:
        return gnmt_length_penalty(n, alpha)

    low, high = ranking_penalties(alpha, limit + 1)
    assert engine.calls[0][0] == pytest.approx(low) and len(engine.calls) <= 2
    assert all(penalty == pytest.approx(high) for penalty, _ in engine.calls[1:])
    redone = {source for _, sources in engine.calls[1:] for source in sources}
    assert got[0][0] == [eos]  # the empty translation, which GNMT's slope at 15 tokens drops
    for (source, hyps), mine in zip(finished.items(), got, strict=True):
        best = [h for h, _ in _top(hyps, 2, gnmt)]
        assert mine[:2] == best[: len(mine[:2])]
        returned = _top(hyps, k, lambda n: n**low)
        if source in redone:
            returned += [h for h in _top(hyps, k, lambda n: n**high) if h not in returned]
        assert mine == [h for h, _ in _top(returned, nbest, gnmt)]
    if nbest == 1:  # a dropped hypothesis seldom could be the best
        assert len(redone) < 30
    else:
        assert len(redone) == len(finished)


@pytest.mark.parametrize(
    "setting", ["encoder_attention=local", "decoder_attention=lsh", "cross_attention=linformer"]
)
def test_export_refuses_attention_patterns(setting: str) -> None:
    config = load_config(overrides=["preset=tiny", f"model.{setting}", "train.valid_bleu=false"])
    with pytest.raises(UserError, match=f"full attention only, not model.{setting.split('=')[0]}"):
        ct2_module._check_exportable(Transformer(config.model))


def test_an_rnn_model_object_is_refused_in_one_line(tokenizer: Tokenizer, tmp_path: Path) -> None:
    from aiayn.model.families import build_model

    config = load_config(overrides=["preset=rnnsearch", "model.vocab_size=40"])
    rnn = build_model(config.model)
    with pytest.raises(
        UserError, match="object does not export to CTranslate2: only a translation"
    ):
        export_ct2(rnn, tmp_path / "out", tokenizer=tokenizer)  # type: ignore[arg-type]
