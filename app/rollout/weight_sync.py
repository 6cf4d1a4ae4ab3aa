"""The distributed method: push the trainer's weights to every SGLang server over one process group.

The alternative to updates from disk (save a checkpoint, POST /update_weights_from_disk): the tensors go straight
from trainer memory to the servers (NCCL on GPU, gloo on CPU), with no file system in between. Both halves live
here: the HTTP requests, sent through the client's ``post_once`` (never retried: each pairs with collectives on
the trainer side, and a repeated request would wait for broadcasts that never come), and the broadcasts from
rank 0 (`WeightUpdateGroup`, from trainer/weights.py through app/rollout/joint.py).

    sync = await DistributedWeightSync.connect(client, WeightSyncConfig(backend="gloo"))
    await sync.push(gather_weights(model, dtype=cfg.dtype), version=3)   # every server now serves version "3"
    await sync.close()

One group spans the trainer (rank 0) and every TP rank of every server: server i joins at rank offset
1 + (TP sizes of servers 0..i-1), read from GET /server_info. So each broadcast reaches all servers at once, and
a push costs the same for one server or eight. The group gets a fresh name per connection (SGLang refuses to
re-initialise a name it holds).

A push: /begin_weight_update on every server (SGLang 0.5.23 refuses an update outside such a session); then per
bucket (`plan_buckets`: at most ``bucket_mb`` of one dtype, in state-dict order) one
/update_weights_from_distributed request with ``load_format: "flattened_bucket"`` running concurrently with one
broadcast of the flattened bucket; then /end_weight_update. Only the last bucket carries ``weight_version`` and
flushes the prefix cache. The tensors are sent as given: the dtype cast (``WeightSyncConfig.dtype``) is the
gather's (`app.rollout.joint.gather_weights`), done once.

Consistency with generation: each update request takes SGLang's writer lock, so it waits for the requests in
flight (they finish on the old weights) and holds back new ones. With one bucket (the default ``bucket_mb``
exceeds the tiny and small models) the whole push is atomic. With several buckets, requests queued behind one
bucket may run before the next, on partly-updated weights that still carry the old version label: give a
``bucket_mb`` larger than the model (in the sent dtype), or pause generation around ``push`` yourself
(``client.pause_generation(...)``, ``client.continue_generation()``).

Failures: a request that fails stops the push at once with the server's message; its broadcast partner may
then be left waiting for ranks that never come (until ``timeout_s``), so the sync is marked broken and every
later push raises until ``close()`` and a new ``connect()`` (or a server restart, which also leaves the group).

In a torchrun job each trainer rank that feeds servers of its own forms a group with them and pushes the state
dict it gathered (`gather_weights`, a collective for FSDP2 models that every rank calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from app.rollout.joint import WeightUpdateGroup, plan_buckets, tensor_specs
from app.rollout.sglang import (
    RolloutRequestError,
    RolloutResponseError,
    SGLangClient,
    SGLangError,
    WeightSyncConfig,
)

__all__ = [
    "DistributedWeightSync", "PushStats", "WeightSyncConfig", "WeightSyncError", "destroy_weights_update_group",
    "in_daemon_thread", "init_weights_update_group", "tp_sizes", "update_weights_from_distributed",
    "weight_update_session",
]  # fmt: skip


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
        sizes = await tp_sizes(client)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        backend = cfg.resolved_backend()
        group = WeightUpdateGroup(
            world_size=1 + sum(sizes),
            group_name=f"trustbatch-{uuid.uuid4().hex[:12]}",
            backend=backend,
            master_address=cfg.master_address,
            master_port=cfg.master_port,
            timeout_s=cfg.timeout_s,
        )
        joined = in_daemon_thread(group.connect)
        try:
            await init_weights_update_group(
                client,
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
        """Send every tensor of ``state_dict`` (as it is: cast it when gathering) to every server; they then serve
        it as ``weight_version`` = version."""
        if self.broken is not None:
            raise WeightSyncError(
                f"the weight-update group {self.group.group_name} is unusable ({self.broken}); close() this sync "
                "and connect again (restart the servers if they are stuck)"
            )
        if not state_dict:
            raise ValueError(
                "state_dict is empty: nothing to push (a rank-0-only gather leaves the other ranks {}: gather on "
                "every rank with app.rollout.joint.gather_weights, or push from rank 0 only)"
            )
        start = time.perf_counter()
        tensors = dict(state_dict)
        buckets = plan_buckets(tensors, int(self.cfg.bucket_mb * 2**20))
        async with weight_update_session(self.client):
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                names, dtypes, shapes = tensor_specs(bucket)
                request = update_weights_from_distributed(
                    self.client,
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
        broadcast = in_daemon_thread(send)
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
            await destroy_weights_update_group(self.client, self.group.group_name)
        finally:
            if self.broken is None:
                self.group.destroy()


# ---------------------------------------------------------------------------------------------- the HTTP half
# SGLang 0.5.23's /update_weights_from_distributed path, one request kind a function, to every server of the
# client at once. None is retried (the module docstring).


async def tp_sizes(client: SGLangClient) -> list[int]:
    """Tensor-parallel size of every server (GET /server_info ``tp_size``), in ``client.urls`` order."""

    async def one(url: str) -> int:
        size = (await client.server_info(url)).get("tp_size", 1)
        if not isinstance(size, int) or size < 1:
            raise RolloutResponseError(f"{url}: /server_info has no valid tp_size ({size!r})")
        return size

    return list(await asyncio.gather(*(one(url) for url in client.urls)))


async def init_weights_update_group(
    client: SGLangClient,
    *,
    master_address: str,
    master_port: int,
    world_size: int,
    rank_offsets: list[int],
    group_name: str = "weight_update_group",
    backend: Literal["nccl", "gloo"] = "nccl",
) -> None:
    """Make every server join the weight-update group; server i's TP ranks become ``rank_offsets[i] + tp_rank``.

    Each request returns only once the whole group has formed, so rank 0 (the trainer,
    `WeightUpdateGroup.connect`) must join concurrently. A group name can be used once per server: destroy it
    before re-using it.
    """
    if len(rank_offsets) != len(client.urls):
        raise ValueError(f"rank_offsets has {len(rank_offsets)} entries for {len(client.urls)} servers")
    await asyncio.gather(
        *(
            client.post_once(
                url,
                "/init_weights_update_group",
                {
                    "master_address": master_address,
                    "master_port": int(master_port),
                    "rank_offset": int(offset),
                    "world_size": int(world_size),
                    "group_name": group_name,
                    "backend": backend,
                },
                what=f"/init_weights_update_group (group {group_name}, rank_offset {offset}, {backend})",
            )
            for url, offset in zip(client.urls, rank_offsets, strict=True)
        )
    )


async def destroy_weights_update_group(client: SGLangClient, group_name: str = "weight_update_group") -> None:
    """Make every server leave (and free) the weight-update group ``group_name``."""
    await _on_every_server(
        client, "/destroy_weights_update_group", {"group_name": group_name},
        f"/destroy_weights_update_group (group {group_name})",
    )  # fmt: skip


@contextlib.asynccontextmanager
async def weight_update_session(client: SGLangClient) -> AsyncIterator[None]:
    """/begin_weight_update on every server on entry (SGLang refuses a second open session), and
    /end_weight_update on exit (also after an error: the new weights are then served)."""
    await _on_every_server(client, "/begin_weight_update", {}, "/begin_weight_update")
    try:
        yield
    except BaseException:
        with contextlib.suppress(SGLangError):  # keep the first error; the session must not stay open
            await _on_every_server(client, "/end_weight_update", {}, "/end_weight_update")
        raise
    await _on_every_server(client, "/end_weight_update", {}, "/end_weight_update")


async def update_weights_from_distributed(
    client: SGLangClient,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    group_name: str,
    version: int | None,
    *,
    load_format: str | None = None,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    session: bool = True,
) -> None:
    """Have every server receive ``names`` (broadcast by rank 0 of ``group_name``, in this order) and load them.

    ``version`` tags the new weights ``str(version)`` (None keeps the tag: the earlier buckets of a multi-bucket
    push). ``load_format="flattened_bucket"``: the tensors arrive as one flattened uint8 tensor
    (`trainer.weights.flatten_bucket`); None: one broadcast per tensor. ``session=True`` wraps the request in
    /begin_weight_update and /end_weight_update; pass False inside ``weight_update_session()``.

    The call returns when every server has loaded the tensors; the broadcasts must run concurrently. Like
    /update_weights_from_disk it waits for in-flight requests unless ``abort_all_requests`` (or the engine is
    paused).
    """
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(
            f"names, dtypes and shapes must be non-empty and of one length, got {len(names)}, {len(dtypes)}, "
            f"{len(shapes)}"
        )
    body: dict[str, Any] = {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(shape) for shape in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
    }
    if version is not None:
        body["weight_version"] = str(int(version))
    if load_format is not None:
        body["load_format"] = load_format
    what = (
        f"/update_weights_from_distributed ({len(names)} tensors, group {group_name}"
        f"{', weight_version=' + body['weight_version'] if version is not None else ''})"
    )

    async def one(url: str) -> None:
        try:
            await client.post_once(url, "/update_weights_from_distributed", body, what=what)
        except RolloutRequestError as exc:
            # As for updates from disk: loaded, but the radix cache could not be flushed (requests running,
            # e.g. after abort_all_requests); SGLang then skips the version label too. Finish both.
            if "cache was not flushed" not in str(exc):
                raise
            await client.finish_unflushed_update(url, body.get("weight_version"))

    async def update() -> None:
        await asyncio.gather(*(one(url) for url in client.urls))

    if session:
        async with weight_update_session(client):
            await update()
    else:
        await update()
    if version is not None:
        client.policy_version = int(version)


async def _on_every_server(client: SGLangClient, path: str, body: dict, what: str) -> None:
    await asyncio.gather(*(client.post_once(url, path, body, what=what) for url in client.urls))


def in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run a blocking call (a collective) in a daemon thread; the future gets its result or its exception. A stuck
    collective must not block interpreter exit, which an executor thread (asyncio.to_thread) would. The built-in
    server's receiving side uses it too (app/serving/weight_updates.py)."""
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
