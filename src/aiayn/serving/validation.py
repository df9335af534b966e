"""Reading a request within the limits. Every refusal is an :class:`ApiError`: a 4xx status
and a JSON body that names the field (``body``, ``text[2]``, ``beam``, ``Content-Length``).

The body is read here, not by FastAPI, so that its size is checked before it is read
(``Content-Length``) and while it is read (chunked uploads), and so that invalid UTF-8,
malformed JSON, NaN and nesting too deep for the parser each get their own message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from aiayn.serving.schemas import ErrorDetail, ErrorResponse

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """A request refused with ``status``; ``errors`` lists every problem, the first one
    first. ``headers`` go with the answer (``Retry-After``)."""

    def __init__(
        self,
        status: int,
        field: str,
        message: str,
        type_: str,
        *,
        more: Sequence[ErrorDetail] = (),
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{field}: {message}")
        self.status = status
        self.errors = [ErrorDetail(field=field, message=message, type=type_), *more]
        self.headers = dict(headers or {})

    @classmethod
    def of(cls, status: int, errors: Sequence[ErrorDetail]) -> ApiError:
        first, *rest = errors
        return cls(status, first.field, first.message, first.type, more=rest)

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.errors[0], errors=self.errors).model_dump()


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body: at most ``limit`` bytes (413 beyond), all of it within ``timeout_s``
    (408 beyond)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ApiError(400, "Content-Length", f"not a byte count: {declared!r}", "header")
        if int(declared) > limit:
            raise ApiError(
                413, "body", f"{int(declared)} bytes, more than the limit of {limit}", "too_large"
            )

    async def receive() -> bytes:
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, "body", f"more than the limit of {limit} bytes", "too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(receive(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(
            408, "body", f"the body did not arrive within {timeout_s:g} s", "timeout"
        ) from None
    except ClientDisconnect:
        raise ApiError(
            400, "body", "the client closed the connection mid-body", "incomplete"
        ) from None


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The JSON object in ``body`` (UTF-8); 400 for anything that is not JSON, 422 for JSON
    that is not an object."""
    if not body.strip():
        raise ApiError(400, "body", "empty: expected a JSON object", "empty")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ApiError(
            400, "body", f"not valid UTF-8 (byte {err.start}: {err.reason})", "encoding"
        ) from None
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except json.JSONDecodeError as err:
        message = f"malformed JSON: {err.msg} at line {err.lineno} column {err.colno}"
        raise ApiError(400, "body", message, "json") from None
    except ValueError as err:  # NaN, Infinity
        raise ApiError(400, "body", f"malformed JSON: {err}", "json") from None
    except RecursionError:
        raise ApiError(400, "body", "malformed JSON: nested too deeply", "json") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean"}.get(type(data), "a number")
        if data is None:
            kind = "null"
        raise ApiError(422, "body", f"expected a JSON object, got {kind}", "type")
    return data


def field_name(loc: Sequence[int | str]) -> str:
    """``("text", 2)`` -> ``"text[2]"``, ``("beam",)`` -> ``"beam"``."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            name += f".{part}" if name else str(part)
    return name or "body"


def validate(model: type[M], data: dict[str, Any]) -> M:
    """``data`` as ``model``; 422 naming each field that is wrong, missing or unknown."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        known = ", ".join(model.model_fields)
        details = []
        for problem in err.errors(include_url=False):
            kind = str(problem["type"])
            if kind == "extra_forbidden":
                message = f"unknown field (the fields are: {known})"
            elif kind == "missing":
                message = "required"
            else:
                message = str(problem["msg"])
            details.append(
                ErrorDetail(field=field_name(problem["loc"]), message=message, type=kind)
            )
        raise ApiError.of(422, details) from None


def unicode_problem(text: str) -> str | None:
    """Why ``text`` cannot be tokenised (a lone surrogate from a ``\\ud800`` escape), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"not valid Unicode: a lone surrogate at character {err.start}"
    return None
