"""The JSON of requests and answers. Requests are strict: no unknown fields, no coercion
(``"4"`` is not a beam size, ``true`` not an n-best), no NaN or infinity."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from aiayn.config import MAX_ALPHA

_STRICT = ConfigDict(extra="forbid", strict=True)


class TranslateRequest(BaseModel):
    """``POST /v1/translate``."""

    model_config = _STRICT

    text: list[str] = Field(
        min_length=1,
        description="the texts to translate, one sentence each (at most the server's "
        "max_texts, each at most max_chars characters); a blank text gives an empty "
        "translation",
    )
    beam: int | None = Field(
        default=None, ge=1, description="beam size, 1 is greedy search (default: the run's)"
    )
    alpha: float | None = Field(
        default=None,
        ge=0.0,
        le=MAX_ALPHA,
        allow_inf_nan=False,
        description=f"length penalty ((5+|Y|)/6)^alpha, 0 to {MAX_ALPHA:g} (default: the run's)",
    )
    nbest: int = Field(default=1, ge=1, description="hypotheses per text, at most the beam size")
    constraints: list[list[str]] | None = Field(
        default=None,
        description="terminology: per text, the phrases (target text) its translation must "
        "contain, each whole ([] for none); one list per text, at most the server's "
        "max_constraints phrases of at most max_constraint_tokens tokens each (the PyTorch "
        "engine: docs/translation.md)",
    )
    target_prefix: list[str] | None = Field(
        default=None,
        description="per text, the target text its translation starts with ('' for none); "
        "the search continues from it and its tokens are scored",
    )
    word_scores: bool = Field(
        default=False,
        description="give each hypothesis its tokens and their log-probabilities",
    )


class AttentionRequest(BaseModel):
    """``POST /v1/attention``."""

    model_config = _STRICT

    text: str = Field(min_length=1, description="one source sentence")
    beam: int | None = Field(default=None, ge=1, description="beam size (default: the run's)")
    alpha: float | None = Field(
        default=None, ge=0.0, le=MAX_ALPHA, allow_inf_nan=False, description="length penalty"
    )


class Hypothesis(BaseModel):
    text: str
    score: float = Field(description="log-probability divided by the length penalty")
    log_prob: float = Field(description="log-probability of the tokens and the final EOS")
    tokens: list[str] | None = Field(
        default=None, description="with word_scores: the output's pieces, then '</s>'"
    )
    token_log_probs: list[float] | None = Field(
        default=None,
        description="with word_scores: the log-probability of each of tokens (they sum to "
        "log_prob, to float32 rounding)",
    )


class TextTranslation(BaseModel):
    text: str = Field(description="the best translation ('' for a blank text)")
    score: float | None
    log_prob: float | None
    hypotheses: list[Hypothesis] = Field(description="up to nbest hypotheses, best first")


class TranslateResponse(BaseModel):
    translations: list[TextTranslation] = Field(description="one per text, in input order")
    beam: int
    alpha: float
    nbest: int


class AttentionResponse(BaseModel):
    translation: str
    source_tokens: list[str] = Field(description="source pieces and </s>")
    target_tokens: list[str] = Field(description="output pieces and </s>")
    layers: int
    heads: int
    weights: list[list[list[list[float]]]] = Field(
        description="[layer][head][target][source] encoder-decoder attention; each row sums "
        "to 1 (4 decimals)"
    )


class ErrorDetail(BaseModel):
    field: str = Field(description="where: 'body', 'text[2]', 'beam', a header, ...")
    message: str
    type: str


class ErrorResponse(BaseModel):
    error: ErrorDetail = Field(description="the first problem")
    errors: list[ErrorDetail] = Field(description="every problem found")


class Health(BaseModel):
    status: Literal["ok", "draining"]
    busy: bool = Field(description="a batch is being decoded now")
    queue_texts: int = Field(description="texts waiting for a batch")
    batches: int
    requests: int
    texts: int
    largest_batch_requests: int
    uptime_s: float
