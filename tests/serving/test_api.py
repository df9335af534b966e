"""The HTTP API through an in-process client: every endpoint, dynamic batching, every limit
and every kind of bad input (each a 4xx JSON error naming the field, never a 500)."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import torch

from aiayn.inference.attention_maps import attention_weights
from aiayn.inference.translator import Translator
from aiayn.model.transformer import count_parameters
from aiayn.serving.engine import Engine
from tests.serving.conftest import GatedEngine, sentence, served

pytestmark = pytest.mark.usefixtures("single_thread")


def reference(checkpoint: Path, texts: list[str], beam: int, alpha: float, nbest: int) -> list:
    """What ``aiayn translate`` gives for ``texts``, one text at a time."""
    translator, _ = Translator.from_checkpoint(
        checkpoint, decode_overrides={"beam_size": beam, "alpha": alpha}, nbest=nbest
    )
    return [translator.translate_nbest([text])[0] for text in texts]


def assert_same(answer: dict, expected: list) -> None:
    """The server decodes the texts as one padded batch, the reference one at a time: the
    words are the same and the scores equal up to float rounding."""
    close = partial(pytest.approx, abs=1e-5)
    assert len(answer["translations"]) == len(expected)
    for got, hyps in zip(answer["translations"], expected, strict=True):
        assert [h["text"] for h in got["hypotheses"]] == [h.text for h in hyps]
        assert [h["score"] for h in got["hypotheses"]] == close([h.score for h in hyps])
        assert [h["log_prob"] for h in got["hypotheses"]] == close([h.log_prob for h in hyps])
        assert got["text"] == (hyps[0].text if hyps else "")
        assert got["score"] == (close(hyps[0].score) if hyps else None)


def assert_error(response: httpx.Response, status: int, field: str, kind: str | set | None = None):
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["error"] == body["errors"][0]
    assert body["error"]["field"] == field, body
    assert body["error"]["message"]
    if kind is not None:
        assert body["error"]["type"] in ({kind} if isinstance(kind, str) else kind), body
    return body


# -- endpoints ---------------------------------------------------------------------------------


def test_health_model_page_and_schema(make_app, engine: Engine):
    async def scenario() -> None:
        async with served(make_app(max_texts=8, max_queue=100)) as client:
            health = await client.get("/v1/health")
            assert health.status_code == 200
            assert health.json()["status"] == "ok" and health.json()["queue_texts"] == 0

            model = (await client.get("/v1/model")).json()
            config = engine.config.model
            assert model["vocab_size"] == config.vocab_size == 13
            assert model["parameters"] == count_parameters(engine.translator.model)
            assert model["config"]["n_layers"] == config.n_layers
            assert model["config"]["d_model"] == config.d_model
            assert model["decode"]["beam_size"] == engine.config.decode.beam_size
            assert model["decode"]["alpha"] == engine.config.decode.alpha
            assert model["max_source_tokens"] == config.max_positions - 1
            assert model["limits"]["max_texts"] == 8 and model["limits"]["max_queue"] == 100
            assert model["limits"]["batch_tokens"] == engine.config.decode.batch_tokens
            assert (model["engine"], model["attention"], model["device"]) == ("torch", True, "cpu")
            assert model["weights_dtype"] == ["float32"] and model["threads"] == 1

            page = await client.get("/")
            assert page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            assert "default-src 'none'" in page.headers["content-security-policy"]
            html = page.text
            assert 'id="translate"' in html and 'id="heatmap"' in html
            # Nothing loaded from elsewhere: the only URL is the SVG namespace.
            assert set(re.findall(r"https?://[^\s\"'<>)]+", html)) == {"http://www.w3.org/2000/svg"}
            assert re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)""", html) == ["data:,"]

            schema = (await client.get("/openapi.json")).json()
            assert {"/v1/translate", "/v1/attention", "/v1/health", "/v1/model"} <= set(
                schema["paths"]
            )
            body = schema["paths"]["/v1/translate"]["post"]["requestBody"]
            properties = body["content"]["application/json"]["schema"]["properties"]
            assert set(properties) == {"text", "beam", "alpha", "nbest"} | {
                "constraints",
                "target_prefix",
                "word_scores",
            }

    asyncio.run(scenario())


def test_translate_gives_what_the_translator_gives(make_app, reverse_checkpoint: Path):
    texts = ["alpha bravo charlie", "", "delta echo foxtrot golf hotel", "   ", "india"]

    async def scenario() -> tuple[dict, dict]:
        async with served(make_app()) as client:
            ask = {"text": texts, "beam": 3, "alpha": 0.8, "nbest": 2}
            nbest = await client.post("/v1/translate", json=ask)
            default = await client.post("/v1/translate", json={"text": texts})
            assert nbest.status_code == default.status_code == 200
            return nbest.json(), default.json()

    nbest, default = asyncio.run(scenario())
    assert (nbest["beam"], nbest["alpha"], nbest["nbest"]) == (3, 0.8, 2)
    assert_same(nbest, reference(reverse_checkpoint, texts, 3, 0.8, 2))
    assert [len(t["hypotheses"]) for t in nbest["translations"]] == [2, 0, 2, 0, 2]
    assert nbest["translations"][1] == {
        "text": "",
        "score": None,
        "log_prob": None,
        "hypotheses": [],
    }
    assert (default["beam"], default["alpha"], default["nbest"]) == (4, 0.6, 1)
    assert_same(default, reference(reverse_checkpoint, texts, 4, 0.6, 1))
    # The model learned something: most reversals of the three sentences are right.
    right = [
        t["text"] == " ".join(reversed(s.split()))
        for s, t in zip(texts, default["translations"], strict=True)
        if s.strip()
    ]
    assert len(right) == 3 and sum(right) >= 2


# -- batching ----------------------------------------------------------------------------------


def concurrent_texts(n: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [[sentence(rng) for _ in range(rng.randint(1, 3))] for _ in range(n)]


async def post_all(client: httpx.AsyncClient, bodies: list[dict]) -> list[httpx.Response]:
    return await asyncio.gather(*(client.post("/v1/translate", json=b) for b in bodies))


@pytest.mark.parametrize("batching", [True, False])
def test_concurrent_requests_are_batched_and_split_back(make_app, reverse_checkpoint, batching):
    requests = concurrent_texts(8, seed=1)

    async def scenario() -> tuple[list[httpx.Response], dict]:
        async with served(make_app(max_wait_ms=400, batching=batching)) as client:
            responses = await post_all(client, [{"text": t, "beam": 2} for t in requests])
            return responses, (await client.get("/v1/health")).json()

    responses, health = asyncio.run(scenario())
    assert health["requests"] == 8 and health["texts"] == sum(map(len, requests))
    if batching:
        assert (health["batches"], health["largest_batch_requests"]) == (1, 8)
    else:
        assert (health["batches"], health["largest_batch_requests"]) == (8, 1)
    for texts, response in zip(requests, responses, strict=True):
        assert response.status_code == 200
        assert_same(response.json(), reference(reverse_checkpoint, texts, 2, 0.6, 1))


def test_token_budget_and_settings_split_batches(make_app):
    """Four-word texts take 5 tokens with EOS: a budget of 12 holds two; a request with
    other settings never joins them."""
    rng = random.Random(3)
    bodies = [{"text": [sentence(rng, 4, 4)], "beam": 2} for _ in range(6)]
    bodies.append({"text": [sentence(rng, 4, 4)], "beam": 1})

    async def scenario() -> tuple[list[httpx.Response], object]:
        app = make_app(max_wait_ms=400, batch_tokens=12)
        async with served(app) as client:
            responses = await post_all(client, bodies)
            return responses, app.state.batcher.stats

    responses, stats = asyncio.run(scenario())
    assert all(r.status_code == 200 for r in responses)
    assert sorted(stats.recent) == [(1, 1), (2, 2), (2, 2), (2, 2)]
    assert [r.json()["beam"] for r in responses] == [2] * 6 + [1]


def test_health_answers_while_a_batch_decodes(engine):
    gated = GatedEngine(engine)
    from aiayn.serving.app import create_app
    from aiayn.serving.settings import ServeSettings

    async def scenario() -> None:
        async with served(create_app(gated, ServeSettings())) as client:
            slow = asyncio.ensure_future(client.post("/v1/translate", json={"text": ["alpha"]}))
            await asyncio.to_thread(gated.started.wait, 10)
            health = await asyncio.wait_for(client.get("/v1/health"), 2)
            assert health.status_code == 200 and health.json()["busy"] is True
            model = await asyncio.wait_for(client.get("/v1/model"), 2)
            assert model.status_code == 200
            assert not slow.done()
            gated.gate.set()
            assert (await slow).status_code == 200

    asyncio.run(scenario())


# -- limits ------------------------------------------------------------------------------------


def gated_app(engine: Engine, **settings):
    from aiayn.serving.app import create_app
    from aiayn.serving.settings import ServeSettings

    gated = GatedEngine(engine)
    return gated, create_app(gated, ServeSettings(**settings))


def test_a_full_queue_is_503_with_retry_after(engine):
    gated, app = gated_app(engine, max_queue=3, max_texts=3, max_wait_ms=0, retry_after_s=2)

    async def scenario() -> None:
        async with served(app) as client:
            first = asyncio.ensure_future(client.post("/v1/translate", json={"text": ["alpha"]}))
            await asyncio.to_thread(gated.started.wait, 10)  # decoding: not in the queue
            queued = asyncio.ensure_future(
                client.post("/v1/translate", json={"text": ["bravo", "charlie"], "beam": 1})
            )
            while app.state.batcher.queued_texts < 2:
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/translate", json={"text": ["delta", "echo"]})
            body = assert_error(refused, 503, "queue", "busy")
            assert refused.headers["retry-after"] == "2"
            assert "3" in body["error"]["message"]
            fits = asyncio.ensure_future(client.post("/v1/translate", json={"text": ["golf"]}))
            while app.state.batcher.queued_texts < 3:
                await asyncio.sleep(0.01)
            gated.gate.set()
            for response in await asyncio.gather(first, queued, fits):
                assert response.status_code == 200
            assert (await client.get("/v1/health")).json()["queue_texts"] == 0

    asyncio.run(scenario())


def test_a_request_past_its_timeout_is_504_and_leaves_the_queue(engine):
    gated, app = gated_app(engine, request_timeout_s=0.3, max_wait_ms=0)

    async def scenario() -> None:
        async with served(app) as client:
            first = asyncio.ensure_future(client.post("/v1/translate", json={"text": ["alpha"]}))
            await asyncio.to_thread(gated.started.wait, 10)
            waiting = await client.post("/v1/translate", json={"text": ["bravo", "charlie"]})
            assert_error(waiting, 504, "request", "timeout")
            assert app.state.batcher.queued_texts == 0
            assert_error(await first, 504, "request", "timeout")  # decoding, not answered
            gated.gate.set()
            after = await client.post("/v1/translate", json={"text": ["delta"], "beam": 1})
            assert after.status_code == 200

    asyncio.run(scenario())


def test_body_size_limit_is_413_declared_or_streamed(make_app):
    body = json.dumps({"text": ["alpha " * 40]}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 16):
            yield body[i : i + 16]

    async def scenario() -> None:
        async with served(make_app(max_body_bytes=100)) as client:
            declared = await client.post("/v1/translate", content=body)
            assert_error(declared, 413, "body", "too_large")
            streamed = await client.post("/v1/translate", content=chunks())  # no length
            assert "content-length" not in streamed.request.headers
            assert_error(streamed, 413, "body", "too_large")
            bad = await client.post(
                "/v1/translate", content=b"{}", headers={"Content-Length": "two"}
            )
            assert_error(bad, 400, "Content-Length", "header")
            fine = await client.post("/v1/translate", json={"text": ["alpha"]})
            assert fine.status_code == 200

    asyncio.run(scenario())


def test_a_body_too_slow_to_arrive_is_408(make_app):
    async def slow() -> AsyncIterator[bytes]:
        yield b'{"text": ["alp'
        await asyncio.sleep(1.0)
        yield b'ha"]}'

    async def scenario() -> None:
        async with served(make_app(body_timeout_s=0.2)) as client:
            assert_error(await client.post("/v1/translate", content=slow()), 408, "body", "timeout")

    asyncio.run(scenario())


LONG = "alpha " * 300  # 300 tokens: more than the tiny model's 255 source positions

BAD_INPUTS = [
    # (body, status, field, type)
    (b"", 400, "body", "empty"),
    (b'{"text": ["caf\xe9"]}', 400, "body", "encoding"),
    (b"\xff\xfe\x00garbage", 400, "body", "encoding"),
    (b'{"text": ["alpha", "bra', 400, "body", "json"),
    (b"text=alpha", 400, "body", "json"),
    (b'{"text": ["alpha"], "alpha": NaN}', 400, "body", "json"),
    (b'{"text": ["alpha"], "alpha": Infinity}', 400, "body", "json"),
    (b"[" * 50_000 + b"]" * 50_000, 400, "body", "json"),
    (b'["alpha"]', 422, "body", "type"),
    (b"null", 422, "body", "type"),
    (b"{}", 422, "text", "missing"),
    (b'{"text": []}', 422, "text", "too_short"),
    (b'{"text": "alpha"}', 422, "text", "list_type"),
    (b'{"text": ["alpha", 7]}', 422, "text[1]", "string_type"),
    (b'{"text": ["alpha", null]}', 422, "text[1]", "string_type"),
    (b'{"text": ["alpha"], "colour": "red"}', 422, "colour", "extra_forbidden"),
    (b'{"text": ["alpha"], "beam": "4"}', 422, "beam", "int_type"),
    (b'{"text": ["alpha"], "beam": true}', 422, "beam", "int_type"),
    (b'{"text": ["alpha"], "beam": 2.5}', 422, "beam", "int_type"),
    (b'{"text": ["alpha"], "beam": 0}', 422, "beam", "greater_than_equal"),
    (b'{"text": ["alpha"], "beam": 17}', 422, "beam", "limit"),
    (b'{"text": ["alpha"], "beam": 99999999999999999999}', 422, "beam", "limit"),
    (b'{"text": ["alpha"], "beam": 2, "nbest": 3}', 422, "nbest", "limit"),
    (b'{"text": ["alpha"], "nbest": 0}', 422, "nbest", "greater_than_equal"),
    (b'{"text": ["alpha"], "alpha": -0.5}', 422, "alpha", "greater_than_equal"),
    (b'{"text": ["alpha"], "alpha": 400}', 422, "alpha", "less_than_equal"),
    (b'{"text": ["alpha"], "alpha": "high"}', 422, "alpha", "float_type"),
    (b'{"text": ["alpha", "\\ud800 bravo"]}', 422, "text[1]", {"encoding", "string_unicode"}),
    (json.dumps({"text": ["alpha", "b" * 201]}).encode(), 422, "text[1]", "too_long"),
    (json.dumps({"text": ["alpha"] * 9}).encode(), 422, "text", "too_many"),
    (json.dumps({"text": ["alpha", LONG[:199]]}).encode(), 200, None, None),
    (json.dumps({"text": [LONG]}).encode(), 422, "text[0]", "too_long"),
]


def test_every_kind_of_bad_input_is_a_4xx_naming_the_field(make_app, engine):
    async def scenario() -> None:
        # max_chars 2000 for the token check (LONG), 200 for the character check
        async with served(make_app(max_texts=8, max_chars=2000, max_body_bytes=200_000)) as wide:
            tokens = await wide.post("/v1/translate", content=json.dumps({"text": ["a", LONG]}))
            body = assert_error(tokens, 422, "text[1]", "too_long")
            assert "300 tokens" in body["error"]["message"]
            assert str(engine.max_source_tokens) in body["error"]["message"]
        async with served(make_app(max_texts=8, max_chars=200)) as client:
            for content, status, field, kind in BAD_INPUTS:
                response = await client.post("/v1/translate", content=content)
                if status == 200:
                    assert response.status_code == 200, response.text
                else:
                    assert_error(response, status, field, kind)
            several = await client.post(
                "/v1/translate", json={"text": ["a", 5, "b" * 300], "beam": "x", "extra": 1}
            )
            fields = [e["field"] for e in several.json()["errors"]]
            assert sorted(fields) == ["beam", "extra", "text[1]"]
            too_long = await client.post(
                "/v1/translate", json={"text": ["b" * 300, "c", "d" * 201]}
            )
            fields = [e["field"] for e in too_long.json()["errors"]]
            assert fields == ["text[0]", "text[2]"]
            # Unknown paths and methods: JSON too.
            assert_error(await client.get("/v1/nothing"), 404, "path", "http")
            assert_error(await client.get("/v1/translate"), 405, "method", "http")
            slash = await client.post("/v1/translate/", json={"text": ["alpha"]})
            assert_error(slash, 404, "path", "http")  # not a redirect that drops the body
            for path in ("/", "/v1/health"):  # health checkers and curl -I probe with HEAD
                head = await client.head(path)
                assert head.status_code == 200, path
            # And the server still translates.
            good = await client.post("/v1/translate", json={"text": ["alpha bravo"]})
            assert good.status_code == 200 and good.json()["translations"][0]["text"]

    asyncio.run(scenario())


def test_an_engine_failure_is_a_500_and_the_server_goes_on(engine):
    from aiayn.serving.app import create_app
    from aiayn.serving.settings import ServeSettings

    class Failing(GatedEngine):
        def translate(self, key, sources, steering=None):
            if any(len(s) == 3 for s in sources):
                raise RuntimeError("broken")
            return super().translate(key, sources, steering)

    failing = Failing(engine)
    failing.gate.set()

    async def scenario() -> None:
        async with served(create_app(failing, ServeSettings())) as client:
            broken = await client.post("/v1/translate", json={"text": ["alpha bravo charlie"]})
            assert_error(broken, 500, "server", "internal")
            fine = await client.post("/v1/translate", json={"text": ["alpha bravo"]})
            assert fine.status_code == 200

    asyncio.run(scenario())


# -- attention ---------------------------------------------------------------------------------


def test_attention_gives_every_layer_and_head(make_app, engine):
    text = "alpha bravo charlie delta"

    async def scenario() -> tuple[dict, dict]:
        async with served(make_app()) as client:
            found = await client.post("/v1/attention", json={"text": text, "beam": 2})
            translated = await client.post("/v1/translate", json={"text": [text], "beam": 2})
            assert found.status_code == translated.status_code == 200
            return found.json(), translated.json()

    found, translated = asyncio.run(scenario())
    config = engine.config.model
    assert (found["layers"], found["heads"]) == (config.n_layers, config.n_heads)
    assert found["translation"] == translated["translations"][0]["text"]
    assert found["source_tokens"] == [f"▁{w}" for w in text.split()] + ["</s>"]
    assert found["target_tokens"] == [f"▁{w}" for w in found["translation"].split()] + ["</s>"]
    tokenizer = engine.translator.tokenizer
    output = tokenizer.encode(found["translation"])
    _, _, cross = attention_weights(engine.translator.model, tokenizer.encode(text), output)
    weights = torch.tensor(found["weights"], dtype=torch.float64)  # (L, H, T, S)
    assert weights.shape == (
        config.n_layers,
        config.n_heads,
        len(output) + 1,
        len(text.split()) + 1,
    )
    torch.testing.assert_close(weights, torch.stack(cross).double(), atol=5e-5, rtol=0)
    torch.testing.assert_close(
        weights.sum(-1), torch.ones(weights.shape[:-1], dtype=torch.float64), atol=5e-4, rtol=0
    )


def test_attention_refuses_bad_input(make_app):
    cases = [
        ({"text": ["alpha"]}, "text", "string_type"),
        ({"text": ""}, "text", "string_too_short"),
        ({"text": "   "}, "text", "blank"),
        ({"text": "alpha bravo charlie delta"}, "text", "too_long"),  # 4 tokens > 3
        ({"text": "alpha", "nbest": 2}, "nbest", "extra_forbidden"),
        ({"text": "alpha", "beam": 99}, "beam", "limit"),
        # (pydantic itself refuses a lone surrogate in a plain string field)
        ({"text": "\ud800"}, "text", {"encoding", "string_unicode"}),
    ]

    async def scenario() -> None:
        async with served(make_app(max_attention_tokens=3)) as client:
            for body, field, kind in cases:
                content = json.dumps(body).encode()
                assert_error(await client.post("/v1/attention", content=content), 422, field, kind)
            ok = await client.post("/v1/attention", json={"text": "alpha bravo charlie"})
            assert ok.status_code == 200

    asyncio.run(scenario())


# -- shutting down -----------------------------------------------------------------------------


def test_closing_refuses_new_requests_and_finishes_queued_ones(engine):
    gated, app = gated_app(engine, max_wait_ms=0, retry_after_s=3)

    async def scenario() -> None:
        async with served(app) as client:
            first = asyncio.ensure_future(client.post("/v1/translate", json={"text": ["alpha"]}))
            await asyncio.to_thread(gated.started.wait, 10)
            queued = asyncio.ensure_future(client.post("/v1/translate", json={"text": ["bravo"]}))
            while app.state.batcher.queued_texts < 1:
                await asyncio.sleep(0.01)
            closing = asyncio.ensure_future(app.state.batcher.close())
            await asyncio.sleep(0.05)
            late = await client.post("/v1/translate", json={"text": ["charlie"]})
            assert_error(late, 503, "server", "shutting_down")
            assert late.headers["retry-after"] == "3"
            health = await client.get("/v1/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            gated.gate.set()
            assert (await first).status_code == 200
            assert (await queued).json()["translations"][0]["text"]
            await closing

    asyncio.run(scenario())


def test_attention_of_a_linformer_cross_attention_model_is_a_501(make_app, engine: Engine):
    from aiayn.config import RunConfig, replace
    from aiayn.model.transformer import Transformer

    config = replace(engine.config.model, cross_attention="linformer", linformer_k=8)
    model = Transformer(config).eval()
    translator = Translator(model, engine.translator.tokenizer, engine.translator.decode)
    linformer = Engine(translator, RunConfig(model=config), threads=1)
    app = make_app(linformer)

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with served(app) as client:
            described = await client.get("/v1/model")
            return described, await client.post("/v1/attention", json={"text": "alpha bravo"})

    described, refused = asyncio.run(scenario())
    assert described.json()["attention"] is False
    body = assert_error(refused, 501, "model", "unavailable")  # the model's, not the engine's
    assert "model.cross_attention = linformer" in body["error"]["message"]
