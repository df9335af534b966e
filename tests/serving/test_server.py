"""``aiayn serve`` as a process: listening on loopback, SIGTERM as a graceful stop (queued
requests answered, new connections refused, exit 0), and its one-line errors."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path
from statistics import median

import pytest

from aiayn.cli import main
from tests.serving.conftest import ServerProcess

pytestmark = pytest.mark.usefixtures("single_thread")


def keep_alive_seconds(host: str, port: int, n: int) -> list[float]:
    """The time of each of ``n`` health checks sent one after another on one connection (each
    request in one write, without delay: the client is not what waits)."""
    request = f"GET /v1/health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    times = []
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = conn.makefile("rb")
        for _ in range(n):
            began = time.perf_counter()
            conn.sendall(request)
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            assert len(reader.read(length)) == length
            times.append(time.perf_counter() - began)
    return times


def test_slow_heads_are_cut_off_and_sigterm_finishes_the_queue(reverse_checkpoint: Path):
    # Batches wait 1.5 s for company: the requests are still queued when SIGTERM comes.
    server = ServerProcess(reverse_checkpoint, "--max-wait-ms", "1500", "--header-timeout", "0.5")
    try:
        url = server.wait_ready()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        # A connection that sends half a request head, and one that sends nothing: closed.
        for sent in (b"POST /v1/transl", b""):
            with socket.create_connection((host, int(port)), timeout=10) as slow:
                slow.sendall(sent)
                began = time.monotonic()
                assert slow.recv(100) == b""
                assert 0.3 < time.monotonic() - began < 5
        assert server.get("/v1/health")["status"] == "ok"
        # Answers on a kept-alive connection come at once: with Nagle's algorithm on the
        # server's socket, each waited for the client's delayed acknowledgement (40 ms on Linux).
        assert median(keep_alive_seconds(host, int(port), 9)) < 0.025

        texts = [["alpha bravo"], ["charlie delta echo", "foxtrot"], ["golf"], ["hotel india"]]
        answers: dict[int, tuple[int, dict]] = {}

        def ask(i: int) -> None:
            answers[i] = server.post("/v1/translate", {"text": texts[i], "beam": 2})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while server.get("/v1/health")["queue_texts"] < 5:
            assert time.monotonic() < deadline, "the requests did not queue"
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the stop is under way; the batch still waits for its 1.5 s
        with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
            pass
        for thread in threads:
            thread.join(timeout=30)
        assert server.proc.wait(timeout=30) == 0, server.stderr
    finally:
        server.stop()
    for i, text in enumerate(texts):
        status, body = answers[i]
        assert status == 200, body
        assert len(body["translations"]) == len(text)
        assert all(t["text"] for t in body["translations"])
    assert "SIGTERM: no new connections; finishing what is queued" in server.stderr
    assert "stopped after 4 translation requests in 1 batch\n" in server.stderr
    assert "Traceback" not in server.stderr


def test_serve_errors_are_one_line(reverse_checkpoint: Path, tmp_path: Path, capsys):
    assert main(["serve", str(tmp_path / "missing.pt"), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", str(reverse_checkpoint), "--max-texts", "0"]) == 2
    assert "max_texts must be positive" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", str(reverse_checkpoint), "--port", port]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err


@pytest.mark.parametrize(("flag", "mapped"), [([], True), (["--no-mmap"], False)])
def test_serve_maps_the_checkpoint_unless_told(
    flag: list[str], mapped: bool, reverse_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiayn.serving.engine import Engine
    from tests.helpers import loader_settings

    command = ["serve", str(reverse_checkpoint), "--port", "0", "--device", "cpu", *flag]
    assert loader_settings(monkeypatch, Engine, command)["mmap"] is mapped
