"""Load and bad-input test of ``aiayn serve`` on loopback: bounded in time, stops by itself.

From the repository root, ``.venv/bin/python -m benchmarks.serving_load CHECKPOINT_OR_RUN
--sentences FILE`` starts ``aiayn serve`` on a free loopback port (twice: with batching, then
with ``--no-batching``), and for each number of concurrent clients (1, 8, 32, 128 by default)
runs that many clients for a fixed time, each sending one sentence per request (round robin
over FILE) as soon as its previous answer came. It reports sentences/s, p50/p99 latency,
errors and the server's peak resident memory.

Then, with batching, a bad-input run: good clients as above while other connections send
random bytes, truncated JSON, bodies cut off mid-way, invalid UTF-8, wrong types, huge bodies
(declared and streamed) and bodies or headers one byte at a time. The server must answer every
good request with 200, refuse every bad one with a 4xx (or close the connection), never
answer 5xx, and still answer its health check afterwards. The exit status is 1 if not.

The client is a small HTTP/1.1 client on asyncio streams (keep-alive, one connection per
client), light enough to share the machine with the server. Peak memory is sampled from
``/proc/PID/status`` (Linux).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
CONNECT_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 120.0


# -- a small HTTP/1.1 client -----------------------------------------------------------------


class HttpError(Exception):
    """The connection broke or the answer was not HTTP."""


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one answer."""
    line = await reader.readline()
    match = re.match(rb"HTTP/1\.[01] (\d{3})", line)
    if not match:
        raise HttpError(f"not an HTTP answer: {line[:40]!r}")
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        body = await reader.read()
    return int(match.group(1)), headers, body


def request_head(method: str, path: str, length: int | None, extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + extra + "\r\n").encode("latin-1")


class Connection:
    """One keep-alive connection, reopened when the server closes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.wait_for(
                asyncio.open_connection(HOST, self.port), CONNECT_TIMEOUT_S
            )
        assert self.reader is not None and self.writer is not None
        try:
            self.writer.write(request_head(method, path, len(body)) + body)
            await self.writer.drain()
            status, headers, data = await asyncio.wait_for(
                read_answer(self.reader), ANSWER_TIMEOUT_S
            )
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, HttpError):
            await self.close()
            raise
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, data

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


# -- the server --------------------------------------------------------------------------------


class Server:
    """``aiayn serve CHECKPOINT --port 0 OPTIONS`` in a subprocess."""

    def __init__(self, checkpoint: str, options: Sequence[str]) -> None:
        command = [sys.executable, "-m", "aiayn", "serve", checkpoint, "--port", "0", *options]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self.port = 0
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            found = re.search(r"listening on http://[^\s]+:(\d+)", line)
            if found:
                self.port = int(found.group(1))
                self._listening.set()

    def wait_listening(self, timeout_s: float = 120) -> int:
        deadline = time.monotonic() + timeout_s
        while not self._listening.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("aiayn serve did not start:\n" + "".join(self.lines))
        return self.port

    def rss_mib(self) -> float | None:
        """Resident memory now (VmRSS), from /proc; None elsewhere."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        found = re.search(r"VmRSS:\s+(\d+) kB", status)
        return int(found.group(1)) / 1024 if found else None

    def stop(self) -> int:
        """SIGTERM; the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# -- good load ---------------------------------------------------------------------------------


@dataclass
class Phase:
    """One timed run of ``clients`` concurrent clients."""

    mode: str
    clients: int
    seconds: float = 0.0  # from the first request to the last answer
    sentences: int = 0  # translated (200)
    requests: int = 0
    errors: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    peak_rss_mib: float | None = None

    def percentile_ms(self, q: float) -> float:
        """Nearest-rank percentile of the latencies, in ms."""
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
        return 1000 * ordered[rank - 1]

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "clients": self.clients,
            "seconds": round(self.seconds, 2),
            "requests": self.requests,
            "sentences": self.sentences,
            "sentences_per_s": round(self.sentences / self.seconds, 2) if self.seconds else 0.0,
            "p50_ms": round(self.percentile_ms(50), 1),
            "p99_ms": round(self.percentile_ms(99), 1),
            "errors": self.errors,
            "statuses": dict(self.statuses),
            "peak_rss_mib": None if self.peak_rss_mib is None else round(self.peak_rss_mib, 1),
        }


async def _sample_rss(server: Server, phase: Phase, stop: asyncio.Event) -> None:
    while not stop.is_set():
        rss = server.rss_mib()
        if rss is not None:
            phase.peak_rss_mib = max(phase.peak_rss_mib or 0.0, rss)
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except asyncio.TimeoutError:
            pass


async def good_client(
    port: int,
    sentences: Sequence[str],
    start: int,
    deadline: float,
    phase: Phase,
    extra: dict[str, Any],
) -> None:
    """Requests one sentence at a time until ``deadline``; each answer is checked."""
    connection = Connection(port)
    loop = asyncio.get_running_loop()
    i = start
    try:
        while loop.time() < deadline:
            text = sentences[i % len(sentences)]
            i += 1
            body = json.dumps({"text": [text], **extra}).encode()
            sent = loop.time()
            phase.requests += 1
            try:
                status, data = await connection.request("POST", "/v1/translate", body)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, HttpError) as err:
                phase.errors += 1
                phase.statuses[type(err).__name__] += 1
                continue
            phase.statuses[str(status)] += 1
            if status != 200 or len(json.loads(data)["translations"]) != 1:
                phase.errors += 1
                continue
            phase.latencies.append(loop.time() - sent)
            phase.sentences += 1
    finally:
        await connection.close()


async def run_phase(
    server: Server,
    sentences: Sequence[str],
    mode: str,
    clients: int,
    seconds: float,
    extra: dict[str, Any],
    alongside: Callable[[float], Awaitable[Any]] | None = None,
) -> tuple[Phase, Any]:
    """``clients`` good clients for ``seconds`` (and ``alongside(deadline)``, if given)."""
    phase = Phase(mode, clients)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(_sample_rss(server, phase, stop))
    began = loop.time()
    deadline = began + seconds
    step = max(1, len(sentences) // clients)
    tasks = [
        good_client(server.port, sentences, c * step, deadline, phase, extra)
        for c in range(clients)
    ]
    side = asyncio.ensure_future(alongside(deadline)) if alongside is not None else None
    await asyncio.gather(*tasks)
    phase.seconds = loop.time() - began
    side_result = await side if side is not None else None
    stop.set()
    await sampler
    return phase, side_result


# -- bad input ---------------------------------------------------------------------------------


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection(HOST, port), CONNECT_TIMEOUT_S)


async def _answer(reader: asyncio.StreamReader, timeout_s: float = 30) -> str:
    """The status of the server's answer, or 'closed' when it closed without one."""
    try:
        status, _, _ = await asyncio.wait_for(read_answer(reader), timeout_s)
    except (HttpError, asyncio.IncompleteReadError, ConnectionError):
        return "closed"
    except asyncio.TimeoutError:
        return "no answer"
    return str(status)


async def _send(writer: asyncio.StreamWriter, data: bytes) -> bool:
    try:
        writer.write(data)
        await writer.drain()
    except ConnectionError:
        return False
    return True


async def _finish(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass


async def random_bytes(port: int, rng: random.Random) -> str:
    reader, writer = await _open(port)
    await _send(writer, rng.randbytes(rng.randint(16, 4096)))
    outcome = await _answer(reader)
    await _finish(writer)
    return outcome


def _post(body: bytes, length: int | None = None) -> bytes:
    return request_head("POST", "/v1/translate", len(body) if length is None else length) + body


async def _one_post(port: int, data: bytes, close_write: bool = False) -> str:
    reader, writer = await _open(port)
    await _send(writer, data)
    if close_write and writer.can_write_eof():
        writer.write_eof()
    outcome = await _answer(reader)
    await _finish(writer)
    return outcome


GOOD_BODY = json.dumps({"text": ["In the beginning God created the heavens and the earth."]})


async def truncated_json(port: int, rng: random.Random) -> str:
    body = GOOD_BODY.encode()[: rng.randint(1, len(GOOD_BODY) - 1)]
    return await _one_post(port, _post(body))


async def cut_off_body(port: int, rng: random.Random) -> str:
    """Content-Length promises the whole body; half comes, then the client hangs up."""
    body = GOOD_BODY.encode()
    return await _one_post(port, _post(body[: len(body) // 2], len(body)), close_write=True)


async def invalid_utf8(port: int, rng: random.Random) -> str:
    return await _one_post(port, _post(b'{"text": ["caf\xe9 \xff\xfe"]}'))


async def wrong_types(port: int, rng: random.Random) -> str:
    bodies = [
        {"text": "not a list"},
        {"text": [1, 2]},
        {"text": []},
        {"text": ["a"], "beam": "4"},
        {"text": ["a"], "nbest": True},
        {"text": ["a"], "colour": "red"},
        {"text": ["a"], "beam": 10**9},
    ]
    return await _one_post(port, _post(json.dumps(rng.choice(bodies)).encode()))


async def huge_declared(port: int, rng: random.Random) -> str:
    """Content-Length of 100 MB, and a first bit of it."""
    return await _one_post(port, _post(b'{"text": ["' + b"a" * 1000, 100_000_000))


async def _feed_until_answered(
    port: int, pieces: Callable[[], AsyncIterator[bytes]], timeout_s: float = 30
) -> str:
    """Send ``pieces()`` on one connection until the server answers or hangs up."""
    reader, writer = await _open(port)

    async def feed() -> None:
        async for piece in pieces():
            if not await _send(writer, piece):
                return

    sender = asyncio.ensure_future(feed())
    outcome = await _answer(reader, timeout_s)
    sender.cancel()
    try:
        await sender
    except asyncio.CancelledError:
        pass
    await _finish(writer)
    return outcome


async def huge_streamed(port: int, rng: random.Random) -> str:
    """A chunked body of 64 KiB chunks, up to 8 MiB, without a Content-Length."""

    async def pieces() -> AsyncIterator[bytes]:
        head = request_head("POST", "/v1/translate", None, "Transfer-Encoding: chunked\r\n")
        yield head + b'10\r\n{"text": ["aaaaa\r\n'
        chunk = b"a" * 65536
        for _ in range(128):
            yield b"%x\r\n" % len(chunk) + chunk + b"\r\n"

    return await _feed_until_answered(port, pieces)


async def slow_body(port: int, rng: random.Random) -> str:
    """A whole request whose body comes one byte every 0.25 s."""
    body = GOOD_BODY.encode()

    async def pieces() -> AsyncIterator[bytes]:
        yield request_head("POST", "/v1/translate", len(body))
        for byte in body:
            await asyncio.sleep(0.25)
            yield bytes([byte])

    return await _feed_until_answered(port, pieces)


async def slow_headers(port: int, rng: random.Random) -> str:
    """A request head one byte every 0.25 s."""

    async def pieces() -> AsyncIterator[bytes]:
        for byte in request_head("POST", "/v1/translate", len(GOOD_BODY)):
            yield bytes([byte])
            await asyncio.sleep(0.25)

    return await _feed_until_answered(port, pieces)


ATTACKS: dict[str, Callable[[int, random.Random], Awaitable[str]]] = {
    "random bytes": random_bytes,
    "truncated JSON": truncated_json,
    "body cut off": cut_off_body,
    "invalid UTF-8": invalid_utf8,
    "wrong types": wrong_types,
    "huge body (declared)": huge_declared,
    "huge body (streamed)": huge_streamed,
    "slow body": slow_body,
    "slow headers": slow_headers,
}
# What each kind may get back: refusals and closed connections, never a 2xx or 5xx.
EXPECTED: dict[str, set[str]] = {
    "random bytes": {"400", "closed"},  # closed: no whole request head in time
    "truncated JSON": {"400"},
    "body cut off": {"400", "closed"},
    "invalid UTF-8": {"400"},
    "wrong types": {"422"},
    "huge body (declared)": {"413"},
    "huge body (streamed)": {"413", "closed"},
    "slow body": {"408"},
    "slow headers": {"closed"},
}


async def attack(
    port: int, deadline: float, per_kind: int, pause_s: float, seed: int
) -> dict[str, Counter[str]]:
    """``per_kind`` connections of each kind, one after another with ``pause_s`` between,
    until ``deadline``."""
    outcomes: dict[str, Counter[str]] = {kind: Counter() for kind in ATTACKS}
    loop = asyncio.get_running_loop()

    async def keep_at_it(kind: str, rng: random.Random) -> None:
        while loop.time() < deadline:
            try:
                outcome = await ATTACKS[kind](port, rng)
            except (OSError, asyncio.TimeoutError) as err:
                outcome = type(err).__name__
            outcomes[kind][outcome] += 1
            await asyncio.sleep(pause_s)

    runs = [
        keep_at_it(kind, random.Random(seed * 1000 + i))
        for i, kind in enumerate(k for k in ATTACKS for _ in range(per_kind))
    ]
    await asyncio.gather(*runs)
    return outcomes


# -- the whole run -----------------------------------------------------------------------------


def cpu_name() -> str:
    """The CPU's model name and its AVX-512 / AMX flags, from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = re.search(r"model name\s*:\s*(.+)", info)
    flags_line = re.search(r"flags\s*:\s*(.+)", info)
    flags = set(flags_line.group(1).split()) if flags_line else set()
    shown = [f for f in ("avx512f", "avx512_bf16", "amx_tile") if f in flags]
    cores = os.cpu_count()
    label = name.group(1).strip() if name else "unknown CPU"
    return f"{label}, {cores} cores, " + (", ".join(shown) if shown else "no AVX-512")


async def _warm_up(port: int, sentences: Sequence[str]) -> None:
    connection = Connection(port)
    for text in sentences[:5]:
        await connection.request("POST", "/v1/translate", json.dumps({"text": [text]}).encode())
    await connection.close()


async def _health(port: int) -> int:
    connection = Connection(port)
    status, _ = await connection.request("GET", "/v1/health")
    await connection.close()
    return status


def run_mode(
    args: argparse.Namespace, sentences: Sequence[str], batching: bool, bad_input: bool
) -> tuple[list[Phase], dict[str, Counter[str]] | None, int]:
    """One server: each number of clients, then (``bad_input``) the bad-input run; the
    phases, the bad-input outcomes and the server's exit status."""
    timeouts = [
        "--body-timeout",
        str(args.body_timeout),
        "--header-timeout",
        str(args.body_timeout),
    ]
    options = [*args.serve_option, *timeouts]
    if not batching:
        options.append("--no-batching")
    mode = "batching" if batching else "no batching"
    server = Server(args.checkpoint, options)
    phases: list[Phase] = []
    outcomes = None
    extra: dict[str, Any] = {} if args.beam is None else {"beam": args.beam}
    try:
        port = server.wait_listening()
        asyncio.run(_warm_up(port, sentences))
        for clients in args.clients:
            phase, _ = asyncio.run(run_phase(server, sentences, mode, clients, args.seconds, extra))
            phases.append(phase)
            _report_phase(phase)
        if bad_input:
            phase, outcomes = asyncio.run(
                run_phase(
                    server,
                    sentences,
                    f"{mode} + bad input",
                    args.bad_input_clients,
                    args.seconds,
                    extra,
                    alongside=lambda deadline: attack(
                        port, deadline, args.per_kind, args.attack_pause, seed=1
                    ),
                )
            )
            phases.append(phase)
            _report_phase(phase)
            health = asyncio.run(_health(port))
            if health != 200:
                raise RuntimeError(f"health check after the bad input: {health}")
    finally:
        code = server.stop()
    return phases, outcomes, code


def _report_phase(phase: Phase) -> None:
    s = phase.summary()
    print(
        f"  {s['mode']:>24} {s['clients']:>4} clients: {s['sentences_per_s']:8.1f} sentences/s "
        f"p50 {s['p50_ms']:7.1f} ms p99 {s['p99_ms']:7.1f} ms errors {s['errors']} "
        f"peak RSS {s['peak_rss_mib']} MiB",
        file=sys.stderr,
        flush=True,
    )


def markdown(
    phases: list[Phase],
    outcomes: dict[str, Counter[str]] | None,
    cpu: str,
    args: argparse.Namespace,
) -> str:
    lines = [
        f"CPU: {cpu}. {args.seconds:g} s per row, one sentence per request"
        + (f", beam {args.beam}" if args.beam is not None else ", the run's beam")
        + ".",
        "",
        "| batching | clients | sentences/s | p50 ms | p99 ms | errors | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        s = p.summary()
        lines.append(
            f"| {s['mode']} | {s['clients']} | {s['sentences_per_s']:.1f} | {s['p50_ms']:.0f} "
            f"| {s['p99_ms']:.0f} | {s['errors']} | {s['peak_rss_mib']:.0f} |"
        )
    on = {p.clients: p for p in phases if p.mode == "batching"}
    off = {p.clients: p for p in phases if p.mode == "no batching"}
    gains = [
        f"{c} clients {on[c].sentences / on[c].seconds / (off[c].sentences / off[c].seconds):.2f}x"
        for c in sorted(on)
        if c in off and off[c].sentences
    ]
    if gains:
        lines += ["", "Batching gain (sentences/s with / without): " + ", ".join(gains) + "."]
    if outcomes is not None:
        lines += ["", "| bad input | connections | answers |", "|---|---:|---|"]
        for kind, counts in outcomes.items():
            answers = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
            lines.append(f"| {kind} | {sum(counts.values())} | {answers} |")
    return "\n".join(lines) + "\n"


def check(
    phases: list[Phase], outcomes: dict[str, Counter[str]] | None, codes: list[int]
) -> list[str]:
    """What went wrong: good requests lost or refused, unexpected answers, exit statuses."""
    problems = []
    for phase in phases:
        if phase.errors or phase.sentences != phase.requests:
            problems.append(
                f"{phase.mode}, {phase.clients} clients: {phase.requests} requests, "
                f"{phase.sentences} translated, answers {dict(phase.statuses)}"
            )
    for kind, counts in (outcomes or {}).items():
        unexpected = {k: v for k, v in counts.items() if k not in EXPECTED[kind]}
        if unexpected or not counts:
            problems.append(f"bad input {kind!r}: unexpected outcomes {unexpected or 'none ran'}")
    problems += [f"the server exited with status {code}" for code in codes if code != 0]
    return problems


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving_load",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN")
    parser.add_argument(
        "--sentences", required=True, type=Path, help="source sentences, one a line"
    )
    parser.add_argument(
        "--clients",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8, 32, 128],
        help="numbers of concurrent clients (1,8,32,128)",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per run (20)")
    parser.add_argument("--beam", type=int, help="beam size asked for (default: the run's)")
    parser.add_argument(
        "--bad-input-clients", type=int, default=32, help="good clients during the bad input"
    )
    parser.add_argument("--per-kind", type=int, default=2, help="connections per bad-input kind")
    parser.add_argument(
        "--attack-pause", type=float, default=0.05, help="seconds between bad connections (0.05)"
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=2.0,
        help="the server's --body-timeout and --header-timeout (2)",
    )
    parser.add_argument(
        "--no-unbatched", action="store_true", help="skip the runs without batching"
    )
    parser.add_argument("--no-bad-input", action="store_true", help="skip the bad-input run")
    parser.add_argument(
        "--serve-option",
        action="append",
        default=[],
        metavar="OPTION",
        help="passed to aiayn serve (repeat: --serve-option=--threads --serve-option=2)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sentences = [line.strip() for line in args.sentences.read_text(encoding="utf-8").splitlines()]
    sentences = [s for s in sentences if s]
    if not sentences:
        print(f"{args.sentences}: no sentences", file=sys.stderr)
        return 2
    cpu = cpu_name()
    print(f"load test of {args.checkpoint} on {cpu}", file=sys.stderr, flush=True)
    phases, outcomes, code = run_mode(args, sentences, True, not args.no_bad_input)
    codes = [code]
    if not args.no_unbatched:
        more, _, code = run_mode(args, sentences, False, False)
        phases += more
        codes.append(code)
    report = markdown(phases, outcomes, cpu, args)
    print(report)
    problems = check(phases, outcomes, codes)
    if args.json is not None:
        data = {
            "cpu": cpu,
            "checkpoint": args.checkpoint,
            "seconds": args.seconds,
            "phases": [p.summary() for p in phases],
            "bad_input": {k: dict(v) for k, v in (outcomes or {}).items()},
            "exit_statuses": codes,
            "problems": problems,
        }
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if args.markdown is not None:
        args.markdown.write_text(report, encoding="utf-8")
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
