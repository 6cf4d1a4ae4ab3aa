"""Push the trainer's weights to every SGLang server over one process group (NCCL on GPU, gloo on CPU).

The alternative to ``SGLangClient.update_weights`` (save a checkpoint, POST /update_weights_from_disk): the
tensors go straight from trainer memory to the servers, with no file system in between. Both halves run here
together: the HTTP requests (app/rollout/sglang.py) and the broadcasts from rank 0 (trainer/weights.py).

    sync = await DistributedWeightSync.connect(client, WeightSyncConfig(backend="gloo"))
    await sync.push(state_dict_for_sync(model), version=3)       # every server now serves version "3"
    await sync.close()

One group spans the trainer (rank 0) and every TP rank of every server: server i joins at rank offset
1 + (TP sizes of servers 0..i-1), read from GET /server_info. So each broadcast reaches all servers at once, and
a push costs the same for one server or eight. The group gets a fresh name per connection (SGLang refuses to
re-initialise a name it holds).

A push: /begin_weight_update on every server; then per bucket (`trainer.weights.plan_buckets`: at most
``bucket_mb`` of one dtype, in state-dict order) one /update_weights_from_distributed request with
``load_format: "flattened_bucket"`` running concurrently with one broadcast of the flattened bucket; then
/end_weight_update. Only the last bucket carries ``weight_version`` and flushes the prefix cache.

Consistency with generation: each update request takes SGLang's writer lock, so it waits for the requests in
flight (they finish on the old weights) and holds back new ones. With one bucket (the default ``bucket_mb``
exceeds the tiny and small models) the whole push is atomic. With several buckets, requests queued behind one
bucket may run before the next, on partly-updated weights that still carry the old version label: give a
``bucket_mb`` larger than the model (in the sent dtype), or pause generation around ``push`` yourself
(``client.pause_generation(...)``, ``client.continue_generation()``).

Failures: a request that fails stops the push at once with the server's message; its broadcast partner may
then be left waiting for ranks that never come (until ``timeout_s``), so the sync is marked broken and every
later push raises until ``close()`` and a new ``connect()`` (or a server restart, which also leaves the group).

In a torchrun job only the trainer's global rank 0 connects and pushes; every rank calls
`trainer.weights.state_dict_for_sync` (a collective for FSDP2 models), which gives rank 0 the full state dict.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from trainer.weights import WeightUpdateGroup, plan_buckets, tensor_specs

if TYPE_CHECKING:  # a type only: app/rollout/sglang.py may import WeightSyncConfig from here without a cycle
    from app.rollout.sglang import SGLangClient

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WeightSyncConfig:
    """How new policy weights reach the SGLang servers (config section ``rollout.sglang.weight_sync``)."""

    method: Literal["disk", "distributed"] = "disk"
    """disk: save a checkpoint and POST /update_weights_from_disk (servers must see the file system).
    distributed: broadcast the tensors over a process group (this module)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend of the distributed method: nccl (GPU trainer and servers), gloo (CPU), auto =
    nccl when the trainer process has CUDA, else gloo."""
    master_address: str = "127.0.0.1"
    """Address of the trainer as the servers see it (they connect to the group's store there)."""
    master_port: int = 0
    """Port of the group's store on the trainer; 0 = a free port."""
    bucket_mb: float = 1024.0
    """Largest bucket in MiB: one request and one broadcast each. Above the model's size (in the sent dtype)
    a push is atomic with respect to generation (see the module docstring)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Cast floating-point weights to this dtype before sending (e.g. bfloat16 for bf16 servers: half the
    bytes); None sends them as they are. The servers convert to their own dtype either way."""
    timeout_s: float = 600.0
    """Time limit of forming the group and of each broadcast (also covers waiting for in-flight requests)."""

    def __post_init__(self) -> None:
        key = "rollout.sglang.weight_sync"
        if not self.master_address:
            raise ValueError(
                f"{key}.master_address is empty: give the trainer's address as the servers see it"
            )
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"{key}.master_port={self.master_port} must be 0 (a free port) or in 1..65535")
        if not self.bucket_mb > 0:
            raise ValueError(f"{key}.bucket_mb must be > 0 MiB, got {self.bucket_mb}")
        if not self.timeout_s > 0:
            raise ValueError(f"{key}.timeout_s must be > 0 seconds, got {self.timeout_s}")

    def resolved_backend(self) -> Literal["nccl", "gloo"]:
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        return self.backend


@dataclass(frozen=True)
class PushStats:
    """What one ``push`` moved and how long it took."""

    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float


class WeightSyncError(RuntimeError):
    """The weight-update group is unusable (an earlier push failed mid-way); reconnect."""


class DistributedWeightSync:
    """A live weight-update group between this process (rank 0) and every server of ``client``.

    Build it with ``await DistributedWeightSync.connect(client, cfg)``; see the module docstring.
    """

    def __init__(self, client: SGLangClient, group: WeightUpdateGroup, cfg: WeightSyncConfig) -> None:
        self.client, self.group, self.cfg = client, group, cfg
        self.broken: str | None = None
        """Why the group is unusable (None while it is fine)."""

    @classmethod
    async def connect(
        cls, client: SGLangClient, cfg: WeightSyncConfig | None = None
    ) -> DistributedWeightSync:
        """Form the group: host its store here, have every server join, join as rank 0 (concurrently)."""
        cfg = cfg or WeightSyncConfig(method="distributed")
        tp_sizes = await client.tp_sizes()
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
        backend = cfg.resolved_backend()
        group = WeightUpdateGroup(
            world_size=1 + sum(tp_sizes),
            group_name=f"trustbatch-{uuid.uuid4().hex[:12]}",
            backend=backend,
            master_address=cfg.master_address,
            master_port=cfg.master_port,
            timeout_s=cfg.timeout_s,
        )
        joined = _in_daemon_thread(group.connect)
        try:
            await client.init_weights_update_group(
                master_address=cfg.master_address,
                master_port=group.master_port,
                world_size=group.world_size,
                rank_offsets=offsets,
                group_name=group.group_name,
                backend=backend,
            )
        except BaseException:
            # The join thread may wait for ranks that will never come; it ends at timeout_s (a daemon thread),
            # and its error, if any, is not news.
            joined.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        await joined
        return cls(client, group, cfg)

    async def push(self, state_dict: Mapping[str, Tensor], version: int) -> PushStats:
        """Send every tensor of ``state_dict`` to every server; they then serve it as ``weight_version`` = version."""
        if self.broken is not None:
            raise WeightSyncError(
                f"the weight-update group {self.group.group_name} is unusable ({self.broken}); close() this sync "
                "and connect again (restart the servers if they are stuck)"
            )
        if not state_dict:
            raise ValueError("state_dict is empty: nothing to push (on torchrun ranks > 0, do not push)")
        start = time.perf_counter()
        cast = _DTYPES[self.cfg.dtype] if self.cfg.dtype else None
        tensors = {
            name: t.to(cast) if cast is not None and t.is_floating_point() else t
            for name, t in state_dict.items()
        }
        buckets = plan_buckets(tensors, int(self.cfg.bucket_mb * 2**20))
        async with self.client.weight_update_session():
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                names, dtypes, shapes = tensor_specs(bucket)
                request = self.client.update_weights_from_distributed(
                    names,
                    dtypes,
                    shapes,
                    self.group.group_name,
                    version if last else None,
                    load_format="flattened_bucket",
                    flush_cache=last,
                    session=False,
                )
                await self._together(
                    request, lambda b=bucket: self.group.broadcast_bucket(b), what=f"bucket {i}"
                )
        return PushStats(
            version=int(version),
            tensors=len(tensors),
            bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            buckets=len(buckets),
            seconds=time.perf_counter() - start,
        )

    async def _together(self, request: Any, send: Callable[[], None], *, what: str) -> None:
        """Run an HTTP request and its broadcasts concurrently; either failing marks the group broken."""
        http = asyncio.ensure_future(request)
        broadcast = _in_daemon_thread(send)
        done, _ = await asyncio.wait({http, broadcast}, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                self.broken = f"{what} failed: {task.exception()}"
                for other in (http, broadcast):
                    if other is not task:
                        other.cancel()  # a broadcast thread cannot be interrupted; it ends at timeout_s
                raise task.exception()
        await asyncio.gather(http, broadcast)

    async def close(self) -> None:
        """Leave the group on every server and tear it down here (best effort once broken)."""
        try:
            await self.client.destroy_weights_update_group(self.group.group_name)
        finally:
            if self.broken is None:
                self.group.destroy()


def _in_daemon_thread(fn: Callable[[], None]) -> asyncio.Future:
    """Run a blocking call (a collective) in a daemon thread: a stuck collective must not block interpreter exit,
    which an executor thread (asyncio.to_thread) would."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name="trustbatch-weight-sync", daemon=True).start()
    return future


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
