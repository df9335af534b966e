"""Dynamic batching: requests that arrive together are decoded together.

Each request waits in one queue. A worker task on the event loop takes the oldest request and,
while the model is idle, waits up to ``max_wait_s`` from that request's arrival for others
with the same decoding settings (beam, alpha, n-best), until their source tokens reach the
``batch_tokens`` budget; it then hands the whole batch to the single model thread and splits
the results back to each request's future. While a batch decodes, new requests queue up; the
next batch takes them at once (their wait has already passed). Requests with other settings
keep their place for a later batch. With ``batching=False`` every request is a batch of its
own, in arrival order.

The event loop never decodes, so the health check and the page answer while a batch runs.
The queue holds at most ``max_queue`` texts: beyond, :class:`QueueFull`. A request whose
time runs out leaves the queue (if it has not started). :meth:`Batcher.close` refuses new
requests, finishes every queued one and stops the model thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiayn.inference.steering import Steering
from aiayn.inference.translator import Translation
from aiayn.serving.engine import DecodeKey

T = TypeVar("T")
# The settings, the sources, and one Steering per source (None: nothing steered).
RunBatch = Callable[[DecodeKey, list[list[int]], list[Steering] | None], list[list[Translation]]]

log = logging.getLogger("aiayn.serve")


class QueueFull(Exception):
    """The queue holds ``max_queue`` texts already."""


class Closed(Exception):
    """The batcher is shutting down and takes no new requests."""


@dataclass(eq=False)
class _Job:
    key: DecodeKey | None  # None: an exclusive call (``call``)
    sources: list[list[int]]
    texts: int  # what the job counts in the queue
    tokens: int  # source tokens + EOS, over its texts
    future: asyncio.Future[Any]
    arrived: float
    call: Callable[[], Any] | None = None
    steering: list[Steering] | None = None  # one per source, None: nothing steered


@dataclass
class BatchStats:
    """Counts since start, for ``/v1/health`` and the tests."""

    batches: int = 0
    requests: int = 0
    texts: int = 0
    largest_batch_requests: int = 0
    largest_batch_texts: int = 0
    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=64))

    def record(self, requests: int, texts: int) -> None:
        self.batches += 1
        self.requests += requests
        self.texts += texts
        self.largest_batch_requests = max(self.largest_batch_requests, requests)
        self.largest_batch_texts = max(self.largest_batch_texts, texts)
        self.recent.append((requests, texts))


class Batcher:
    """Gathers requests into batches for ``run_batch`` on one model thread (see the module
    docstring). ``on_thread_start`` runs once on that thread before anything else."""

    def __init__(
        self,
        run_batch: RunBatch,
        *,
        batch_tokens: int,
        max_wait_s: float,
        max_queue: int,
        batching: bool = True,
        on_thread_start: Callable[[], None] | None = None,
    ) -> None:
        self.run_batch = run_batch
        self.batch_tokens = batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.batching = batching
        self.stats = BatchStats()
        self._pending: deque[_Job] = deque()
        self._queued_texts = 0
        self._closing = False
        self._busy = False
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="aiayn-model",
            initializer=on_thread_start,
        )

    @property
    def queued_texts(self) -> int:
        """Texts waiting for a batch (not those being decoded)."""
        return self._queued_texts

    @property
    def busy(self) -> bool:
        """Whether a batch is being decoded now."""
        return self._busy

    @property
    def closing(self) -> bool:
        return self._closing

    # -- requests ------------------------------------------------------------------------------

    async def translate(
        self,
        key: DecodeKey,
        sources: Sequence[Sequence[int]],
        timeout_s: float,
        steering: Sequence[Steering] | None = None,
    ) -> list[list[Translation]]:
        """The results of ``run_batch`` for ``sources`` (``steering``: one per source, or
        None), decoded in a batch with others. QueueFull, Closed, or TimeoutError after
        ``timeout_s``."""
        tokens = sum(len(s) + 1 for s in sources if s)
        job = self._enqueue(key, [list(s) for s in sources], len(sources), tokens, None)
        job.steering = list(steering) if steering is not None and any(steering) else None
        result: list[list[Translation]] = await self._wait(job, timeout_s)
        return result

    async def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """``fn()`` on the model thread, alone, in its turn in the queue (it counts as one
        text). QueueFull, Closed, or TimeoutError after ``timeout_s``."""
        job = self._enqueue(None, [], 1, 0, fn)
        result: T = await self._wait(job, timeout_s)
        return result

    def _enqueue(
        self,
        key: DecodeKey | None,
        sources: list[list[int]],
        texts: int,
        tokens: int,
        call: Callable[[], Any] | None,
    ) -> _Job:
        if self._closing:
            raise Closed("the server is shutting down")
        if self._queued_texts + texts > self.max_queue:
            raise QueueFull(
                f"{self._queued_texts} texts are waiting already (the queue holds {self.max_queue})"
            )
        loop = asyncio.get_running_loop()
        if self._worker is None:
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._work(), name="aiayn-batcher")
            self._worker.add_done_callback(_report_crash)
        job = _Job(key, sources, texts, tokens, loop.create_future(), loop.time(), call)
        self._pending.append(job)
        self._queued_texts += texts
        assert self._wake is not None
        self._wake.set()
        return job

    async def _wait(self, job: _Job, timeout_s: float) -> Any:
        try:
            return await asyncio.wait_for(job.future, timeout_s)
        finally:
            # Timed out (or the request was cancelled) before its batch: out of the queue.
            if job in self._pending:
                self._pending.remove(job)
                self._queued_texts -= job.texts

    # -- the worker ----------------------------------------------------------------------------

    async def _work(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            first = self._pending[0]
            if first.call is None and self.batching:
                await self._gather(first)
                if first not in self._pending:  # it timed out meanwhile
                    continue
            jobs = self._take(first)
            self._busy = True
            try:
                if first.call is not None:
                    result = await loop.run_in_executor(self._executor, first.call)
                    _settle(first.future, result)
                    continue
                assert first.key is not None
                sources = [source for job in jobs for source in job.sources]
                self.stats.record(len(jobs), len(sources))
                steering = _steering(jobs)
                outputs = await loop.run_in_executor(
                    self._executor, self.run_batch, first.key, sources, steering
                )
                start = 0
                for job in jobs:
                    _settle(job.future, outputs[start : start + len(job.sources)])
                    start += len(job.sources)
            except Exception as err:
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(err)
            finally:
                self._busy = False

    async def _gather(self, first: _Job) -> None:
        """Wait until ``first``'s company fills the token budget or its wait is over."""
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        deadline = first.arrived + self.max_wait_s
        while not self._closing and first in self._pending:
            if self._tokens_like(first) >= self.batch_tokens:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
                return

    def _tokens_like(self, first: _Job) -> int:
        return sum(job.tokens for job in self._pending if job.key == first.key and job.call is None)

    def _take(self, first: _Job) -> list[_Job]:
        """``first`` and, when batching, the following jobs with its key within the budget;
        the rest keep their order."""
        if first.call is not None or not self.batching:
            self._pending.popleft()
            self._queued_texts -= first.texts
            return [first]
        taken: list[_Job] = []
        kept: deque[_Job] = deque()
        total = 0
        for job in self._pending:
            fits = not taken or total + job.tokens <= self.batch_tokens
            if job.call is None and job.key == first.key and fits:
                taken.append(job)
                total += job.tokens
                self._queued_texts -= job.texts
            else:
                kept.append(job)
        self._pending = kept
        return taken

    async def close(self) -> None:
        """Take no new requests, finish the queued ones, stop the model thread."""
        self._closing = True
        if self._wake is not None:
            self._wake.set()
        if self._worker is not None:
            await self._worker
        self._executor.shutdown(wait=True)


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():  # a request that timed out while its batch ran
        future.set_result(result)


def _steering(jobs: Sequence[_Job]) -> list[Steering] | None:
    """One Steering per source of ``jobs``, or None where none of them is steered."""
    if all(job.steering is None for job in jobs):
        return None
    return [
        steer
        for job in jobs
        for steer in (job.steering if job.steering is not None else [Steering()] * len(job.sources))
    ]


def _report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the batcher stopped", exc_info=task.exception())
