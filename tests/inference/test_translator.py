"""The translator: batch invariance, cached decoding against a no-cache reference decoder, and
line-for-line output with empty and over-long lines."""

from __future__ import annotations

import copy
import io
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.cli import main
from aiayn.config import DecodeConfig, load_config, replace
from aiayn.data.collate import BOS_ID, EOS_ID, PAD_ID, collate_pairs
from aiayn.inference.attention_maps import attention_weights
from aiayn.inference.search import beam_search, max_output_lengths
from aiayn.inference.translator import Translator
from aiayn.model.transformer import Transformer

LETTERS = "abcdefghijklmnopqrstuvwxyz "


class CharTokenizer:
    """One id per letter or space (ids 4..30); anything else is UNK."""

    def encode(self, text: str) -> list[int]:
        return [4 + LETTERS.index(c) if c in LETTERS else 1 for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(LETTERS[i - 4] if 4 <= i < 4 + len(LETTERS) else "" for i in ids)


def tiny_model(max_positions: int = 256) -> Transformer:
    config = load_config(
        overrides=["preset=tiny", "model.dropout=0", f"model.max_positions={max_positions}"]
    )
    return Transformer(config.model)


def random_words(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice(LETTERS[:8]) for _ in range(rng.randint(low, high)))


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread (and the test machine is shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def copy_model() -> Transformer:
    """A tiny model trained for a few dozen steps to copy its input: it ends sentences with
    EOS at various lengths, unlike random weights."""
    torch.manual_seed(0)
    rng = random.Random(0)
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3, betas=(0.9, 0.98))
    tok = CharTokenizer()
    model.train()
    for _ in range(80):
        src = [tok.encode(random_words(rng, 1, 6)) for _ in range(32)]
        batch = collate_pairs(src, src)
        logits = model(batch.src_ids, batch.src_pad, batch.tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def sentences(n: int, seed: int, longest: int = 14) -> list[str]:
    rng = random.Random(seed)
    return [random_words(rng, 1, longest) for _ in range(n)]


# -- batch invariance --------------------------------------------------------------------------


@pytest.mark.parametrize("beam", [1, 4])
def test_batch_invariance(copy_model: Transformer, beam: int) -> None:
    decode = DecodeConfig(beam_size=beam, max_len_b=6, batch_tokens=120)
    translator = Translator(copy_model, CharTokenizer(), decode, nbest=beam)
    lines = sentences(64, seed=1)
    together = translator.translate_nbest(lines)
    for line, hyps in zip(lines, together, strict=True):
        alone = translator.translate_nbest([line])[0]
        assert [h.tokens for h in alone] == [h.tokens for h in hyps]
        assert [h.score for h in alone] == pytest.approx([h.score for h in hyps], abs=1e-4)


def test_batch_invariance_random_weights() -> None:
    """Random weights give flat distributions: a hard case for batch invariance."""
    torch.manual_seed(1)
    translator = Translator(
        tiny_model(), CharTokenizer(), DecodeConfig(beam_size=3, max_len_b=4, batch_tokens=60)
    )
    lines = sentences(64, seed=2)
    together = translator.translate(lines)
    assert [translator.translate([line])[0] for line in lines] == together
    for call in (translator.translate, translator.translate_nbest):  # not a line per letter
        with pytest.raises(TypeError, match=r"takes a list of lines, not one string"):
            call(lines[0])
        with pytest.raises(TypeError, match=r"line 2 is bytes, not str"):
            call([lines[0], lines[1].encode()])
        with pytest.raises(TypeError, match=r"takes a list of lines, not bytes"):
            call(lines[0].encode())
    assert translator.translate(line for line in lines) == together  # an iterator, read once


def test_search_never_outputs_pad_or_bos() -> None:
    """The batched search of ``aiayn translate`` and validation BLEU bans PAD and BOS: random
    weights over 12 ids choose them often, which the unbanned search shows."""
    from aiayn.inference.search import greedy_search
    from aiayn.inference.translator import search_batch

    sources = [[4 + (i * 7 + j) % 8 for j in range(1 + i % 5)] for i in range(6)]
    batch = collate_pairs(sources)
    unbanned_special = 0
    for seed in range(8):
        torch.manual_seed(seed)
        config = load_config(overrides=["preset=tiny", "model.dropout=0", "model.vocab_size=12"])
        model = Transformer(config.model).eval()
        for beam in (1, 2):
            decode = DecodeConfig(beam_size=beam, max_len_a=1.0, max_len_b=5)
            with torch.inference_mode():
                found = search_batch(model, batch.src_ids, batch.src_pad, decode)
            assert not any(t in (PAD_ID, BOS_ID) for hyps in found for t in hyps[0].tokens)
        with torch.inference_mode():
            memory = model.encode(batch.src_ids, batch.src_pad)
            cache = model.init_cache(memory, batch.src_pad, 12)
            raw = greedy_search(model.log_probs_step, cache, len(sources), max_len=11)
        unbanned_special += sum(t in (PAD_ID, BOS_ID) for h in raw for t in h.tokens)
    assert unbanned_special > 0


# -- the KV cache against a decoder that re-runs the whole prefix ------------------------------


class PrefixState:
    """A no-cache decoder state: the source rows and the output prefix so far."""

    def __init__(self, src_ids: Tensor, src_pad: Tensor) -> None:
        self.src_ids, self.src_pad = src_ids, src_pad
        self.prefix = torch.zeros(src_ids.size(0), 0, dtype=torch.long)

    def reorder(self, rows: Tensor) -> None:
        self.src_ids, self.src_pad, self.prefix = (
            self.src_ids[rows],
            self.src_pad[rows],
            self.prefix[rows],
        )

    def keep(self, rows: Tensor) -> None:
        self.reorder(rows)


def reference_translate(
    model: Transformer, sources: list[list[int]], decode: DecodeConfig, nbest: int
) -> list[list[tuple[list[int], float]]]:
    """Beam search whose step runs ``model.forward`` on the full prefix, one sentence at a time."""
    out = []
    k = decode.beam_size
    for src in sources:
        batch = collate_pairs([src])
        state = PrefixState(batch.src_ids.repeat(k, 1), batch.src_pad.repeat(k, 1))

        def step(tokens: Tensor, state: PrefixState) -> Tensor:
            state.prefix = torch.cat([state.prefix, tokens[:, None]], dim=1)
            logits = model(state.src_ids, state.src_pad, state.prefix)[:, -1]  # (rows, V)
            log_probs = F.log_softmax(logits.float(), dim=-1)
            log_probs[:, [PAD_ID, BOS_ID]] = float("-inf")
            return log_probs

        limit = max_output_lengths(torch.tensor([len(src)]), decode.max_len_a, decode.max_len_b)
        with torch.no_grad():
            [hyps] = beam_search(
                step,
                state,
                1,
                beam_size=k,
                alpha=decode.alpha,
                max_len=limit,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                nbest=nbest,
            )
        out.append([(h.tokens, h.score) for h in hyps])
    return out


def test_cached_decoding_equals_full_prefix_decoding(copy_model: Transformer) -> None:
    decode = DecodeConfig(beam_size=3, alpha=0.6, max_len_b=5, batch_tokens=200)
    tok = CharTokenizer()
    lines = sentences(12, seed=3)
    sources = [tok.encode(line) for line in lines]
    translator = Translator(copy_model, tok, decode, nbest=3)
    cached = translator.search_ids(sources)
    expected = reference_translate(copy_model, sources, decode, nbest=3)
    lengths = set()
    for hyps, ref in zip(cached, expected, strict=True):
        assert [h.tokens for h in hyps] == [y for y, _ in ref]
        assert [h.score for h in hyps] == pytest.approx([s for _, s in ref], abs=1e-4)
        lengths.add(len(hyps[0].tokens))
    # The trained model stops at different lengths, so sentences leave the batch at different
    # steps (cache.keep is exercised), and not all at the maximum length.
    assert len(lengths) > 3


def test_copy_model_copies(copy_model: Transformer) -> None:
    """Sanity check of the fixture: it has learnt something (random weights copy none)."""
    translator = Translator(copy_model, CharTokenizer(), DecodeConfig(beam_size=4))
    lines = sentences(20, seed=4, longest=5)
    outputs = translator.translate(lines)
    assert sum(o == line for o, line in zip(outputs, lines, strict=True)) >= 5


# -- line handling -----------------------------------------------------------------------------


def test_lines_in_equal_lines_out_with_empty_and_overlong_lines() -> None:
    torch.manual_seed(2)
    warnings: list[str] = []
    decode = DecodeConfig(beam_size=2, max_len_b=3, batch_tokens=64)
    translator = Translator(
        tiny_model(max_positions=32), CharTokenizer(), decode, warn=warnings.append
    )
    lines = ["abc", "", "   ", "x" * 100, "hello world", "", "y" * 31, "z" * 32]
    outputs = translator.translate(lines, first_line=10)
    assert len(outputs) == len(lines)
    assert outputs[1] == outputs[2] == outputs[5] == ""
    # 100 and 32 tokens (+ EOS) exceed 32 positions: lines 13 and 17, cut to 31 tokens;
    # 31 tokens + EOS fit exactly.
    assert len(warnings) == 2
    assert warnings[0].startswith("line 13: 100 tokens") and "first 31" in warnings[0]
    assert warnings[1].startswith("line 17: 32 tokens")
    # Outputs stop at max_positions - 1 = 31 tokens (a * 31 + b = 34 would not fit).
    assert all(len(o) <= 31 for o in outputs)
    nbest = Translator(translator.model, CharTokenizer(), decode, nbest=2, warn=warnings.append)
    results = nbest.translate_nbest(lines)
    assert [len(r) for r in results] == [2, 0, 0, 2, 2, 0, 2, 2]
    assert all(r[0].score >= r[1].score for r in results if r)


def test_bad_settings() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="nbest"):
        Translator(model, CharTokenizer(), DecodeConfig(beam_size=2), nbest=3)
    with pytest.raises(ValueError, match="beam"):
        Translator(model, CharTokenizer(), replace(DecodeConfig(), beam_size=0))
    for alpha in (-0.5, float("nan")):  # as the server's requests: 0 or more
        with pytest.raises(ValueError, match="alpha"):
            Translator(model, CharTokenizer(), replace(DecodeConfig(), alpha=alpha))


def test_a_limit_that_leaves_short_sources_no_output_token_is_told() -> None:
    model = tiny_model()
    for a, b in ((1.0, 0), (0.5, 1), (2.0, 0)):  # every source of a token or more gets one
        warnings: list[str] = []
        decode = DecodeConfig(max_len_a=a, max_len_b=b)
        Translator(model, CharTokenizer(), decode, warn=warnings.append)
        assert warnings == []
    for a, shortest in ((0.5, 2), (0.1, 10), (0.3, 4), (0.01, 100)):
        warnings = []
        decode = DecodeConfig(beam_size=2, max_len_a=a, max_len_b=0, batch_tokens=64)
        translator = Translator(model, CharTokenizer(), decode, warn=warnings.append)
        assert len(warnings) == 1 and f"fewer than {shortest} tokens" in warnings[0]
        limits = max_output_lengths(torch.tensor([shortest - 1, shortest]), a, 0)
        assert limits.tolist()[0] == 0 and limits.tolist()[1] >= 1
        hypotheses = translator.translate_nbest(["x" * (shortest - 1)])[0]
        assert all(h.tokens == [] for h in hypotheses)


@pytest.mark.parametrize("beam", [1, 4])
def test_bf16_precision_translates_as_fp32(copy_model: Transformer, beam: int) -> None:
    """precision="bf16" converts the model and decodes with bfloat16 products and float32
    scores: on the copy model it finds the fp32 translation for most lines, with the score
    within bfloat16's rounding. (The tiny model is barely trained: its best hypotheses score
    -3 to -5, and bfloat16's rounding of its small matrices flips 1-4 of 48 near ties.)"""
    decode = DecodeConfig(beam_size=beam, max_len_b=6, batch_tokens=120)
    lines = sentences(48, seed=4, longest=6)
    reference = Translator(copy_model, CharTokenizer(), decode).translate_nbest(lines)
    model = copy.deepcopy(copy_model)
    translator = Translator(model, CharTokenizer(), decode, precision="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    results = translator.translate_nbest(lines)
    same = [(r[0], f[0]) for r, f in zip(results, reference, strict=True) if r[0].text == f[0].text]
    assert len(same) >= 40
    assert [r.score for r, _ in same] == pytest.approx([f.score for _, f in same], abs=0.15)


def test_precision_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiayn.inference.translator as translator_module

    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        Translator(tiny_model(), CharTokenizer(), precision="fp8")
    with pytest.raises(ValueError, match="fp16 decoding needs a CUDA device"):
        Translator(tiny_model(), CharTokenizer(), precision="fp16")
    warnings: list[str] = []
    monkeypatch.setattr(translator_module, "cpu_has_bfloat16", lambda: False)
    model = tiny_model()
    Translator(model, CharTokenizer(), precision="bf16", warn=warnings.append)
    assert len(warnings) == 1 and "without bfloat16 instructions" in warnings[0]
    assert model.out_proj.weight.dtype == torch.bfloat16
    fp32 = tiny_model()
    Translator(fp32, CharTokenizer(), precision="fp32", warn=warnings.append)
    assert len(warnings) == 1 and fp32.out_proj.weight.dtype == torch.float32


def test_a_cpu_translator_accelerates_its_model_for_decoding() -> None:
    """On the CPU the model is accelerated for decoding (aiayn.accel), the malloc setting
    included where glibc is and the caller asks for it (process_settings); elsewhere (here the
    meta device) it is left as it is."""

    from aiayn.accel import memory

    translator = Translator(tiny_model(), CharTokenizer())
    assert translator.acceleration is not None and translator.acceleration.mode == "decode"
    assert "malloc thresholds" not in translator.acceleration.levers
    translator.acceleration.undo()
    translator = Translator(tiny_model(), CharTokenizer(), process_settings=True)
    assert translator.acceleration is not None
    # where the malloc setting applies: glibc, and not AIAYN_MALLOC=system
    if memory._mallopt() is not None:
        assert "malloc thresholds" in translator.acceleration.levers
    translator.acceleration.undo()
    elsewhere = Translator(tiny_model().to("meta"), CharTokenizer())
    assert elsewhere.acceleration is not None and elsewhere.acceleration.levers == []


# -- the command line --------------------------------------------------------------------------


@pytest.fixture
def fake_checkpoint(monkeypatch: pytest.MonkeyPatch, copy_model: Transformer) -> None:
    """``Translator.from_checkpoint`` answers with the copy model and the letter tokenizer."""

    def load(
        cls: type[Translator],
        path: object,
        *,
        device: str = "cpu",
        decode_overrides: dict | None = None,
        nbest: int = 1,
        warn: object = None,
        pack_weights: bool | None = None,
        precision: str = "fp32",
        compiled_step: bool | None = None,
        mmap: bool = True,
        process_settings: bool = False,
    ) -> tuple[Translator, None]:
        decode = replace(DecodeConfig(max_len_b=5), **(decode_overrides or {}))
        translator = cls(
            copy_model,
            CharTokenizer(),
            decode,
            nbest=nbest,
            device=device,
            pack_weights=pack_weights,
            compiled_step=compiled_step,
            process_settings=process_settings,
        )
        translator.checkpoint = Path(path) / "averaged.pt"
        return translator, None

    monkeypatch.setattr(Translator, "from_checkpoint", classmethod(load))


def test_translate_command(
    fake_checkpoint: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = tmp_path / "src.txt"
    source.write_text("abc\n\ndeed\r\nfa\n", encoding="utf-8")
    assert main(["translate", "run", "--input", str(source), "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    out = captured.out.split("\n")
    assert out[-1] == "" and len(out[:-1]) == 4 and out[1] == ""
    assert (
        "translated 4 lines in" in captured.err and "lines/s) with run/averaged.pt" in captured.err
    )

    assert main(["translate", "run", "-i", str(source), "--beam", "3", "--nbest", "2"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows] == ["1", "2"] * 4
    assert rows[2] == ["1", "0.0000", ""] and rows[3] == ["2", "0.0000", ""]
    assert float(rows[0][1]) >= float(rows[1][1])

    assert main(["translate", "run", "-i", str(source), "--beam", "2", "--nbest", "3"]) == 2
    assert "nbest" in capsys.readouterr().err

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["translate", "run", "--input", str(source), "--batch-tokens", "3"]) == 0
    shown = terminal.getvalue()
    # The first batch is drawn (later ones at most every 0.1 s), then the summary replaces it.
    assert shown.startswith("translating: 1/4 lines (25%)") and " left\r\033[Ktranslated 4" in shown


def test_the_beam_rule_reaches_the_search(
    fake_checkpoint: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import aiayn.inference.translator as translator_module

    rules: list[str] = []
    real = translator_module.beam_search

    def spy(*args: object, **kwargs: object) -> object:
        rules.append(str(kwargs["rule"]))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(translator_module, "beam_search", spy)
    source = tmp_path / "src.txt"
    source.write_text("abc\ndeed\n", encoding="utf-8")
    assert main(["translate", "run", "-i", str(source), "--beam", "2"]) == 0
    assert rules and set(rules) == {"paper"}  # decode.beam_rule's default
    rules.clear()
    assert (
        main(["translate", "run", "-i", str(source), "--beam", "2", "--beam-rule", "fairseq"]) == 0
    )
    assert rules and set(rules) == {"fairseq"}
    rules.clear()
    sources = [[4, 5, 6], [7, 8]]
    translator = Translator(tiny_model(), CharTokenizer(), DecodeConfig(beam_size=2, max_len_b=4))
    translator.decode = replace(translator.decode, beam_rule="fairseq")
    translator.search_ids(sources)
    assert set(rules) == {"fairseq"}
    capsys.readouterr()


def test_translate_command_stdin_and_bad_utf8(
    fake_checkpoint: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ab\ncd")))
    assert main(["translate", "run", "--beam", "1"]) == 0
    from_stdin = capsys.readouterr().out
    assert len(from_stdin.splitlines()) == 2
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ab\ncd")))
    assert main(["translate", "run", "--beam", "1", "-i", "-"]) == 0  # - is stdin too
    assert capsys.readouterr().out == from_stdin
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ab\n\xc3\x28\n")))
    assert main(["translate", "run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "stdin: line 2 is not valid UTF-8" in captured.err


def test_end_to_end_with_a_real_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A sentencepiece tokenizer and a checkpoint written as training writes them."""
    tokenizer_module = pytest.importorskip("aiayn.data.tokenizer")
    from aiayn.training.checkpoint import bytes_to_tensor, model_checkpoint, save_atomic

    text = tmp_path / "text.txt"
    rng = random.Random(5)
    text.write_text("\n".join(random_words(rng, 3, 30) for _ in range(300)), encoding="utf-8")
    tokenizer = tokenizer_module.train_tokenizer([text], 40, tmp_path / "spm", "char")
    config = load_config(overrides=["preset=tiny", f"model.vocab_size={tokenizer.vocab_size}"])
    torch.manual_seed(3)
    model = Transformer(config.model)
    weights = bytes_to_tensor(tokenizer.to_bytes())
    save_atomic(model_checkpoint(config, model.state_dict(), weights, 0, 0), tmp_path / "m.pt")
    source = tmp_path / "src.txt"
    source.write_text("abc de\n\n" + "ab" * 200 + "\n", encoding="utf-8")
    args = ["translate", str(tmp_path / "m.pt"), "-i", str(source), "--max-len-b", "3"]
    assert main([*args, "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 3
    assert "line 3: " in captured.err and "exceed the model's 256 positions" in captured.err
    assert main([*args, "--device", "cpu", "--pack-weights"]) == 0
    assert capsys.readouterr().out == captured.out  # the same translations
    assert main([*args, "--device", "cpu", "--no-pack-weights"]) == 0
    assert capsys.readouterr().out == captured.out
    assert main([*args, "--device", "cpu", "--precision", "bf16"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    # int8 is CTranslate2's (tests/serving/test_int8.py): not the PyTorch engine's.
    assert main([*args, "--device", "cpu", "--engine", "torch", "--quantize", "int8"]) == 2
    assert "leave out --engine torch" in capsys.readouterr().err
    assert main([*args, "--device", "cpu", "--precision", "fp16"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err

    out_dir = tmp_path / "maps"
    argv = ["attention", str(tmp_path / "m.pt"), "abc de", "--out", str(out_dir), "--beam", "2"]
    assert main([*argv, "--device", "cpu"]) == 0
    names = sorted(p.name for p in out_dir.iterdir())
    n = config.model.n_layers
    assert len(names) == 3 * n and "cross_layer1.png" in names
    assert (out_dir / "encoder_layer1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_attention_weights_shapes_and_causality(copy_model: Transformer) -> None:
    src, out = [4, 5, 6, 7, 8], [4, 5, 6]
    encoder, decoder, cross = attention_weights(copy_model, src, out)
    n_layers, heads = len(copy_model.decoder.layers), copy_model.config.n_heads
    assert len(encoder) == len(decoder) == len(cross) == n_layers
    assert encoder[0].shape == (heads, 6, 6)  # source + EOS
    assert decoder[0].shape == (heads, 4, 4)  # BOS + output
    assert cross[0].shape == (heads, 4, 6)
    for weights in (*encoder, *decoder, *cross):
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    for weights in decoder:
        assert torch.all(weights.triu(1) == 0)


class TerminalInput(io.TextIOWrapper):
    def isatty(self) -> bool:
        return True


def test_translate_command_interactive(
    fake_checkpoint: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", TerminalInput(io.BytesIO(b"abc\n\xff\n\nba\n")))
    assert main(["translate", "run", "--beam", "2"]) == 0
    captured = capsys.readouterr()
    out = captured.out.split("\n")
    assert len(out) == 5 and out[1] == out[2] == "" and out[4] == ""
    assert "stdin: line 2 is not valid UTF-8" in captured.err


def test_inference_on_cuda_leaves_cudnn_attention_out() -> None:
    """cuDNN's attention builds a plan per new shape: decoding on CUDA does without it."""
    from aiayn.devices import inference_attention

    was = torch.backends.cuda.cudnn_sdp_enabled()
    with inference_attention("cuda:0"):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == was
    with inference_attention("cpu"):
        assert torch.backends.cuda.cudnn_sdp_enabled() == was
