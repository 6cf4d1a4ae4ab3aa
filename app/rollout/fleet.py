"""The run's rollout engines under supervision: generation that survives a server dying or hanging.

A ``Fleet`` wraps the one RolloutEngine of a rank (the SGLang client over one or more servers, or the embedded
engine) and, when the run started the servers itself (``rollout.engine=local``, or SGLang launched from the
config), the server processes (`app.rollout.process.ServerProcess`). The loop only ever calls ``connect``,
``generate``, ``publish``, ``flush`` and ``close``.

Publication (the fleet is the one owner of getting each new policy version onto the engines):
``await fleet.publish(model, version)`` snapshots the weights (they must be copied before the next optimizer step
changes them) and returns; the push to the engines runs in the background, one version after another, and calls
``PublishHooks.held(version)`` (the loop's policy clock advances) when every engine holds it. ``flush()`` waits
for the pushes; with ``wait_for_push`` (``rollout.max_lag=0``, nothing to overlap with) ``publish`` does. How a
version travels is chosen here, from the engine and ``rollout.sglang.weight_sync``:

- **disk** (HTTP servers, ``method=disk``): every rank gathers, rank 0 writes ``weights_dir/v<N>/`` (an HF
  directory, `app.rollout.joint.save_version`), and each rank's servers load it (/update_weights_from_disk).
  The three newest versions stay on disk (a restarted server starts from the newest), older ones are removed;
- **adapters** (SGLang on GPUs, ``rollout.sglang.lora_adapters``, a LoRA run): every rank gathers the LoRA
  matrices alone, rank 0 writes ``weights_dir/v<N>/`` as a PEFT adapter directory
  (`app.rollout.joint.save_adapter_version`), each rank's servers load it (/load_lora_adapter) and every later
  request names it; once the version is checked, adapters older than the newest ``adapters`` (``max_lag + 1``)
  are unloaded (best effort). A restarted server starts from the base model and gets the resident adapters;
  the newest ``max(3, adapters + 1)`` version directories stay on disk (SGLang reloads an adapter a late
  request names from its directory);
- **distributed** (SGLang, ``method=distributed``): every rank gathers and casts the state dict
  (`app.rollout.joint.gather_weights`) and broadcasts it to its own servers over NCCL/gloo
  (app/rollout/weight_sync.py); nothing touches the file system;
- **in memory** (the embedded engine): the same gathered state dict, loaded in process.

Under FSDP2 the gather is a collective: every rank calls ``publish`` for every version. A push that fails for
good calls ``PublishHooks.failed`` (the loop closes its buffer: rollouts wait for the version, so training must
stop) and then raises from ``flush``. ``PublishHooks.gate`` (``rollout.exact_lag``) is awaited before each push.
``connect`` hands a resumed run's weights (``latest``) to servers it did not start.

Failures (a rollout server that dies or hangs is detected, then restarted or reported):
- **A started server dies** (killed, crashed, OOM): the watchdog sees the process exit within
  ``rollout.watchdog_interval_s`` and starts it again on the same port, serving the newest published weights
  with their version label, so it needs no separate weight push and reports the right ``policy_version``.
- **A started server hangs** (alive but not answering): the watchdog probes ``GET /health`` every
  ``watchdog_interval_s``; after ``hang_timeout_s`` without a healthy answer it kills the process (SIGKILL)
  and restarts it as above. Requests stuck on it fail with connection errors at once.
- **Requests lost** to either: the SGLang client retries them (back-off, next server); when its retries run
  out, ``generate`` waits for the fleet to heal and *resubmits* the whole call (same prompts, same seed).
  A weight push is re-sent after healing.
- **A server given by URL** (the run cannot restart it) that stays down: ``generate`` and a push wait up to
  ``rollout.sglang.health_timeout_s`` for it to answer ``/health`` again, then raise ``FleetDownError``
  naming the server, the time waited and what was tried; the run stops there, and its checkpoints (written
  atomically) are intact.
- ``max_restarts`` bounds restarts over the whole run (a server that dies at every start is a bug to report,
  not to retry forever).

Counters for metrics: ``restarts``, ``resubmits``; ``busy`` measures the wall time with a generation in flight;
``last_sync_s`` is how long the latest completed push took.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from app.rollout import joint
from app.rollout.base import Completion, RolloutEngine, SamplingParams, WeightSource
from app.rollout.probe import PublishCheck
from app.rollout.process import ServerProcess
from app.rollout.sglang import RolloutServerError, SGLangClient, WeightSyncConfig
from app.rollout.weight_sync import DistributedWeightSync, WeightSyncError

log = logging.getLogger(__name__)
R = TypeVar("R")


class FleetDownError(RuntimeError):
    """The rollout servers could not be brought back (given by URL and down too long, or out of restarts)."""


KEEP_VERSIONS = 3
"""Versions kept in ``weights_dir``: older ones are no longer loaded by any rank's servers, nor restarted from."""


@dataclass
class PublishHooks:
    """What the training side gives the fleet's publication: callbacks, so app/rollout needs none of its types."""

    held: Callable[[int], Awaitable[None]]
    """Awaited with each version once every engine holds it (the loop advances its policy clock)."""
    failed: Callable[[BaseException], Awaitable[None]]
    """Awaited with the error of a push that failed for good (the loop closes its buffer: training stops)."""
    gate: Callable[[int], Awaitable[None]] | None = None
    """Awaited before a version is pushed (``rollout.exact_lag``: the generated-watermark); None: push at once."""


@dataclass
class SupervisionConfig:
    """How the run watches the rollout servers it started (``rollout.supervision.*``)."""

    watchdog_interval_s: float = 1.0
    """How often the watchdog checks that each started server process is alive and probes its /health."""
    hang_timeout_s: float = 60.0
    """A started server that has not answered /health with 200 for this long is killed and restarted."""
    max_restarts: int = 5
    """Server restarts allowed over the whole run; past them the run stops with an error."""
    max_resubmits: int = 5
    """Times one generate call is resubmitted after the fleet healed, before the run stops."""

    def __post_init__(self) -> None:
        for name in ("watchdog_interval_s", "hang_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.supervision.{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("max_restarts", "max_resubmits"):
            if getattr(self, name) < 0:
                raise ValueError(f"rollout.supervision.{name} must be >= 0, got {getattr(self, name)}")


class BusyMeter:
    """Wall time during which at least one operation was in flight (overlapping ones count once)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._active = 0
        self._since = 0.0

    @contextlib.contextmanager
    def busy(self):
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self.total_s += time.perf_counter() - self._since

    def read(self) -> float:
        """Busy seconds so far, including the current stretch."""
        return self.total_s + (time.perf_counter() - self._since if self._active else 0.0)


class Fleet:
    """One rank's rollout engine and the servers it started; see the module docstring.

    Args:
        engine: the RolloutEngine (an SGLangClient for HTTP servers).
        servers: processes this run started and may restart (empty: servers given by URL, or in-process).
        cfg: watchdog and restart limits.
        health_timeout_s: how long to wait for servers given by URL to come back.
        weight_sync: ``rollout.sglang.weight_sync``; its distributed method broadcasts each version.
        weights_dir: where versions are saved for HTTP servers that load them from disk (one folder a version,
            written by rank 0 and read by every rank's servers: one machine, or a filesystem they share).
        tokenizer: saved with each version on disk (the servers load a complete HF directory).
        is_main: this rank writes the files (rank 0).
        wait_for_push: ``publish`` returns only once every engine holds the version (``rollout.max_lag=0``).
        check: the probe that verifies every published version on every engine (app/rollout/probe.py); None: off.
        adapters: publish LoRA adapters, keeping this many versions resident on the servers (``max_lag + 1``);
            0: full weights.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        servers: list[ServerProcess],
        cfg: SupervisionConfig,
        *,
        health_timeout_s: float,
        weight_sync: WeightSyncConfig | None = None,
        weights_dir: Path | None = None,
        tokenizer: object = None,
        is_main: bool = True,
        wait_for_push: bool = False,
        check: PublishCheck | None = None,
        adapters: int = 0,
    ) -> None:
        if adapters and not isinstance(engine, SGLangClient):
            raise ValueError("adapter publication needs SGLang servers (rollout.sglang.lora_adapters)")
        self.engine, self.servers, self.cfg = engine, list(servers), cfg
        self.adapters = adapters
        self.health_timeout_s = health_timeout_s
        self.weight_sync = weight_sync if weight_sync is not None and weight_sync.method == "distributed" else None
        """Set: in-memory weights are broadcast to the SGLang servers over a process group (NCCL/gloo)."""
        self.weights_dir, self.tokenizer, self.is_main = weights_dir, tokenizer, is_main
        self.wait_for_push = wait_for_push
        self.check = check
        self.check_retries = 0
        """Versions that failed the check once and were published again."""
        self._sync: DistributedWeightSync | None = None
        self._sync_restarts = 0
        self.restarts = 0
        self.resubmits = 0
        self.busy = BusyMeter()
        self.last_sync_s = 0.0
        """Seconds the latest completed push took (the snapshot excluded)."""
        self.latest: tuple[Path, int] | None = None
        """The newest weights on disk (directory, version): what a restarted server starts from."""
        self.latest_adapter: tuple[Path, int] | None = None
        """The newest adapter (directory, version), with ``adapters``: what a restarted server is given."""
        self._hooks: PublishHooks | None = None
        self._push: asyncio.Task | None = None
        self._healthy = asyncio.Event()
        self._healthy.set()
        self._fatal: BaseException | None = None
        self._watchdog: asyncio.Task | None = None
        self._watchdog_stopping = False

    @property
    def http(self) -> bool:
        return isinstance(self.engine, SGLangClient)

    # ------------------------------------------------------------------ what the loop calls

    async def connect(self, hooks: PublishHooks, model: torch.nn.Module | None = None, version: int = 0) -> None:
        """Wait for the servers, hand a resumed run's weights to servers it did not start, check that every
        engine serves ``model``'s weights (``version``; the check's start, which sets its tolerance), start the
        watchdog; ``hooks`` serve every later ``publish``. Every rank calls it (the check's forward is a
        collective under FSDP2)."""
        self._hooks = hooks
        if self.http:
            assert isinstance(self.engine, SGLangClient)
            await self.engine.wait_healthy()
        if self.latest is not None and not self.servers:
            path, version = self.latest
            await self._load(WeightSource(path=path), version)
        if self.latest_adapter is not None:  # a resumed LoRA run: every server starts from the base model
            path, version = self.latest_adapter
            await self._load(WeightSource(path=path, adapter=True), version)
        if self.check is not None and model is not None:
            if self.weight_sync is not None and self.weight_sync.dtype not in (None, "float32"):
                # Versions will arrive cast (weight_sync.dtype): send the start weights the same way, so that the
                # start gap, and the tolerance taken from it, include the cast.
                state = await asyncio.to_thread(joint.gather_weights, model, dtype=self.weight_sync.dtype)
                await self._load(WeightSource(state_dict=state), version)
            reference = await asyncio.to_thread(self.check.reference, model)
            readings = await self._survive(lambda: self.engine.score(self.check.ids), "the weight check")
            self.check.start(readings, reference, version)
        self.start_watchdog()

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, progress: Callable[[int], None] | None = None
    ) -> list[Completion]:
        """``engine.generate``, resubmitted after the fleet heals when servers fail (module docstring)."""
        with self.busy.busy():
            return await self._survive(lambda: self.engine.generate(prompts, params, progress=progress), "generate")

    async def publish(self, model: torch.nn.Module, version: int) -> None:
        """Snapshot ``model``'s weights as policy ``version`` and push them to every engine in the background
        (module docstring); every rank calls it. Returns once the snapshot is taken (saved on disk, or gathered
        in memory), or with ``wait_for_push`` once every engine holds the version."""
        if self._hooks is None:
            raise RuntimeError("Fleet.connect(hooks) must come before publish")
        if self.adapters:
            assert self.weights_dir is not None, "adapters travel on disk: they need a weights_dir"
            path = self.weights_dir / f"v{version}"
            await asyncio.to_thread(joint.save_adapter_version, model, path, is_main=self.is_main)
            source = WeightSource(path=path, adapter=True)
        elif self.on_disk:
            assert self.weights_dir is not None, "HTTP servers that load from disk need a weights_dir"
            path = self.weights_dir / f"v{version}"
            await asyncio.to_thread(joint.save_version, model, self.tokenizer, path, is_main=self.is_main)
            source = WeightSource(path=path)
        else:  # the embedded engine, or a broadcast over NCCL/gloo
            dtype = self.weight_sync.dtype if self.weight_sync is not None else None
            source = WeightSource(state_dict=await asyncio.to_thread(joint.gather_weights, model, dtype=dtype))
        # What the engines must score the probe as: taken now, before the next optimizer step changes the model.
        reference = await asyncio.to_thread(self.check.reference, model) if self.check is not None else None
        previous = self._push
        self._push = asyncio.create_task(
            self._push_after(previous, source, version, reference), name=f"publish-{version}"
        )
        if self.wait_for_push:
            await self.flush()

    async def flush(self) -> None:
        """Wait until every published version is held by every engine (raises a push's error)."""
        if self._push is not None:
            await self._push

    @property
    def on_disk(self) -> bool:
        """Versions travel as HF directories (update_weights_from_disk), not as in-memory tensors."""
        return self.http and self.weight_sync is None

    # ------------------------------------------------------------------ pushing a version

    async def _push_after(
        self, previous: asyncio.Task | None, source: WeightSource, version: int, reference: list[float] | None
    ) -> None:
        assert self._hooks is not None
        if previous is not None:
            await previous
        if self._hooks.gate is not None:
            await self._hooks.gate(version)
        t0 = time.perf_counter()
        try:
            await self._load(source, version)
        except Exception as exc:
            await self._hooks.failed(exc)  # rollouts wait for this version: without it nothing would move again
            raise
        self.last_sync_s = time.perf_counter() - t0
        await self._hooks.held(version)
        if reference is not None:
            try:
                await self._verify(source, version, reference)
            except Exception as exc:
                await self._hooks.failed(exc)
                raise
        if self.adapters:  # best effort: SGLang's --max-loaded-loras evicts the least recently used anyway
            assert isinstance(self.engine, SGLangClient)
            try:
                await self._survive(lambda: self.engine.unload_adapters(self.adapters), "unloading old adapters")
            except Exception as exc:  # noqa: BLE001 - the version is held and checked; an old adapter may stay
                log.warning("unloading adapters older than version %d failed: %s", version, exc)
        if source.path is not None and self.is_main and self.weights_dir is not None:
            # SGLang reloads an adapter it evicted from its directory when a request names it: keep those.
            keep = max(KEEP_VERSIONS, self.adapters + 1)
            for old in self.weights_dir.glob("v*"):
                if old.name[1:].isdigit() and int(old.name[1:]) <= version - keep:
                    shutil.rmtree(old, ignore_errors=True)

    async def _verify(self, source: WeightSource, version: int, reference: list[float]) -> None:
        """The publish check (app/rollout/probe.py): every engine scores the probe as the trainer's ``version``
        does; a version that fails is loaded once more and checked again, then PublishCheckError."""
        assert self.check is not None
        for attempt in range(2):
            readings = await self._survive(lambda: self.engine.score(self.check.ids), "the weight check")
            problems = self.check.failures(readings, reference, version)
            if not problems:
                return
            if attempt == 1:
                raise self.check.error(problems, version)
            log.warning("weight check of version %d failed (%s); publishing it again", version, "; ".join(problems))
            self.check_retries += 1
            await self._load(source, version)
        raise AssertionError("unreachable")

    async def _load(self, source: WeightSource, version: int) -> None:
        """Load ``source`` as ``version`` on every engine; a restarted server starts from it (disk only: under
        the distributed method a restarted server serves its start weights until the next push, and the
        staleness bound drops what it generates before then)."""
        if source.adapter:
            self.latest_adapter = (Path(source.path), int(version))
        elif source.path is not None:
            self.latest = (Path(source.path), int(version))
        if self.weight_sync is not None and source.state_dict is not None:
            await self._survive(lambda: self._to_workers(lambda: self._broadcast(source.state_dict, version)),
                                "a weight broadcast")  # fmt: skip
        else:
            await self._survive(lambda: self._to_workers(lambda: self.engine.update_weights(source, version)),
                                "a weight update")  # fmt: skip

    async def _to_workers(self, call: Callable[[], Awaitable[R]]) -> R:
        """``call()``; behind a router, first take as ``engine.urls`` the workers it lists that answer now
        (app/rollout/router.py), so each attempt, a resubmission too, reaches the workers alive at that moment.
        A changed membership ends the distributed group first, while ``urls`` still names its members."""
        engine = self.engine
        if isinstance(engine, SGLangClient) and engine.router is not None:
            workers = await engine.healthy_workers()
            if workers != engine.urls:
                if self._sync is not None:
                    with contextlib.suppress(Exception):  # a dead member cannot leave; its group dies with it
                        await self._sync.close()
                    self._sync = None
                engine.urls = workers
        return await call()

    async def _broadcast(self, state_dict: dict, version: int) -> None:
        assert isinstance(self.engine, SGLangClient) and self.weight_sync is not None
        if self._sync is not None and (self._sync.broken or self._sync_restarts != self.restarts):
            # A restarted server left the group, and a failed push leaves it unusable: form a new one.
            with contextlib.suppress(Exception):
                await self._sync.close()
            self._sync = None
        if self._sync is None:
            self._sync = await DistributedWeightSync.connect(self.engine, self.weight_sync)
            self._sync_restarts = self.restarts
        await self._sync.push(state_dict, version)
        self.engine.policy_version = int(version)

    async def _survive(self, call: Callable[[], Awaitable[R]], what: str) -> R:
        for attempt in range(self.cfg.max_resubmits + 1):
            await self._healthy.wait()
            self._raise_if_fatal()
            try:
                return await call()
            except (RolloutServerError, WeightSyncError) as exc:
                if attempt == self.cfg.max_resubmits:
                    raise FleetDownError(
                        f"{what} failed {attempt + 1} times although the rollout servers were restarted or "
                        f"came back in between (rollout.supervision.max_resubmits={self.cfg.max_resubmits}); "
                        f"last error: {exc}"
                    ) from exc
                log.warning("%s failed (%s); waiting for the rollout servers to recover, then resubmitting", what, exc)
                await self._heal(exc)
                self.resubmits += 1
        raise AssertionError("unreachable")

    async def _heal(self, exc: BaseException) -> None:
        if self.servers:
            # The watchdog restarts dead or hung processes; give it the time a restart needs.
            await self._wait_healthy(self.cfg.hang_timeout_s + self.health_timeout_s, exc)
        else:
            await self._wait_healthy(self.health_timeout_s, exc)

    async def _wait_healthy(self, limit_s: float, cause: BaseException) -> None:
        assert isinstance(self.engine, SGLangClient)
        try:
            await self.engine.wait_healthy(limit_s)
        except RolloutServerError as exc:
            self._raise_if_fatal()
            router = self.engine.router
            given = "" if self.servers else (
                f" (behind the router {router}, rollout.sglang.router, so the run cannot restart them)" if router
                else " (given by URL in rollout.sglang.urls, so the run cannot restart it)"
            )  # fmt: skip
            raise FleetDownError(
                f"rollout server(s) down for {limit_s:g} s{given}: {exc}. The run stops here; its last "
                f"complete checkpoint is intact (resume with `trustbatch train <config> resume=<run dir>`). "
                f"First error: {cause}"
            ) from exc

    # ------------------------------------------------------------------ the watchdog of started servers

    def start_watchdog(self) -> None:
        if self.servers and self.http and self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="rollout-watchdog")

    async def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            # The flag ends the loop even where a library swallows the cancellation (asyncio.wait_for did on
            # Python 3.11 when the cancel met a completing /health probe: a run that never finished).
            self._watchdog_stopping = True
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)  # a cancel of this call still raises
            self._watchdog = None
            self._watchdog_stopping = False

    async def _watch(self) -> None:
        assert isinstance(self.engine, SGLangClient)
        last_ok = {server.url: time.monotonic() for server in self.servers}
        while not self._watchdog_stopping:
            await asyncio.sleep(self.cfg.watchdog_interval_s)
            for server in self.servers:
                if self._watchdog_stopping:
                    return
                code = server.exited()
                if code is None:
                    ok, detail = await self.engine.probe(server.url, min(10.0, self.cfg.hang_timeout_s))
                    if ok:
                        last_ok[server.url] = time.monotonic()
                        continue
                    silent = time.monotonic() - last_ok[server.url]
                    if silent < self.cfg.hang_timeout_s:
                        continue
                    reason = f"no healthy answer for {silent:.0f} s (last: {detail}); killed"
                    server.kill()
                else:
                    reason = f"exited with code {code}"
                try:
                    await self._restart(server, reason)
                except BaseException as exc:  # noqa: BLE001 - handed to every waiter, then the run stops
                    self._fatal = exc if isinstance(exc, FleetDownError) else FleetDownError(str(exc))
                    self._healthy.set()
                    return
                last_ok[server.url] = time.monotonic()

    async def _restart(self, server: ServerProcess, reason: str) -> None:
        self._healthy.clear()
        if self.restarts >= self.cfg.max_restarts:
            raise FleetDownError(
                f"rollout server {server.url} {reason}, and the run already restarted servers "
                f"{self.restarts} times (rollout.supervision.max_restarts); see {server.log_path}"
            )
        self.restarts += 1
        model_dir, version = self.latest if self.latest is not None else (None, None)
        log.warning(
            "rollout server %s %s; restarting it (%d/%d) from %s (weight version %s)",
            server.url, reason, self.restarts, self.cfg.max_restarts, model_dir or server.model_dir,
            server.weight_version if version is None else version,
        )  # fmt: skip
        # Started on the event loop's own thread (a Popen: milliseconds), never in a worker thread: a server dies
        # with the thread that started it (PR_SET_PDEATHSIG), and the loop's blocking calls run in threads that
        # end with the call (app.stopping), which killed every restarted server as soon as it was born.
        server.start(model_dir=model_dir, weight_version=version)
        assert isinstance(self.engine, SGLangClient)
        await self.engine.wait_healthy(self.health_timeout_s)
        if self.adapters:  # it starts from the base model: give it the adapters requests name
            await self.engine.reload_adapters(urls=[server.url])
            if self.latest_adapter is not None and self.latest_adapter[1] not in self.engine.adapters:
                path, version = self.latest_adapter  # a push in flight: it will load it everywhere again
                await self.engine.load_adapter(path, version, urls=[server.url])
        log.warning("rollout server %s is back", server.url)
        self._healthy.set()

    def _raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    # ------------------------------------------------------------------ shutdown

    async def close(self, grace_s: float | None = None) -> None:
        """Cancel a push in flight, stop the watchdog, leave the weight-update group, stop started servers (each
        given ``grace_s`` between SIGTERM and SIGKILL; None: its own grace period)."""
        if self._push is not None:
            if not self._push.done():
                self._push.cancel()
            await asyncio.gather(self._push, return_exceptions=True)
        await self.stop_watchdog()
        if self._sync is not None:
            with contextlib.suppress(Exception):
                await self._sync.close()
        if self.http:
            await self.engine.close()
        for server in self.servers:
            server.stop(timeout_s=grace_s)
