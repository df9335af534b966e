"""``aiayn serve --engine ctranslate2``: the served translations equal ``aiayn translate
--engine ctranslate2``'s for the same settings, batched requests included; ``/v1/model``
names the engine and its compute type; ``/v1/attention`` is a 501 JSON error; the command
refuses what the engine does not take, as translate does. Skipped without CTranslate2."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip(
    "ctranslate2", reason="CTranslate2 is not installed (pip install 'aiayn[interop]')"
)

from aiayn.cli import main
from aiayn.interop.ct2_translator import Ct2Translator
from aiayn.serving.app import create_app
from aiayn.serving.engine import AttentionUnavailable, DecodeKey, Engine
from aiayn.serving.settings import ServeSettings
from tests.serving.conftest import ServerProcess, served
from tests.serving.test_api import assert_error

pytestmark = pytest.mark.usefixtures("single_thread")

TEXTS = ["alpha bravo charlie", "", "delta echo foxtrot golf hotel", "india", "juliet kilo"]


@pytest.fixture(scope="module")
def ct2_engine(reverse_checkpoint: Path) -> Engine:
    """The engine of ``serve --engine ctranslate2 --threads 1`` (the export is cached beside
    the checkpoint)."""
    translator, config = Ct2Translator.from_checkpoint(reverse_checkpoint, threads=1)
    return Engine(translator, config, source=str(reverse_checkpoint), threads=1)


def translate_command(
    capsys: pytest.CaptureFixture[str], checkpoint: Path, source: Path, *options: str
) -> list[str]:
    """The lines ``aiayn translate --engine ctranslate2`` prints."""
    capsys.readouterr()
    args = ["translate", str(checkpoint), "-i", str(source), "--engine", "ctranslate2"]
    assert main([*args, "--threads", "1", "--device", "cpu", *options]) == 0
    return capsys.readouterr().out.splitlines()


def command_rows(lines: list[str], nbest: int) -> list[list[tuple[str, float | None]]]:
    """The command's output per input line: (text, score) of each hypothesis (score None
    where the command prints none)."""
    if nbest == 1:
        return [[(line, None)] for line in lines]
    rows = [line.split("\t") for line in lines]
    return [
        [(text, float(score)) for _, score, text in rows[i : i + nbest]]
        for i in range(0, len(rows), nbest)
    ]


def served_rows(answer: dict, nbest: int) -> list[list[tuple[str, float | None]]]:
    """The same from an answer of ``/v1/translate``, padded as the command pads."""
    rows = []
    for item in answer["translations"]:
        if nbest == 1:
            rows.append([(item["text"], None)])
            continue
        hyps = [(h["text"], h["score"]) for h in item["hypotheses"]]
        filler = 0.0 if not hyps else float("-inf")
        rows.append(hyps + [("", filler)] * (nbest - len(hyps)))
    return rows


def assert_same_rows(served: list, printed: list) -> None:
    assert [[text for text, _ in row] for row in served] == [
        [text for text, _ in row] for row in printed
    ]
    for ours, theirs in zip(served, printed, strict=True):
        for (_, a), (_, b) in zip(ours, theirs, strict=True):
            if b is not None:
                assert a == pytest.approx(b, abs=1.5e-4)


def test_served_translations_equal_the_translate_command(
    ct2_engine: Engine,
    reverse_checkpoint: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Requests with three settings sent at once (each setting twice: those share a batch),
    against ``aiayn translate --engine ctranslate2`` with the same settings."""
    source = tmp_path / "source.txt"
    source.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    settings = [{}, {"beam": 1}, {"beam": 3, "alpha": 0.8, "nbest": 2}]
    bodies = [{"text": TEXTS, **s} for s in settings for _ in range(2)]

    async def scenario() -> tuple[list[httpx.Response], dict]:
        app = create_app(ct2_engine, ServeSettings(max_wait_ms=400))
        async with served(app) as client:
            answers = await asyncio.gather(*(client.post("/v1/translate", json=b) for b in bodies))
            return list(answers), (await client.get("/v1/health")).json()

    answers, health = asyncio.run(scenario())
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert health["requests"] == 6 and health["batches"] == 3  # one per setting
    assert health["largest_batch_requests"] == 2
    default = ct2_engine.default_key
    assert (answers[0].json()["beam"], answers[0].json()["alpha"]) == (default.beam, default.alpha)
    for i, options in enumerate(
        [[], ["--beam", "1"], ["--beam", "3", "--alpha", "0.8", "--nbest", "2"]]
    ):
        nbest = settings[i].get("nbest", 1)
        printed = command_rows(
            translate_command(capsys, reverse_checkpoint, source, *options), nbest
        )
        for answer in answers[2 * i : 2 * i + 2]:
            assert_same_rows(served_rows(answer.json(), nbest), printed)
    assert answers[4].json()["translations"][0]["hypotheses"][1]["text"]  # an n-best list


def test_model_description_and_no_attention(ct2_engine: Engine, engine: Engine) -> None:
    async def scenario() -> tuple[dict, httpx.Response, dict]:
        async with served(create_app(ct2_engine, ServeSettings())) as client:
            model = (await client.get("/v1/model")).json()
            refused = await client.post("/v1/attention", json={"text": "alpha bravo"})
            schema = (await client.get("/openapi.json")).json()
            return model, refused, schema

    model, refused, schema = asyncio.run(scenario())
    assert (model["engine"], model["compute_type"], model["device"]) == (
        "ctranslate2",
        "float32",
        "cpu",
    )
    assert model["attention"] is False and model["threads"] == 1
    assert model["parameters"] == engine.parameters  # the PyTorch model's count, unloaded
    assert model["config"] == engine.describe()["config"]
    assert model["decode"]["beam_rule"] == "fairseq"  # CTranslate2's rule
    body = assert_error(refused, 501, "engine", "unavailable")
    assert "attention maps need --engine torch" in body["error"]["message"]
    assert "501" in schema["paths"]["/v1/attention"]["post"]["responses"]
    with pytest.raises(AttentionUnavailable, match="PyTorch model"):
        ct2_engine.cross_attention(DecodeKey(1, 0.6, 1), [5, 6])
    torch_model = engine.describe()
    assert (torch_model["engine"], torch_model["attention"]) == ("torch", True)


def test_int8_weights(reverse_checkpoint: Path) -> None:
    translator, config = Ct2Translator.from_checkpoint(
        reverse_checkpoint, quantize="int8", threads=1
    )
    engine = Engine(translator, config, source=str(reverse_checkpoint))
    assert engine.describe()["compute_type"] == "int8_float32"
    [hyps] = engine.translate(DecodeKey(2, 0.6, 2), [engine.encode(["alpha bravo"])[0]])
    assert len(hyps) == 2 and hyps[0].score >= hyps[1].score


def test_serve_refuses_what_the_engine_does_not_take(
    reverse_checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["serve", str(reverse_checkpoint), "--port", "0", "--engine", "ctranslate2"]
    for extra, message in (
        (["--pack-weights"], "--pack-weights is an option of --engine torch"),
        (["--compiled-step"], "--compiled-step is an option of --engine torch"),
        (["--no-mmap"], "--no-mmap is an option of --engine torch"),
        (["--device", "tpu"], "unknown device 'tpu' for CTranslate2"),
        (["--threads", "0"], "--threads must be at least 1"),
    ):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) == 1, err
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 fails
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "pip install 'aiayn[interop]'" in err and len(err.splitlines()) == 1, err


def test_the_serve_command(
    reverse_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``aiayn serve --engine ctranslate2`` in its own process answers what ``aiayn
    translate --engine ctranslate2`` prints."""
    source = tmp_path / "source.txt"
    source.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    printed = translate_command(capsys, reverse_checkpoint, source, "--beam", "2")
    server = ServerProcess(reverse_checkpoint, "--engine", "ctranslate2", "--beam", "2")
    try:
        server.wait_ready()
        status, answer = server.post("/v1/translate", {"text": TEXTS})
        model = server.get("/v1/model")
        refused, error = server.post("/v1/attention", {"text": "alpha"})
    finally:
        server.stop()
    assert status == 200 and [t["text"] for t in answer["translations"]] == printed
    assert (model["engine"], model["decode"]["beam_size"]) == ("ctranslate2", 2)
    assert refused == 501 and error["error"]["field"] == "engine"
    assert server.proc.returncode == 0
    assert "on cpu (CTranslate2, float32)" in server.stderr
