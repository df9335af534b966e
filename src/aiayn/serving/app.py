"""The FastAPI application: the page, the health check, the model's description, translation
and attention.

Answers and their statuses:

- ``GET /``: the page (``page.html``; inline script and style, nothing fetched from elsewhere,
  which its Content-Security-Policy enforces);
- ``GET /v1/health``: 200 ``{"status": "ok", ...}``, 503 ``"draining"`` while shutting down;
- ``GET /v1/model``: the model's config, vocabulary size, parameters, decoding defaults, the
  engine (``torch`` or ``ctranslate2``, with CTranslate2's compute type), whether the
  attention maps are available, and the server's limits;
- ``POST /v1/translate``: ``{"text": [...], "beam": 4, "alpha": 0.6, "nbest": 1}`` ->
  translations in input order, each with its n-best list and scores; per text, optional
  terminology ``"constraints"`` (the PyTorch engine) and a ``"target_prefix"``, and
  ``"word_scores": true`` for each token's log-probability;
- ``POST /v1/attention``: ``{"text": "...", "beam": 4, "alpha": 0.6}`` -> the best
  translation and its cross-attention, per layer and head (the PyTorch engine only: 501
  with another);
- ``GET /openapi.json``: the schema. (FastAPI's /docs pages load scripts from a CDN: off.)

Refusals are JSON (:class:`~aiayn.serving.schemas.ErrorResponse`): 400 (not JSON, not
UTF-8), 404, 405, 408 (body too slow), 413 (body too large), 422 (wrong, missing or unknown
fields, limits), 501 (attention maps without the PyTorch engine), 503 with Retry-After (queue
full, shutting down), 504 (request timeout).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from aiayn import __version__
from aiayn.inference.steering import Steering
from aiayn.inference.translator import Translation
from aiayn.serving.batcher import Batcher, Closed, QueueFull
from aiayn.serving.engine import DecodeKey, Engine
from aiayn.serving.schemas import (
    AttentionRequest,
    AttentionResponse,
    ErrorDetail,
    ErrorResponse,
    Health,
    Hypothesis,
    TextTranslation,
    TranslateRequest,
    TranslateResponse,
)
from aiayn.serving.settings import ServeSettings
from aiayn.serving.validation import (
    ApiError,
    field_name,
    parse_json_object,
    read_body,
    unicode_problem,
    validate,
)

log = logging.getLogger("aiayn.serve")

# Texts with more characters than this in all are tokenised off the event loop.
_TOKENIZE_INLINE_CHARS = 8192

# What the page may load: nothing but itself and this server's API.
PAGE_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in [
        (400, "not UTF-8, not JSON"),
        (408, "the body came too slowly"),
        (413, "the body is too large"),
        (422, "a field is wrong, missing, unknown or over a limit"),
        (503, "the queue is full or the server is shutting down (see Retry-After)"),
        (504, "the translation did not finish within the request timeout"),
    ]
}
_ATTENTION_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    501: {"model": ErrorResponse, "description": "the engine has no attention maps"},
}


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its body itself."""
    schema = {"schema": model.model_json_schema()}
    return {"requestBody": {"required": True, "content": {"application/json": schema}}}


def page_html() -> str:
    return resources.files("aiayn.serving").joinpath("page.html").read_text(encoding="utf-8")


def create_app(engine: Engine, settings: ServeSettings | None = None) -> FastAPI:
    """The application serving ``engine`` within ``settings`` (defaults: ServeSettings())."""
    settings = settings if settings is not None else ServeSettings()
    batch_tokens = settings.batch_tokens or engine.batch_tokens
    batcher = Batcher(
        engine.translate,
        batch_tokens=batch_tokens,
        max_wait_s=settings.max_wait_ms / 1000,
        max_queue=settings.max_queue,
        batching=settings.batching,
        on_thread_start=engine.start_thread,
    )
    started = time.monotonic()
    page = page_html()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # Shutting down (SIGTERM): new requests are refused, queued ones are finished.
        await batcher.close()

    app = FastAPI(
        title="aiayn",
        version=__version__,
        description="Translation with a Transformer of 'Attention Is All You Need'.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        # An unknown path is a JSON 404, a trailing slash too (not a redirect to the path
        # without it, which a POST client would not follow with its body).
        redirect_slashes=False,
    )
    app.state.engine = engine
    app.state.batcher = batcher
    app.state.settings = settings

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        field = {404: "path", 405: "method"}.get(err.status_code, "request")
        where = request.url.path if field == "path" else request.method
        message = f"{where}: {err.detail}"
        api = ApiError(err.status_code, field, message, "http", headers=err.headers)
        return await api_error(request, api)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        details = [
            ErrorDetail(field=field_name(e["loc"]), message=str(e["msg"]), type=str(e["type"]))
            for e in err.errors()
        ]
        return await api_error(request, ApiError.of(422, details))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        # Starlette then raises ``err`` again, for uvicorn to log.
        api = ApiError(500, "server", f"internal error: {type(err).__name__}", "internal")
        return await api_error(request, api)

    def refused_for_load(err: Exception) -> ApiError:
        retry = {"Retry-After": str(settings.retry_after_s)}
        if isinstance(err, QueueFull):
            return ApiError(503, "queue", f"the server is busy: {err}", "busy", headers=retry)
        return ApiError(503, "server", str(err), "shutting_down", headers=retry)

    def timed_out() -> ApiError:
        message = f"not finished within the request timeout of {settings.request_timeout_s:g} s"
        return ApiError(504, "request", message, "timeout")

    def failed(err: Exception) -> ApiError:
        log.error("decoding failed", exc_info=err)
        return ApiError(500, "server", f"internal error: {type(err).__name__}", "internal")

    def decode_key(
        beam: int | None, alpha: float | None, nbest: int, word_scores: bool = False
    ) -> DecodeKey:
        default = engine.default_key
        key = DecodeKey(
            beam if beam is not None else default.beam,
            alpha if alpha is not None else default.alpha,
            nbest,
            word_scores,
        )
        if key.beam > settings.max_beam:
            message = f"{key.beam} is more than the limit of {settings.max_beam}"
            raise ApiError(422, "beam", message, "limit")
        if key.nbest > key.beam:
            message = f"{key.nbest} is more than the beam size ({key.beam})"
            raise ApiError(422, "nbest", message, "limit")
        return key

    def text_problems(texts: list[str], names: list[str]) -> list[ErrorDetail]:
        problems = []
        for text, name in zip(texts, names, strict=True):
            if len(text) > settings.max_chars:
                message = f"{len(text)} characters, more than the limit of {settings.max_chars}"
                problems.append(ErrorDetail(field=name, message=message, type="too_long"))
            elif (problem := unicode_problem(text)) is not None:
                problems.append(ErrorDetail(field=name, message=problem, type="encoding"))
        return problems

    async def encode(
        texts: list[str], names: list[str], max_tokens: int, what: str
    ) -> list[list[int]]:
        """Token ids of ``texts`` (checked by text_problems); 422 for one over ``max_tokens``
        ("more than the {max_tokens} {what}")."""
        if sum(map(len, texts)) > _TOKENIZE_INLINE_CHARS:
            sources = await asyncio.to_thread(engine.encode, texts)
        else:
            sources = engine.encode(texts)
        problems = [
            ErrorDetail(
                field=name,
                message=f"{len(source)} tokens, more than the {max_tokens} {what}",
                type="too_long",
            )
            for source, name in zip(sources, names, strict=True)
            if len(source) > max_tokens
        ]
        if problems:
            raise ApiError.of(422, problems)
        return sources

    def steering_problems(
        texts: list[str], constraints: list[list[str]] | None, prefixes: list[str] | None
    ) -> list[ErrorDetail]:
        """What is wrong with a request's ``constraints`` and ``target_prefix``, before they
        are encoded: one entry per text, the phrases' count and text."""
        problems = []
        for name, given in (("constraints", constraints), ("target_prefix", prefixes)):
            if given is not None and len(given) != len(texts):
                message = f"{len(given)} entries for {len(texts)} texts: give one per text"
                problems.append(ErrorDetail(field=name, message=message, type="length"))
        if problems:
            return problems
        if constraints is not None and any(constraints):
            if (why := engine.constraints_unavailable) is not None:
                return [ErrorDetail(field="constraints", message=why, type="unavailable")]
            for i, phrases in enumerate(constraints):
                if len(phrases) > settings.max_constraints:
                    message = (
                        f"{len(phrases)} phrases, more than the limit of {settings.max_constraints}"
                    )
                    problems.append(
                        ErrorDetail(field=f"constraints[{i}]", message=message, type="too_many")
                    )
                    continue
                names = [f"constraints[{i}][{j}]" for j in range(len(phrases))]
                problems += text_problems(phrases, names)
                problems += [
                    ErrorDetail(field=name, message="blank: a phrase needs text", type="blank")
                    for name, phrase in zip(names, phrases, strict=True)
                    if not phrase.strip()
                ]
        if prefixes is not None:
            names = [f"target_prefix[{i}]" for i in range(len(prefixes))]
            problems += text_problems(prefixes, names)
        return problems

    def steer(
        sources: list[list[int]],
        constraints: list[list[str]] | None,
        prefixes: list[str] | None,
    ) -> list[Steering] | None:
        """The :class:`Steering` of each text (checked by steering_problems); 422 for a
        phrase over the token limit, a prefix over the model's positions, or constraints
        that cannot fit the text's output limit."""
        if not (constraints and any(constraints)) and not (prefixes and any(prefixes)):
            return None
        steering = []
        problems = []
        room = engine.max_source_tokens  # the output's positions, less EOS
        for i, source in enumerate(sources):
            phrases = []
            for j, phrase in enumerate(constraints[i] if constraints else []):
                ids = engine.encode_target(phrase)
                limit = settings.max_constraint_tokens
                if len(ids) > limit:
                    message = f"{len(ids)} tokens, more than the limit of {limit}"
                    field = f"constraints[{i}][{j}]"
                    problems.append(ErrorDetail(field=field, message=message, type="too_long"))
                phrases.append(tuple(ids))
            prefix = engine.encode_target(prefixes[i]) if prefixes else []
            if len(prefix) > room:
                message = f"{len(prefix)} tokens, more than the {room} this model outputs"
                problems.append(
                    ErrorDetail(field=f"target_prefix[{i}]", message=message, type="too_long")
                )
            one = Steering(tuple(phrases), tuple(prefix))
            if source and (over := engine.room_after_prefix(len(source), one)) is not None:
                message = (
                    f"the phrases need {over} output tokens more than text[{i}] may have "
                    "(its output limit: max_len_a, max_len_b)"
                )
                problems.append(
                    ErrorDetail(field=f"constraints[{i}]", message=message, type="too_long")
                )
            steering.append(one)
        if problems:
            raise ApiError.of(422, problems)
        return steering

    # HEAD too on the pages a health checker or a browser probes (curl -I).
    @app.api_route(
        "/", methods=["GET", "HEAD"], response_class=HTMLResponse, include_in_schema=False
    )
    async def index() -> HTMLResponse:
        headers = {"Content-Security-Policy": PAGE_POLICY, "Cache-Control": "no-cache"}
        return HTMLResponse(page, headers=headers)

    @app.api_route(
        "/v1/health",
        methods=["GET", "HEAD"],
        response_model=Health,
        responses={503: {"model": Health}},
    )
    async def health() -> JSONResponse:
        stats = batcher.stats
        report = Health(
            status="draining" if batcher.closing else "ok",
            busy=batcher.busy,
            queue_texts=batcher.queued_texts,
            batches=stats.batches,
            requests=stats.requests,
            texts=stats.texts,
            largest_batch_requests=stats.largest_batch_requests,
            uptime_s=round(time.monotonic() - started, 3),
        )
        return JSONResponse(report.model_dump(), status_code=503 if batcher.closing else 200)

    @app.get("/v1/model")
    async def model() -> dict[str, Any]:
        limits = {**settings.to_dict(), "batch_tokens": batch_tokens}
        return {
            **engine.describe(),
            "max_source_tokens": engine.max_source_tokens,
            "limits": limits,
        }

    @app.post(
        "/v1/translate",
        response_model=TranslateResponse,
        responses=_ERRORS,
        openapi_extra=_body_schema(TranslateRequest),
    )
    async def translate(request: Request) -> TranslateResponse:
        body = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        query = validate(TranslateRequest, parse_json_object(body))
        key = decode_key(query.beam, query.alpha, query.nbest, query.word_scores)
        if len(query.text) > settings.max_texts:
            message = f"{len(query.text)} texts, more than the limit of {settings.max_texts}"
            raise ApiError(422, "text", message, "too_many")
        names = [f"text[{i}]" for i in range(len(query.text))]
        problems = text_problems(query.text, names)
        problems += steering_problems(query.text, query.constraints, query.target_prefix)
        if problems:
            raise ApiError.of(422, problems)
        sources = await encode(query.text, names, engine.max_source_tokens, "this model takes")
        steering = steer(sources, query.constraints, query.target_prefix)
        try:
            results = await batcher.translate(key, sources, settings.request_timeout_s, steering)
        except (QueueFull, Closed) as err:
            raise refused_for_load(err) from None
        except asyncio.TimeoutError:
            raise timed_out() from None
        except Exception as err:  # the model failed: logged here, a 500 for this request
            raise failed(err) from None
        return TranslateResponse(
            translations=[_text_translation(hyps, engine) for hyps in results],
            beam=key.beam,
            alpha=key.alpha,
            nbest=key.nbest,
        )

    @app.post(
        "/v1/attention",
        response_model=AttentionResponse,
        responses=_ATTENTION_ERRORS,
        openapi_extra=_body_schema(AttentionRequest),
    )
    async def attention(request: Request) -> JSONResponse:
        body = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        if engine.attention_unavailable is not None:
            # The engine's fault (CTranslate2 holds no PyTorch model), or the model's.
            field = "engine" if engine.model is None else "model"
            raise ApiError(501, field, engine.attention_unavailable, "unavailable")
        query = validate(AttentionRequest, parse_json_object(body))
        key = decode_key(query.beam, query.alpha, 1)
        problems = text_problems([query.text], ["text"])
        if problems:
            raise ApiError.of(422, problems)
        if not query.text.strip():
            raise ApiError(422, "text", "blank: nothing to translate", "blank")
        limit = min(engine.max_source_tokens, settings.max_attention_tokens)
        [source] = await encode([query.text], ["text"], limit, "the attention view takes")
        try:
            found = await batcher.call(
                functools.partial(engine.cross_attention, key, source), settings.request_timeout_s
            )
        except (QueueFull, Closed) as err:
            raise refused_for_load(err) from None
        except asyncio.TimeoutError:
            raise timed_out() from None
        except Exception as err:  # the model failed: logged here, a 500 for this request
            raise failed(err) from None
        weights = [layer.double().mul(1e4).round().div(1e4).tolist() for layer in found.weights]
        answer = {
            "translation": found.translation,
            "source_tokens": found.source_tokens,
            "target_tokens": found.target_tokens,
            "layers": len(weights),
            "heads": len(weights[0]) if weights else 0,
            "weights": weights,
        }
        return JSONResponse(answer)

    return app


def _text_translation(hyps: list[Translation], engine: Engine) -> TextTranslation:
    if not hyps:
        return TextTranslation(text="", score=None, log_prob=None, hypotheses=[])
    best = hyps[0]
    return TextTranslation(
        text=best.text,
        score=best.score,
        log_prob=best.log_prob,
        hypotheses=[
            Hypothesis(
                text=h.text,
                score=h.score,
                log_prob=h.log_prob,
                tokens=engine.token_labels(h.tokens) if h.token_log_probs is not None else None,
                token_log_probs=h.token_log_probs,
            )
            for h in hyps
        ],
    )
