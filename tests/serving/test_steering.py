"""Steering through the API: terminology ``constraints`` and ``target_prefix`` per text give
what the library gives for them, texts without them are unchanged in the same request, word
scores add up to the log-probability, and every bad field is a 422 naming it. CTranslate2
takes a prefix and refuses constraints."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aiayn.inference.translator import Translator
from aiayn.serving.engine import Engine
from tests.serving.conftest import served
from tests.serving.test_api import assert_error, assert_same

pytestmark = pytest.mark.usefixtures("single_thread")

TEXTS = ["alpha bravo charlie", "delta echo foxtrot golf", "", "hotel india"]
CONSTRAINTS = [["golf"], [], [], ["delta echo", "foxtrot"]]
PREFIXES = ["", "golf echo", "", ""]


def library(checkpoint: Path, **steer: object) -> list:
    """What ``Translator.translate_nbest`` gives for TEXTS at beam 4, one call."""
    translator, _ = Translator.from_checkpoint(checkpoint, decode_overrides={"beam_size": 4})
    return translator.translate_nbest(TEXTS, **steer)  # type: ignore[arg-type]


def post(make_app, body: dict, **settings: object) -> dict:
    async def scenario() -> dict:
        async with served(make_app(**settings)) as client:
            answer = await client.post("/v1/translate", json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()

    return asyncio.run(scenario())


def test_constraints_and_prefix_give_what_the_library_gives(make_app, reverse_checkpoint: Path):
    body = {"text": TEXTS, "beam": 4, "constraints": CONSTRAINTS, "target_prefix": PREFIXES}
    answer = post(make_app, body)
    expected = library(reverse_checkpoint, constraints=CONSTRAINTS, prefixes=PREFIXES)
    assert_same(answer, expected)
    texts = [t["text"] for t in answer["translations"]]
    assert "golf" in texts[0].split()
    assert "delta echo" in texts[3] and "foxtrot" in texts[3].split()
    assert texts[1].startswith("golf echo")
    # The unsteered text is translated as it is without the fields.
    plain = post(make_app, {"text": TEXTS, "beam": 4})
    assert answer["translations"][2] == plain["translations"][2]
    assert "golf" not in plain["translations"][0]["text"].split()


def test_word_scores_add_up_to_the_log_probability(make_app, engine: Engine):
    answer = post(make_app, {"text": TEXTS, "beam": 4, "nbest": 2, "word_scores": True})
    plain = post(make_app, {"text": TEXTS, "beam": 4, "nbest": 2})
    for got, without in zip(answer["translations"], plain["translations"], strict=True):
        assert [h["text"] for h in got["hypotheses"]] == [h["text"] for h in without["hypotheses"]]
        for hyp in got["hypotheses"]:
            assert hyp["tokens"][-1] == "</s>"
            assert len(hyp["tokens"]) == len(hyp["token_log_probs"])
            assert sum(hyp["token_log_probs"]) == pytest.approx(hyp["log_prob"], abs=1e-4)
            assert all(lp <= 0 for lp in hyp["token_log_probs"])
            pieces = "".join(hyp["tokens"][:-1]).replace("\u2581", " ").strip()
            assert pieces == hyp["text"]
        for hyp in without["hypotheses"]:
            assert hyp["tokens"] is None and hyp["token_log_probs"] is None


BAD = [
    ({"constraints": [["golf"]]}, "constraints", "length"),
    ({"target_prefix": ["a", "b"]}, "target_prefix", "length"),
    ({"constraints": "kilo"}, "constraints", "list_type"),
    ({"constraints": [["golf", 3], [], [], []]}, "constraints[0][1]", "string_type"),
    ({"constraints": [["golf", "  "], [], [], []]}, "constraints[0][1]", "blank"),
    ({"constraints": [["a", "b", "c"], [], [], []]}, "constraints[0]", "too_many"),
    ({"constraints": [["alpha " * 5], [], [], []]}, "constraints[0][0]", "too_long"),
    ({"constraints": [[], [], [], ["x" * 300]]}, "constraints[3][0]", "too_long"),
    ({"target_prefix": ["", "", "", "y" * 300]}, "target_prefix[3]", "too_long"),
    ({"word_scores": "yes"}, "word_scores", "bool_type"),
]


def test_bad_steering_is_a_422_naming_the_field(make_app):
    async def scenario() -> None:
        app = make_app(max_constraints=2, max_constraint_tokens=4, max_chars=200)
        async with served(app) as client:
            for extra, field, kind in BAD:
                response = await client.post("/v1/translate", json={"text": TEXTS, **extra})
                assert_error(response, 422, field, kind)
            # A phrase that cannot fit the output limit of a short text.
            tight = make_app(max_constraint_tokens=1000, max_chars=2000)
            tight_engine = tight.state.engine
            [source] = tight_engine.encode(["alpha"])
            limit = tight_engine.translator.output_limit(len(source))
            words = ["golf"]
            while len(tight_engine.encode_target(" ".join(words))) <= limit:
                words.append("golf")
            body = {"text": ["alpha"], "constraints": [[" ".join(words)]]}
            async with served(tight) as other:
                response = await other.post("/v1/translate", json=body)
                message = assert_error(response, 422, "constraints[0]", "too_long")
                assert "output tokens more than text[0] may have" in message["error"]["message"]
            # The server goes on.
            good = await client.post(
                "/v1/translate", json={"text": TEXTS, "constraints": CONSTRAINTS}
            )
            assert good.status_code == 200

    asyncio.run(scenario())


def test_ctranslate2_takes_a_prefix_and_refuses_constraints(make_app, reverse_checkpoint):
    pytest.importorskip(
        "ctranslate2", reason="CTranslate2 is not installed (pip install 'aiayn[interop]')"
    )
    from aiayn.interop.ct2_translator import Ct2Translator

    translator, config = Ct2Translator.from_checkpoint(reverse_checkpoint, threads=1)
    ct2 = Engine(translator, config, source=str(reverse_checkpoint), threads=1)

    async def scenario() -> None:
        async with served(make_app(ct2)) as client:
            refused = await client.post(
                "/v1/translate", json={"text": TEXTS, "constraints": CONSTRAINTS}
            )
            body = assert_error(refused, 422, "constraints", "unavailable")
            assert "--engine torch" in body["error"]["message"]
            none = await client.post(
                "/v1/translate", json={"text": TEXTS, "constraints": [[], [], [], []]}
            )
            assert none.status_code == 200
            prefixed = await client.post(
                "/v1/translate", json={"text": TEXTS, "target_prefix": PREFIXES}
            )
            assert prefixed.status_code == 200, prefixed.text
            assert prefixed.json()["translations"][1]["text"].startswith("golf echo")

    asyncio.run(scenario())
