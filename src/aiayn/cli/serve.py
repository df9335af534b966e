"""``aiayn serve``: a checkpoint behind an HTTP API with request batching, and a page to try
it (docs/serving.md)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from aiayn.cli.engines import add_engine_arguments, check_engine_options, open_ct2
from aiayn.cli.paths import add_checkpoint_argument
from aiayn.cli.process import PROCESS_SETTINGS
from aiayn.errors import CLIError
from aiayn.progress import parameter_count

if TYPE_CHECKING:
    from aiayn.serving.engine import Engine


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from aiayn.serving.settings import ServeSettings  # plain dataclass: no PyTorch import

    d = ServeSettings()
    parser = subparsers.add_parser(
        "serve",
        help="serve a checkpoint over HTTP (API and page)",
        description="Serve a checkpoint over HTTP: POST /v1/translate (JSON: text, beam, "
        "alpha, nbest, constraints, target_prefix, word_scores), POST /v1/attention, GET "
        "/v1/health, GET /v1/model, the schema at /openapi.json, and a page at / to translate "
        "and look at the cross-attention. "
        "Concurrent requests are decoded together in batches. SIGTERM or Ctrl-C stops "
        "accepting, finishes what is queued and exits 0. --engine ctranslate2 decodes with "
        "CTranslate2, as translate does, and so does --quantize int8 (no attention maps then: "
        "/v1/attention answers 501).",
        epilog=PROCESS_SETTINGS,
    )
    add_checkpoint_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (8000; 0: any free one)")
    parser.add_argument("--beam", type=int, help="default beam size (default: the run's)")
    parser.add_argument("--alpha", type=float, help="default length penalty (the run's)")
    add_engine_arguments(parser)
    batching = parser.add_argument_group("batching")
    batching.add_argument(
        "--batch-tokens",
        type=int,
        help="source tokens (+1 EOS each) per decoding batch (default: the run's "
        "decode.batch_tokens)",
    )
    batching.add_argument(
        "--max-wait-ms",
        type=float,
        default=d.max_wait_ms,
        help=f"how long an idle server waits for more requests to batch ({d.max_wait_ms:g})",
    )
    batching.add_argument(
        "--no-batching", action="store_true", help="decode each request alone, as it comes"
    )
    limits = parser.add_argument_group("limits")
    beyond = "; beyond:"
    limit_options: tuple[tuple[str, type, object, str], ...] = (
        ("--max-chars", int, d.max_chars, "characters per text"),
        ("--max-texts", int, d.max_texts, "texts per request, at most --max-queue"),
        ("--max-body-bytes", int, d.max_body_bytes, "request body size"),
        ("--max-queue", int, d.max_queue, f"texts waiting for a batch{beyond} 503, Retry-After"),
        (
            "--timeout",
            float,
            d.request_timeout_s,
            f"seconds from a request's body to its answer{beyond} 504",
        ),
        ("--body-timeout", float, d.body_timeout_s, f"seconds to receive a body{beyond} 408"),
        (
            "--header-timeout",
            float,
            d.header_timeout_s,
            f"seconds to receive a request's head{beyond} closed",
        ),
        ("--max-beam", int, d.max_beam, "largest beam allowed"),
        (
            "--max-attention-tokens",
            int,
            d.max_attention_tokens,
            "source tokens of a sentence for /v1/attention",
        ),
        ("--max-constraints", int, d.max_constraints, "terminology phrases per text"),
        (
            "--max-constraint-tokens",
            int,
            d.max_constraint_tokens,
            "tokens of a terminology phrase",
        ),
        ("--max-connections", int, d.max_connections, f"open connections{beyond} 503"),
    )
    for flag, kind, default, what in limit_options:
        limits.add_argument(flag, type=kind, default=default, help=f"{what} (%(default)s)")
    parser.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default="warning",
        help="uvicorn's log level (warning)",
    )
    parser.add_argument("--access-log", action="store_true", help="log every request")
    parser.set_defaults(run=run)


def _say(message: str) -> None:
    print(f"aiayn serve: {message}", file=sys.stderr, flush=True)


def _on_signal(signum: int) -> None:
    # In a signal handler: one write(2), no buffered stream that may be mid-write.
    name = signal.Signals(signum).name
    message = f"aiayn serve: {name}: no new connections; finishing what is queued\n"
    os.write(sys.stderr.fileno(), message.encode())


def _torch_engine(args: argparse.Namespace, overrides: dict[str, Any]) -> tuple[Engine, str]:
    """The PyTorch engine and the device it runs on."""
    from aiayn.devices import pick_device
    from aiayn.serving.engine import Engine

    device = pick_device(args.device or "auto")
    if args.threads is not None:
        import torch

        # Before the model is made: a compiled decoder step is compiled for, and looked up
        # by, the thread count (the engine sets it again on its model thread).
        torch.set_num_threads(args.threads)
    engine = Engine.from_checkpoint(
        args.checkpoint,
        device=device,
        decode_overrides=overrides,
        pack_weights=args.pack_weights,
        precision=args.precision,
        compiled_step=args.compiled_step,
        mmap=args.mmap is not False,
        threads=args.threads,
        process_settings=True,
    )
    return engine, str(device)


def _ct2_engine(args: argparse.Namespace, overrides: dict[str, Any]) -> tuple[Engine, str]:
    """The CTranslate2 engine (through the export cached beside the checkpoint, as
    ``translate --engine ctranslate2``) and where it runs."""
    from aiayn.serving.engine import Engine

    translator, config, where = open_ct2(args, overrides)
    engine = Engine(translator, config, source=args.checkpoint, threads=args.threads)
    return engine, where


def run(args: argparse.Namespace) -> int:
    # Imported here: `aiayn --help` stays fast (aiayn.cli).
    from aiayn.serving.app import create_app
    from aiayn.serving.server import bind, serve
    from aiayn.serving.settings import ServeSettings

    check_engine_options(args)
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {args.port}")
    settings = ServeSettings(
        max_chars=args.max_chars,
        max_texts=args.max_texts,
        max_body_bytes=args.max_body_bytes,
        max_queue=args.max_queue,
        request_timeout_s=args.timeout,
        body_timeout_s=args.body_timeout,
        header_timeout_s=args.header_timeout,
        max_beam=args.max_beam,
        max_attention_tokens=args.max_attention_tokens,
        max_constraints=args.max_constraints,
        max_constraint_tokens=args.max_constraint_tokens,
        batch_tokens=args.batch_tokens,
        max_wait_ms=args.max_wait_ms,
        batching=not args.no_batching,
        max_connections=args.max_connections,
    )
    given = {"beam_size": args.beam, "alpha": args.alpha}
    overrides = {k: v for k, v in given.items() if v is not None}
    try:
        if args.engine == "ctranslate2":
            engine, where = _ct2_engine(args, overrides)
        else:
            engine, where = _torch_engine(args, overrides)
    except ValueError as err:
        raise CLIError(str(err)) from None
    if engine.default_key.beam > settings.max_beam:
        raise CLIError(
            f"the default beam {engine.default_key.beam} exceeds --max-beam "
            f"{settings.max_beam}: raise it, or pass a smaller --beam"
        )
    try:
        sock = bind(args.host, args.port)
    except OSError as err:
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {err.strerror}") from None
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    app = create_app(engine, settings)
    batching = (
        f"batches of up to {settings.batch_tokens or engine.batch_tokens} tokens, "
        f"{settings.max_wait_ms:g} ms wait"
        if settings.batching
        else "no batching"
    )
    _say(
        f"{args.checkpoint}: preset {engine.config.preset}, "
        f"{parameter_count(engine.parameters)}, on {where}; {batching}"
    )
    _say(f"listening on http://{url_host}:{port} (page /, API /v1/translate, /openapi.json)")
    with sock:
        serve(
            app,
            sock,
            settings,
            log_level=args.log_level,
            access_log=args.access_log,
            on_signal=_on_signal,
        )
    stats = app.state.batcher.stats
    requests = f"{stats.requests} translation request{'' if stats.requests == 1 else 's'}"
    batches = f"{stats.batches} batch{'' if stats.batches == 1 else 'es'}"
    _say(f"stopped after {requests} in {batches}")
    return 0
