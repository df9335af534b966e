"""The server's limits and batching knobs: one frozen dataclass, each field a setting with a
default (``aiayn serve --help`` names the options)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from aiayn.errors import ConfigError


@dataclass(frozen=True)
class ServeSettings:
    """Limits on what a request may ask, and how requests are batched.

    ``batch_tokens`` is the token budget of one decoding batch: the sum over its texts of
    source tokens + 1 (EOS); None takes the run's ``decode.batch_tokens``. A request larger
    than the budget is still decoded, alone. ``max_wait_ms`` is how long the first request
    of a batch waits for others when the model is idle; ``batching=False`` decodes each
    request as its own batch, as it comes. ``max_queue`` counts the texts waiting for a
    batch: a request that would go beyond it gets 503 with ``Retry-After: retry_after_s``.
    ``request_timeout_s`` bounds a request from the end of its body to its answer (504
    beyond), ``body_timeout_s`` the reading of its body (408 beyond); a connection that has
    not sent a whole request head within ``header_timeout_s`` of connecting (or of its
    previous answer) is closed. A text may carry at most ``max_constraints`` terminology
    phrases, each of at most ``max_constraint_tokens`` tokens.
    """

    max_chars: int = 2000
    max_texts: int = 64
    max_body_bytes: int = 1_000_000
    max_queue: int = 1024
    request_timeout_s: float = 60.0
    body_timeout_s: float = 10.0
    header_timeout_s: float = 10.0
    max_beam: int = 16
    max_attention_tokens: int = 128
    max_constraints: int = 8
    max_constraint_tokens: int = 32
    batch_tokens: int | None = None
    max_wait_ms: float = 5.0
    batching: bool = True
    retry_after_s: int = 1
    max_connections: int = 512

    def __post_init__(self) -> None:
        positive = (
            "max_chars",
            "max_texts",
            "max_body_bytes",
            "max_queue",
            "request_timeout_s",
            "body_timeout_s",
            "header_timeout_s",
            "max_beam",
            "max_attention_tokens",
            "max_constraints",
            "max_constraint_tokens",
            "retry_after_s",
            "max_connections",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(
                    f"serve setting {name} must be positive, got {getattr(self, name)}"
                )
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise ConfigError(
                f"serve setting batch_tokens must be positive, got {self.batch_tokens}"
            )
        if self.max_wait_ms < 0:
            raise ConfigError(
                f"serve setting max_wait_ms must be 0 or more, got {self.max_wait_ms}"
            )
        if self.max_texts > self.max_queue:
            raise ConfigError(
                f"serve setting max_texts ({self.max_texts}) must not exceed max_queue "
                f"({self.max_queue}): such a request could never be queued"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
