"""The request scheduler of the built-in server: prompts from every client batched onto one ``EmbeddedEngine``.

Batching: each prompt of each request becomes a ``Job`` on one queue. The scheduler task waits for the first
job, then collects for ``batch_window_s`` (measured from that job's arrival, so jobs that queued up behind a
running batch go at once) or until ``max_batch_size`` sequences, groups the jobs by identical sampling
parameters and runs one ``generate_sync`` per group in a thread of its own; the event loop stays free.

Seeded requests. Jobs with a ``request_key`` (the prompts of one seeded request) only join jobs of the same key,
and they are taken off the queue together or not at all: a seeded request is one ``generate_sync`` of exactly
its prompts, so it gets what ``generate_sync(its prompts, params)`` gives, whatever else is queued and however
the batches happen to fall. (Taking jobs one by one split a 256-sequence request whenever another request's job
was ahead of it in the queue, such as the publish check's probe: its tail then ran as a second call from the
same seed and drew other samples, so a synchronous run depended on timing.) A seeded request larger than
``max_batch_size`` runs alone; the engine splits it into chunks at fixed offsets.

A job's future gets its prompt's ``n`` completions, or None when it was aborted before it ran
(``abort_queued``: all queued jobs, or those of one ``rid``); cancelling it before it runs drops the job.
``on_token(k, token, logprob, finish)`` is called in the generating thread as each token of sample ``k`` is
sampled (app/rollout/embedded.py, "Streaming and early stops"); True ends that sample now (finish "stop"). The
``/v1`` routes use it to stream, to stop at stop strings and to end the samples of a client that went away. A
hook that raises ends its own sample (logged), never the batch.

Weight updates follow SGLang's writer-preferring reader/writer lock (``ReaderWriterLock``, its
``model_update_lock``): every generation request holds a read lock for its whole life, a weight update takes
the write lock, so an update waits for the requests in flight (they finish on the old weights) and new requests
wait for the update. ``pause`` stops scheduling and returns once the running batch (if any) has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from app.rollout.base import SamplingParams
from app.rollout.embedded import EmbeddedEngine

logger = logging.getLogger(__name__)

TokenHook = Callable[[int, int, float, "str | None"], bool]


class ReaderWriterLock:
    """Writer-preferring asyncio RW lock: new readers queue behind a waiting writer."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writers_waiting = 0
        self._writing = False

    @contextlib.asynccontextmanager
    async def read(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def write(self):
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._cond.notify_all()


@dataclass
class Stats:
    generate_calls: int = 0
    """``generate_sync`` calls (one batched generation each)."""
    requests: int = 0
    sequences: int = 0
    largest_batch: int = 0


@dataclass
class Job:
    """One prompt queued for ``params.n`` samples."""

    input_ids: list[int]
    params: SamplingParams
    group: tuple
    """Jobs of one group run in one ``generate_sync``: (params,) or (params, request_key)."""
    future: asyncio.Future
    rid: str | None = None
    """The request's ``rid`` (what ``/abort_request`` names)."""
    on_token: TokenHook | None = None


@dataclass
class Scheduler:
    """Collects queued jobs into batches and runs them on the engine (see the module docstring)."""

    engine: EmbeddedEngine
    max_batch_size: int
    batch_window_s: float
    queue: deque = field(default_factory=deque)  # (arrival time, Job)
    stats: Stats = field(default_factory=Stats)
    paused: bool = False

    def __post_init__(self) -> None:
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        # Generation has a thread of its own: requests being parsed (tokenized) in the default pool never
        # keep a batch waiting for a free worker.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-generate")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="rollout-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)  # a cancel of stop() itself still raises
        self._executor.shutdown(wait=False)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def enqueue(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        on_token: TokenHook | None = None,
        request_key: str | None = None,
        rid: str | None = None,
    ) -> asyncio.Future:
        """Queue one prompt for ``params.n`` samples; the future gets its completions (None: aborted)."""
        group = (params,) if request_key is None else (params, request_key)
        future = asyncio.get_running_loop().create_future()
        self.queue.append((time.monotonic(), Job(list(input_ids), params, group, future, rid, on_token)))
        self._wakeup.set()
        return future

    def abort_queued(self, rid: str | None = None) -> int:
        """Answer the queued (not yet running) jobs with an abort, all of them or those of request ``rid``;
        returns how many."""
        count, kept = 0, deque()
        while self.queue:
            arrival, job = self.queue.popleft()
            if rid is not None and job.rid != rid:
                kept.append((arrival, job))
            elif not job.future.done():
                job.future.set_result(None)  # None = aborted
                count += 1
        self.queue.extend(kept)
        return count

    async def pause(self) -> None:
        self.paused = True
        await self._idle.wait()  # the running batch (if any) finishes first

    def resume(self) -> None:
        self.paused = False
        self._wakeup.set()

    async def _run(self) -> None:
        while True:
            while not self.queue or self.paused:
                self._wakeup.clear()
                await self._wakeup.wait()
            deadline = self.queue[0][0] + self.batch_window_s
            while self._queued_sequences() < self.max_batch_size and not self.paused:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a stop() that arrives as a
                # request wakes the loop, and this loop would then never end.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._wakeup.wait()
            if self.paused or not self.queue:
                continue
            batch = self._take()
            self._idle.clear()
            try:
                await self._execute(batch)
            finally:
                self._idle.set()

    def _queued_sequences(self) -> int:
        return sum(job.params.n for _, job in self.queue)

    def _take(self) -> list[Job]:
        """The next batch: whole units from the head of the queue while they fit in ``max_batch_size`` sequences
        (the first always goes). A unit is one job, or every queued job of one seeded request."""
        batch, sequences = [], 0
        while self.queue:
            head = self.queue[0][1]
            seeded = len(head.group) > 1
            unit = [job for _, job in self.queue if job.group == head.group] if seeded else [head]
            size = sum(job.params.n for job in unit)
            if batch and sequences + size > self.max_batch_size:
                break
            if seeded:
                self.queue = deque(entry for entry in self.queue if entry[1].group != head.group)
            else:
                self.queue.popleft()
            batch += [job for job in unit if not job.future.done()]
            sequences += size
        return batch

    async def _execute(self, batch: list[Job]) -> None:
        groups: dict[tuple, list[Job]] = {}
        for job in batch:
            groups.setdefault(job.group, []).append(job)
        for group in groups.values():
            params = group[0].params
            generate = functools.partial(
                self.engine.generate_sync,
                [job.input_ids for job in group],
                params,
                on_step=_token_hooks(group, params.n),
            )
            try:
                completions = await asyncio.get_running_loop().run_in_executor(self._executor, generate)
            except Exception as exc:  # noqa: BLE001 - reported to the requests of this group, never kills the loop
                logger.exception("generation failed")
                for job in group:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            self.stats.generate_calls += 1
            self.stats.sequences += len(completions)
            self.stats.largest_batch = max(self.stats.largest_batch, len(completions))
            n = params.n
            for k, job in enumerate(group):
                if not job.future.done():
                    job.future.set_result(completions[k * n : (k + 1) * n])


def _token_hooks(group: list[Job], n: int):
    """One ``on_step`` callback forwarding each sampled token to its job's ``on_token``; None if none has one."""
    if all(job.on_token is None for job in group):
        return None

    def on_step(
        seqs: list[int], tokens: list[int], logprobs: list[float], finished: list[str | None]
    ) -> list[int]:
        halted = []
        for seq, token, logprob, reason in zip(seqs, tokens, logprobs, finished, strict=True):
            job, k = group[seq // n], seq % n
            if job.on_token is None:
                continue
            try:
                if job.on_token(k, token, logprob, reason):
                    halted.append(seq)
            except Exception:  # noqa: BLE001 - one request's hook must not break the batch
                logger.exception("token hook failed; ending that sample")
                halted.append(seq)
        return halted

    return on_step
