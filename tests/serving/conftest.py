"""A tiny word-reversal model saved as a checkpoint (with the reversal data's tokenizer), the
engine that serves it, and an in-process HTTP client for the application."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI

from aiayn.data.corpus import TOKENIZER_NAME
from aiayn.data.tokenizer import Tokenizer
from aiayn.inference.steering import Steering
from aiayn.inference.translator import Translation
from aiayn.model.transformer import Transformer
from aiayn.serving.app import create_app
from aiayn.serving.engine import DecodeKey, Engine
from aiayn.serving.settings import ServeSettings
from aiayn.training.checkpoint import bytes_to_tensor, model_checkpoint, model_state
from tests.helpers import ROOT, WORDS, tiny_config, train_to_reverse


def sentence(rng: random.Random, low: int = 2, high: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


# Enough updates that the model reverses most sentences on any CPU (at 150 updates and a
# learning rate of 1e-2 the loss was still 0.85 on an AMD EPYC, and most reversals were wrong).
STEPS = 250


@pytest.fixture(scope="session")
def reverse_checkpoint(reverse_data_dir: Path, tmp_path_factory) -> Path:
    """A model checkpoint of the tiny preset trained for a few seconds to reverse word
    sequences: it ends its outputs at various lengths, unlike random weights."""
    tokenizer = Tokenizer.load(reverse_data_dir / TOKENIZER_NAME)
    config = tiny_config(f"model.vocab_size={tokenizer.vocab_size}", "model.dropout=0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = random.Random(0)
    model = Transformer(config.model)
    train_to_reverse(model, lambda: tokenizer.encode(sentence(rng)), STEPS, batch=32, lr=5e-3)
    torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("served") / "reverse.pt"
    spm = bytes_to_tensor(tokenizer.to_bytes())
    torch.save(model_checkpoint(config, model_state(model), spm, step=STEPS, epoch=1), path)
    return path


@pytest.fixture(scope="session")
def engine(reverse_checkpoint: Path) -> Engine:
    return Engine.from_checkpoint(reverse_checkpoint, threads=1)


class GatedEngine(Engine):
    """The engine, whose batches wait for ``gate`` (a threading.Event) before decoding: a
    test holds the model thread busy for as long as it wants."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine.translator, engine.config, source=engine.source, threads=1)
        self.gate = threading.Event()
        self.started = threading.Event()

    def translate(
        self,
        key: DecodeKey,
        sources: Sequence[Sequence[int]],
        steering: Sequence[Steering] | None = None,
    ) -> list[list[Translation]]:
        self.started.set()
        if not self.gate.wait(timeout=20):
            raise RuntimeError("the test never opened the gate")
        return super().translate(key, sources, steering)


@asynccontextmanager
async def served(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process client of ``app``; the batcher is closed afterwards (as at shutdown)."""
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://aiayn.test") as client:
            yield client
    finally:
        await app.state.batcher.close()


@pytest.fixture
def make_app(engine: Engine) -> Iterator[object]:
    """``make_app(**settings)`` -> the application over the shared engine."""

    def make(engine_: Engine | None = None, **settings: object) -> FastAPI:
        return create_app(engine_ or engine, ServeSettings(**settings))  # type: ignore[arg-type]

    yield make


class ServerProcess:
    """``aiayn serve`` in a subprocess on a free loopback port; ``stderr`` collects its
    messages (read by a thread, so that the pipe never fills)."""

    def __init__(self, checkpoint: Path, *options: str) -> None:
        command = [
            sys.executable,
            "-c",
            "import sys; from aiayn.cli import main; sys.exit(main())",
            "serve",
            str(checkpoint),
            "--port",
            "0",
            "--threads",
            "1",
            *options,
        ]
        path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        self.proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: list[str] = []
        self._listening = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            found = re.search(r"listening on (http://\S+)", line)
            if found:
                self.url = found.group(1)
                self._listening.set()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 60) -> str:
        """The base URL once ``/v1/health`` answers."""
        deadline = time.monotonic() + timeout
        while not self._listening.wait(0.1):
            assert self.proc.poll() is None, f"aiayn serve exited: {self.stderr}"
            assert time.monotonic() < deadline, f"aiayn serve did not start: {self.stderr}"
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/v1/health", timeout=5) as answer:
                    if answer.status == 200:
                        return self.url
            except OSError:
                assert time.monotonic() < deadline, f"no health answer: {self.stderr}"
                time.sleep(0.1)

    def post(self, path: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def get(self, path: str, timeout: float = 10) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as answer:
            return json.loads(answer.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
