"""uvicorn on a socket of our own, a deadline for request heads, and SIGTERM as a graceful
stop.

uvicorn closes an idle keep-alive connection after a few seconds, but waits as long as it
takes for the head of a request (a client that connects and sends nothing, or its headers a
byte at a time, holds a connection for ever): :class:`HeadTimedH11` closes a connection whose
request head has not arrived within ``header_timeout_s`` of connecting or of its previous
answer. Slow bodies are bounded by the application (``body_timeout_s``, 408).

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections, lets the requests in progress
finish (they wait on the batcher, which keeps decoding), then runs the application's shutdown,
which finishes whatever is still queued. :func:`serve` then returns, and ``aiayn serve``
exits 0. A second Ctrl-C forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from aiayn.serving.settings import ServeSettings


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048, reuse_port=False)


def serve(
    app: FastAPI,
    sock: socket.socket,
    settings: ServeSettings,
    *,
    log_level: str = "warning",
    access_log: bool = False,
    on_signal: Callable[[int], None] | None = None,
) -> None:
    """Serve ``app`` on ``sock`` until SIGTERM or SIGINT; returns after a graceful stop.
    ``on_signal(signum)`` is told of each stop signal as it arrives (in a signal handler:
    keep it short)."""
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        # Idle keep-alive connections close after this; busy ones are bounded by the
        # request timeout.
        timeout_keep_alive=5,
        limit_concurrency=settings.max_connections,
        # A request in progress gets its whole timeout before a stop cancels it.
        timeout_graceful_shutdown=int(settings.request_timeout_s + settings.body_timeout_s) + 1,
        server_header=False,
        http=head_timed_h11(settings.header_timeout_s),
    )
    server = _Server(config, on_signal)

    # uvicorn handles SIGTERM and SIGINT itself while it runs, and afterwards raises the
    # signal again for the handler that was there before: this one, which does nothing, so
    # that the process ends normally (exit 0) instead of being killed by the signal.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore(signum: int, frame: FrameType | None) -> None:
    return None


class _Server(uvicorn.Server):
    """uvicorn's server, telling ``on_signal`` of each stop signal as it arrives."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int], None] | None) -> None:
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.on_signal is not None:
            self.on_signal(sig)
        super().handle_exit(sig, frame)


class HeadTimedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head (see the module
    docstring)."""

    head_timeout_s = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        _no_delay(transport)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request head has arrived
            self._disarm()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # before: the next, pipelined request may start in there
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        waiting = self.cycle is None or self.cycle.response_complete
        if waiting and not self.transport.is_closing():
            self.transport.close()


def _no_delay(transport: asyncio.Transport) -> None:
    """Send each write at once (``TCP_NODELAY``). asyncio sets it only on sockets made with
    protocol ``IPPROTO_TCP``, and those a socket of our own (:func:`bind`, protocol 0) accepts
    are not: h11 writes an answer's head and body apart, and Nagle's algorithm would hold the
    body until the client acknowledged the head, which a client's delayed acknowledgement puts
    off (docs/serving.md, Load test)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # a peer gone already (EINVAL on some systems)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def head_timed_h11(timeout_s: float) -> type[H11Protocol]:
    """The protocol class for uvicorn's ``http`` setting, with this deadline."""
    return type("HeadTimedH11", (HeadTimedH11,), {"head_timeout_s": timeout_s})
