"""Score a batch of samples with the configured verifiers: routing, weights, time limits, failure isolation.

``RewardRunner(cfg).score(inputs, tasks)`` routes each sample by its task to the verifiers whose ``tasks``
include it, and returns one ``Score`` per sample (reward = weighted sum, breakdown per verifier) and the metrics
``reward/mean``, ``reward/error_rate``, ``reward/timeout_rate``, ``reward/<verifier>/mean``,
``reward/<verifier>/correct`` and, for verifiers that report what they extracted (math, code),
``reward/<verifier>/answer_rate``: the share of samples with an answer found (format compliance).

How failures are contained (a broken completion never stops training):
- **Exceptions** in a verifier become ``Score(reward=error_reward, error="ExcType: message")``.
- **Time limits, two layers.** Inside each worker process (its main thread, where signals work) every verifier
  call runs under ``rewards.time_limit`` (SIGALRM via setitimer); that stops Python-level hangs such as
  math-verify on ``9^{9^{9^{9}}}`` and the worker carries on. A hang the alarm cannot interrupt (one long C call)
  is caught from outside: each worker publishes the sample it is on and when it started in shared memory, and
  the parent kills the worker ``kill_grace_s`` after the sample's limit, scores that sample as a timeout, and
  gives the rest of the worker's samples to a fresh worker.
- **Crashes.** A worker that dies (``os._exit``, a segfault, the OOM killer) is replaced the same way; the
  sample it was on gets an error score.

Throughput: samples travel in chunks (one message each way per chunk, plus a partial flush every 50 ms for slow
chunks, so a killed worker loses little finished work); a sample goes to the worker its reference hashes to, so
every sample with one gold answer hits one worker's caches (idle workers steal chunks to keep the balance);
workers start once and stay warm.

``num_workers=0`` scores in the calling process, for tests and debugging: the time limit then holds only in the
main thread and only for Python-level hangs, and a crash takes the caller with it.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import pickle
import threading
import time
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from rewards.config import RewardsConfig, VerifierSpec
from rewards.registry import resolve_factory
from rewards.time_limit import TimeLimitExceeded, can_enforce, time_limit
from rewards.types import Score, Verifier, VerifierInput

logger = logging.getLogger(__name__)

_FLUSH_S = 0.05  # a worker sends finished results at least this often while a chunk is slow
_MAX_ATTEMPTS = 3  # a sample caught in this many dead workers (without being the cause) is given up
_MAX_START_FAILURES = 3  # workers that fail to start in a row before the runner gives up
_START_TIMEOUT_S = 120.0  # a worker not ready by then (a factory that hangs) counts as failed to start


# ---------------------------------------------------------------- one verifier call (worker and in-process)


def _call_verifier(verifier: Verifier, sample: VerifierInput, limit_s: float, label: str) -> Score:
    """One verifier on one sample, with its time limit; never raises except for an outer time limit."""
    with time_limit(limit_s, f"verifier {label!r}") as mine:
        try:
            score = verifier(sample)
        except TimeLimitExceeded as e:
            if e is not mine:
                raise
            return Score(
                math.nan, None, {}, error=f"timeout: verifier {label!r} took more than {limit_s:g} s"
            )
        except (Exception, SystemExit) as e:  # SystemExit: a verifier calling sys.exit must not end the run
            return Score(math.nan, None, {}, error=f"{type(e).__name__}: {e}"[:1000])
    if not isinstance(score, Score):
        return Score(
            math.nan, None, {}, error=f"verifier {label!r} returned {type(score).__name__}, not a Score"
        )
    try:
        reward = float(score.reward)
    except (TypeError, ValueError):
        reward = math.nan
    if not math.isfinite(reward) and score.error is None:
        return Score(
            math.nan, None, {}, error=f"verifier {label!r} returned a non-finite reward {score.reward!r}"
        )
    return score


# ---------------------------------------------------------------- worker process


def _worker_main(
    conn: Connection,
    progress: Any,
    factories: list[Any],
    params: list[dict[str, Any]],
    labels: list[str],
    memory_mb: int,
) -> None:
    """A scoring process: builds the verifiers once, then scores chunks until told to stop or the pipe closes.

    ``progress`` is shared memory [sample seq or -1, time.monotonic() when it started], read by the parent's
    watchdog. ``conn`` carries ("chunk", items) in and ("ready",), ("results", [(seq, scores)], done) out.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then stops us
    _die_with_parent()
    if memory_mb > 0:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        soft = memory_mb * 2**20
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    try:
        verifiers = [factory(**p) for factory, p in zip(factories, params, strict=True)]
        for verifier in verifiers:
            warmup = getattr(verifier, "warmup", None)
            if callable(warmup):
                warmup()
    except BaseException as e:  # reported to the parent, which decides whether to give up
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            return
        items = message[1]
        out: list[tuple[int, list[Score]]] = []
        last_flush = time.monotonic()
        for seq, sample, plan in items:
            progress[1] = time.monotonic()
            progress[0] = seq
            scores = [_call_verifier(verifiers[i], sample, limit, labels[i]) for i, limit in plan]
            out.append((seq, scores))
            if time.monotonic() - last_flush > _FLUSH_S:
                conn.send(("results", out, False))
                out, last_flush = [], time.monotonic()
        progress[0] = -1
        conn.send(("results", out, True))


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when its parent dies, even mid-computation."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass(eq=False)  # workers compare by identity
class _Worker:
    process: Any
    conn: Connection
    progress: Any
    ready: bool = False
    assigned: set[int] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)


# ---------------------------------------------------------------- the runner


class RewardRunner:
    """Scores batches of samples with the verifiers of a RewardsConfig; see the module docstring.

    Verifiers are built here once (so bad names and params fail at start-up) and, with ``num_workers >= 1``,
    once more in each worker process. Use as a context manager or call ``close()``.
    """

    def __init__(self, cfg: RewardsConfig) -> None:
        self.cfg = cfg
        self.specs: list[VerifierSpec] = list(cfg.verifiers)
        self.labels = [spec.key for spec in self.specs]
        self._factories = [resolve_factory(spec.name) for spec in self.specs]
        self._verifiers: list[Verifier] = []
        for i, (spec, factory) in enumerate(zip(self.specs, self._factories, strict=True)):
            try:
                self._verifiers.append(factory(**spec.params))
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"rewards.verifiers[{i}] ({spec.name!r}): bad params {spec.params!r}: {e}"
                ) from e
        self._limits = [spec.timeout_s or cfg.timeout_s for spec in self.specs]
        self._routes: dict[str, list[int]] = {}
        for i, spec in enumerate(self.specs):
            for task in spec.tasks:
                self._routes.setdefault(task, []).append(i)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._start_failures = 0
        self.restarts = 0
        """Workers replaced so far (killed for a hang, or crashed)."""
        self._closed = False
        self._warned_thread = False
        if cfg.num_workers > 0:
            for i, (spec, factory) in enumerate(zip(self.specs, self._factories, strict=True)):
                try:
                    pickle.dumps((factory, spec.params))
                except Exception as e:
                    raise ValueError(
                        f"rewards.verifiers[{i}] ({spec.name!r}): its factory or params cannot be sent to a worker "
                        f"process ({e}); define the factory at module level in an importable module, "
                        "or set rewards.num_workers=0"
                    ) from e
            self._ctx = mp.get_context(cfg.start_method)
            self._workers = [self._start_worker() for _ in range(cfg.num_workers)]

    # -- lifecycle
    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        progress = self._ctx.RawArray("d", [-1.0, 0.0])
        process = self._ctx.Process(
            target=_worker_main,
            args=(
                child_conn,
                progress,
                self._factories,
                [spec.params for spec in self.specs],
                self.labels,
                self.cfg.worker_memory_mb,
            ),
            name="trustbatch-reward-worker",
            daemon=True,
        )
        process.start()
        child_conn.close()
        return _Worker(process, parent_conn, progress)

    def _stop_worker(self, worker: _Worker, kill: bool) -> None:
        if not kill:
            try:
                worker.conn.send(("stop",))
            except (OSError, ValueError):
                pass
            worker.process.join(timeout=1.0)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(timeout=5.0)
        worker.conn.close()

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            self._stop_worker(worker, kill=False)
        self._workers = []

    def kill(self) -> None:
        """SIGKILL the worker processes now (the process is about to exit without its clean-up)."""
        for worker in self._workers:
            try:
                worker.process.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (they change when a hung or crashed worker is replaced)."""
        return [w.process.pid for w in self._workers]

    # -- routing
    def route(self, inputs: Sequence[VerifierInput], tasks: Sequence[str] | None) -> list[list[int]]:
        """The verifier indices of each sample; ValueError for a task no verifier scores."""
        if tasks is not None and len(tasks) != len(inputs):
            raise ValueError(
                f"score(): got {len(inputs)} inputs but {len(tasks)} tasks; pass one task per input"
            )
        default = next(iter(self._routes)) if len(self._routes) == 1 else None
        plans = []
        for i, sample in enumerate(inputs):
            task = tasks[i] if tasks is not None else (sample.metadata or {}).get("task", default)
            if task is None:
                raise ValueError(
                    f"sample {i} has no task and rewards.verifiers score several tasks {list(self._routes)}: "
                    "set metadata['task'] on each input or pass tasks= to score()"
                )
            if task not in self._routes:
                raise ValueError(
                    f"sample {i} has task {task!r}, which no verifier scores; rewards.verifiers score tasks "
                    f"{list(self._routes)}. Add {task!r} to a verifier's tasks or add a verifier for it."
                )
            plans.append(self._routes[task])
        return plans

    # -- scoring
    def score(
        self, inputs: Sequence[VerifierInput], tasks: Sequence[str] | None = None
    ) -> tuple[list[Score], dict[str, float]]:
        """Score every input; returns one Score per input (same order) and the batch metrics.

        ``tasks[i]`` (or else ``inputs[i].metadata["task"]``; or else the only configured task) picks the
        verifiers of sample i. Never raises for a verifier failure, only for bad input (an unknown task).
        """
        if self._closed:
            raise RuntimeError("RewardRunner.score() after close(); build a new runner")
        plans = self.route(inputs, tasks)
        start = time.perf_counter()
        restarts_before = self.restarts
        with self._lock:
            if self.cfg.num_workers == 0:
                raw = self._score_in_process(inputs, plans)
            else:
                try:
                    raw = self._score_in_pool(inputs, plans)
                except BaseException:
                    self._reset_pool()  # interrupted mid-batch: workers hold stale work
                    raise
        scores, metrics = self._combine(raw, plans)
        metrics["timing/reward/score"] = time.perf_counter() - start
        metrics["reward/worker_restarts"] = float(self.restarts - restarts_before)
        return scores, metrics

    def _score_in_process(self, inputs: Sequence[VerifierInput], plans: list[list[int]]) -> list[list[Score]]:
        if not can_enforce() and not self._warned_thread:
            logger.warning(
                "rewards.num_workers=0 off the main thread: verifier time limits cannot be enforced here; "
                "use rewards.num_workers >= 1"
            )
            self._warned_thread = True
        return [
            [_call_verifier(self._verifiers[i], sample, self._limits[i], self.labels[i]) for i in plan]
            for sample, plan in zip(inputs, plans, strict=True)
        ]

    def _partition(self, inputs: Sequence[VerifierInput]) -> list[deque[list[int]]]:
        """Per-worker queues of chunks; a sample goes to the worker its reference hashes to.

        Affinity by reference keeps each gold answer in one worker, so that worker's caches (parsed gold,
        verdicts) serve every later sample with that gold; idle workers steal chunks, so a skewed split or a
        slow worker costs balance, not correctness.
        """
        workers = len(self._workers)
        owned: list[list[int]] = [[] for _ in range(workers)]
        for seq, sample in enumerate(inputs):
            owned[zlib.crc32(repr(sample.reference).encode("utf-8", "replace")) % workers].append(seq)
        size = self.cfg.chunk_size or max(1, math.ceil(len(inputs) / (4 * workers)))
        return [deque(seqs[s : s + size] for s in range(0, len(seqs), size)) for seqs in owned]

    def _reset_pool(self) -> None:
        for worker in self._workers:
            self._stop_worker(worker, kill=True)
        self._workers = [self._start_worker() for _ in range(self.cfg.num_workers)]

    def _score_in_pool(self, inputs: Sequence[VerifierInput], plans: list[list[int]]) -> list[list[Score]]:
        n = len(inputs)
        results: list[list[Score] | None] = [None] * n
        sample_plans = [[(i, self._limits[i]) for i in plan] for plan in plans]
        hard_limit = [sum(limit for _, limit in p) + self.cfg.kill_grace_s for p in sample_plans]
        attempts = [0] * n
        pending = self._partition(inputs)
        remaining = n

        def fail(seq: int, error: str) -> None:
            nonlocal remaining
            if results[seq] is None:
                results[seq] = [Score(math.nan, None, {}, error=error) for _ in sample_plans[seq]]
                remaining -= 1

        def replace(worker: _Worker, culprit: int | None, error: str) -> None:
            """Kill (if needed) and replace `worker`; score `culprit` as `error`, requeue the rest."""
            self._stop_worker(worker, kill=True)
            self.restarts += 1
            if culprit is not None:
                fail(culprit, error)
            requeue = []
            for seq in sorted(worker.assigned - {culprit}):
                attempts[seq] += 1
                if attempts[seq] >= _MAX_ATTEMPTS:
                    fail(seq, f"{error} (a worker died {attempts[seq]} times with this sample queued)")
                else:
                    requeue.append(seq)
            index = self._workers.index(worker)
            if requeue:
                pending[index].appendleft(requeue)
            self._workers[index] = self._start_worker()

        while remaining:
            for index, worker in enumerate(self._workers):
                if not worker.ready or worker.assigned:
                    continue
                if pending[index]:
                    chunk = pending[index].popleft()
                else:  # idle: take the last chunk of the longest queue (its owner is slow or gone)
                    longest = max(pending, key=len)
                    if not longest:
                        continue
                    chunk = longest.pop()
                worker.assigned = set(chunk)
                try:
                    worker.conn.send(("chunk", [(seq, inputs[seq], sample_plans[seq]) for seq in chunk]))
                except OSError:
                    pass  # it died: its sentinel is ready and the chunk is requeued below
            now = time.monotonic()
            deadline = now + 1.0
            for worker in self._workers:
                seq = int(worker.progress[0])
                if seq in worker.assigned:
                    deadline = min(deadline, worker.progress[1] + hard_limit[seq])
            by_handle: dict[Any, _Worker] = {}
            for worker in self._workers:
                by_handle[worker.conn] = worker
                by_handle[worker.process.sentinel] = worker
            for handle in wait(list(by_handle), timeout=max(deadline - now, 0.001)):
                worker = by_handle[handle]
                if worker not in self._workers:
                    continue  # replaced while handling an earlier handle of this round
                died = False
                start_error = None
                try:
                    while worker.conn.poll():  # read what it sent before dying, too
                        message = worker.conn.recv()
                        if message[0] == "ready":
                            worker.ready = True
                            self._start_failures = 0
                        elif message[0] == "failed":
                            start_error = message[1]
                            died = True
                            break
                        else:
                            for seq, scores in message[1]:
                                if seq in worker.assigned and results[seq] is None:
                                    results[seq] = scores
                                    remaining -= 1
                                worker.assigned.discard(seq)
                except (EOFError, OSError):
                    died = True
                if died or not worker.process.is_alive():
                    worker.process.join(timeout=1.0)
                    if not worker.ready:
                        self._start_failures += 1
                        if self._start_failures >= _MAX_START_FAILURES:
                            raise RuntimeError(
                                f"{self._start_failures} reward workers in a row failed to start "
                                f"(last: {start_error or f'exit code {worker.process.exitcode}'}); "
                                "check that the verifier factories build outside this process, "
                                "or set rewards.num_workers=0 to debug in-process"
                            )
                    seq = int(worker.progress[0])
                    culprit = seq if seq in worker.assigned else None
                    code = worker.process.exitcode
                    replace(
                        worker, culprit, f"worker process died (exit code {code}) while scoring this sample"
                    )
            now = time.monotonic()
            for worker in list(self._workers):
                if not worker.ready and now - worker.started > _START_TIMEOUT_S:
                    self._start_failures += 1
                    if self._start_failures >= _MAX_START_FAILURES:
                        raise RuntimeError(
                            f"{self._start_failures} reward workers in a row were not ready within "
                            f"{_START_TIMEOUT_S:g} s; a verifier factory may hang (try rewards.num_workers=0)"
                        )
                    replace(worker, None, "reward worker did not start in time")
                    continue
                seq = int(worker.progress[0])
                if seq in worker.assigned and now > worker.progress[1] + hard_limit[seq]:
                    limit = hard_limit[seq] - self.cfg.kill_grace_s
                    replace(
                        worker,
                        seq,
                        f"timeout: sample exceeded its {limit:g} s limit and its worker was killed",
                    )
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    # -- weights, breakdowns, metrics
    def _combine(
        self, raw: list[list[Score]], plans: list[list[int]]
    ) -> tuple[list[Score], dict[str, float]]:
        cfg = self.cfg
        scores: list[Score] = []
        errors = timeouts = 0
        per_reward: dict[str, list[float]] = {label: [] for label in self.labels}
        per_correct: dict[str, list[bool]] = {label: [] for label in self.labels}
        per_answered: dict[str, list[bool]] = {label: [] for label in self.labels}
        for sample_scores, plan in zip(raw, plans, strict=True):
            breakdown: dict[str, Any] = {}
            failures: list[str] = []
            total = 0.0
            correct: bool | None = None
            for i, s in zip(plan, sample_scores, strict=True):
                label = self.labels[i]
                reward = cfg.error_reward if s.error else float(s.reward)
                breakdown[label] = {**s.breakdown, "reward": reward, "correct": s.correct}
                if s.error:
                    breakdown[label]["error"] = s.error
                    failures.append(f"{label}: {s.error}")
                total += self.specs[i].weight * reward
                per_reward[label].append(reward)
                if s.correct is not None:
                    per_correct[label].append(bool(s.correct))
                if "extracted" in s.breakdown and not s.error:
                    per_answered[label].append(s.breakdown["extracted"] is not None)
                if correct is None and s.correct is not None and not s.error:
                    correct = bool(s.correct)  # the task's first verifier that judges correctness decides
            if failures:
                errors += 1
                timeouts += any(f.split(": ", 1)[1].startswith("timeout") for f in failures)
                scores.append(Score(cfg.error_reward, None, breakdown, error="; ".join(failures)))
            else:
                scores.append(Score(total, correct, breakdown, None))
        n = len(scores)
        metrics: dict[str, float] = {}
        if n:
            metrics["reward/mean"] = sum(s.reward for s in scores) / n
            metrics["reward/error_rate"] = errors / n
            metrics["reward/timeout_rate"] = timeouts / n
        for label in self.labels:
            if per_reward[label]:
                metrics[f"reward/{label}/mean"] = sum(per_reward[label]) / len(per_reward[label])
                metrics[f"reward/{label}/correct"] = sum(per_correct[label]) / len(per_reward[label])
            if per_answered[label]:  # format compliance: an answer (a boxed number, a code block) was found
                metrics[f"reward/{label}/answer_rate"] = sum(per_answered[label]) / len(per_answered[label])
        return scores, metrics
