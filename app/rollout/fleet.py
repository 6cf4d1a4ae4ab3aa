"""The run's rollout engines under supervision: generation that survives a server dying or hanging.

A ``Fleet`` wraps the one RolloutEngine of a rank (the SGLang client over one or more servers, or the embedded
engine) and, when the run started the servers itself (``rollout.engine=local``, or SGLang launched from the
config), the server processes. The loop only ever calls ``generate`` and ``publish``.

Failures (a rollout server that dies or hangs is detected, then restarted or reported):
- **A started server dies** (killed, crashed, OOM): the watchdog sees the process exit within
  ``rollout.watchdog_interval_s`` and starts it again on the same port, serving the newest published weights
  with their version label, so it needs no separate weight push and reports the right ``policy_version``.
- **A started server hangs** (alive but not answering): the watchdog probes ``GET /health`` every
  ``watchdog_interval_s``; after ``hang_timeout_s`` without a healthy answer it kills the process (SIGKILL)
  and restarts it as above. Requests stuck on it fail with connection errors at once.
- **Requests lost** to either: the SGLang client retries them (back-off, next server); when its retries run
  out, ``generate`` waits for the fleet to heal and *resubmits* the whole call (same prompts, same seed).
  ``publish`` re-sends the weight update after healing.
- **A server given by URL** (the run cannot restart it) that stays down: ``generate``/``publish`` wait up to
  ``rollout.sglang.health_timeout_s`` for it to answer ``/health`` again, then raise ``FleetDownError``
  naming the server, the time waited and what was tried; the run stops there, and its checkpoints (written
  atomically) are intact.
- ``max_restarts`` bounds restarts over the whole run (a server that dies at every start is a bug to report,
  not to retry forever).

Counters for metrics: ``restarts``, ``resubmits``; ``busy`` measures the wall time with a generation in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from app.rollout.base import Completion, RolloutEngine, SamplingParams, WeightSource
from app.rollout.sglang import RolloutServerError, SGLangClient
from app.rollout.weight_sync import DistributedWeightSync, WeightSyncConfig, WeightSyncError

log = logging.getLogger(__name__)
R = TypeVar("R")


class FleetDownError(RuntimeError):
    """The rollout servers could not be brought back (given by URL and down too long, or out of restarts)."""


class ServerProcess(Protocol):
    """A server the run started and may restart (`LocalServerProcess`, `SGLangServerProcess`)."""

    url: str
    model_dir: Path
    weight_version: str
    log_path: Path

    def start(self, *, model_dir: Path | None = None, weight_version: int | str | None = None) -> str: ...

    def exited(self) -> int | None: ...

    def kill(self) -> None: ...

    def stop(self) -> None: ...


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
    """

    def __init__(
        self,
        engine: RolloutEngine,
        servers: list[ServerProcess],
        cfg: SupervisionConfig,
        *,
        health_timeout_s: float,
        weight_sync: WeightSyncConfig | None = None,
    ) -> None:
        self.engine, self.servers, self.cfg = engine, list(servers), cfg
        self.health_timeout_s = health_timeout_s
        self.weight_sync = weight_sync if weight_sync is not None and weight_sync.method == "distributed" else None
        """Set: in-memory weights are broadcast to the SGLang servers over a process group (NCCL/gloo)."""
        self._sync: DistributedWeightSync | None = None
        self._sync_restarts = 0
        self.restarts = 0
        self.resubmits = 0
        self.busy = BusyMeter()
        self.latest: tuple[Path, int] | None = None
        """The newest published weights (directory, version): what a restarted server starts from."""
        self._healthy = asyncio.Event()
        self._healthy.set()
        self._fatal: BaseException | None = None
        self._watchdog: asyncio.Task | None = None

    @property
    def http(self) -> bool:
        return isinstance(self.engine, SGLangClient)

    # ------------------------------------------------------------------ the two operations of the loop

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``engine.generate``, resubmitted after the fleet heals when servers fail (module docstring)."""
        with self.busy.busy():
            return await self._survive(lambda: self.engine.generate(prompts, params), "generate")

    async def publish(self, source: WeightSource, version: int) -> None:
        """Load new weights as ``version`` on every engine; a restarted server starts from them (disk only:
        under the distributed method a restarted server serves its start weights until the next push, and
        the staleness bound drops what it generates before then)."""
        if source.path is not None:
            self.latest = (Path(source.path), int(version))
        if self.weight_sync is not None and source.state_dict is not None:
            await self._survive(lambda: self._broadcast(source.state_dict, version), "a weight broadcast")
        else:
            await self._survive(lambda: self.engine.update_weights(source, version), "a weight update")

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
            given = "" if self.servers else " (given by URL in rollout.sglang.urls, so the run cannot restart it)"
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
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None

    async def _watch(self) -> None:
        assert isinstance(self.engine, SGLangClient)
        last_ok = {server.url: time.monotonic() for server in self.servers}
        while True:
            await asyncio.sleep(self.cfg.watchdog_interval_s)
            for server in self.servers:
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
        await asyncio.to_thread(server.start, model_dir=model_dir, weight_version=version)
        assert isinstance(self.engine, SGLangClient)
        await self.engine.wait_healthy(self.health_timeout_s)
        log.warning("rollout server %s is back", server.url)
        self._healthy.set()

    def _raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    # ------------------------------------------------------------------ shutdown

    async def close(self) -> None:
        await self.stop_watchdog()
        if self._sync is not None:
            with contextlib.suppress(Exception):
                await self._sync.close()
        if self.http:
            await self.engine.close()
        for server in self.servers:
            server.stop()
