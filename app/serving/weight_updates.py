"""SGLang's distributed weight update on the built-in server: the receiving half of app/rollout/weight_sync.py.

The same routes and shapes as SGLang 0.5.23, so `DistributedWeightSync` drives the built-in CPU server and a real
SGLang server alike (``rollout.sglang.weight_sync.method: distributed`` with ``rollout.engine: local``). Each
answers ``{"success": bool, "message": str}``, with status 400 when it fails.

- ``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
  backend}``: join the trainer's group as rank ``rank_offset`` (this server is one process: its ``tp_size`` in
  /server_info is 1), through ``trainer.weights.join_process_group``, as SGLang's ``init_custom_process_group``
  does. Answers once the group has formed. gloo only (a CPU server); a name already held is refused, as in SGLang.
- ``POST /begin_weight_update`` and ``/end_weight_update``: one session at a time; a distributed update outside
  one is refused, as in SGLang.
- ``POST /update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version?, load_format?,
  flush_cache?, abort_all_requests?}``: receive rank 0's broadcasts (one flattened uint8 bucket with
  ``load_format: "flattened_bucket"``, else one per tensor in order), then load them as an update from disk is
  loaded (`NativeState.load_weights`: under the write lock, so requests in flight finish on the old weights). A
  request may carry part of the model (one bucket of several); ``weight_version`` labels the weights once given.
- ``POST /destroy_weights_update_group {group_name}``.

Every name, dtype and shape is checked against the served model before anything is received, so a request can
neither allocate more than the model's size nor load a tensor that does not fit. Receiving runs before the write
lock is taken: generation goes on while the bytes arrive, and a trainer that dies mid-broadcast fails the receive
at the group's timeout (``GROUP_TIMEOUT_S``) instead of stalling the server. A failed receive leaves the group
unusable: its name is dropped, and the trainer side (`DistributedWeightSync`) reconnects under a new one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from fastapi import Request
from fastapi.responses import JSONResponse

from app.rollout.base import WeightSource
from app.rollout.weight_sync import in_daemon_thread
from app.sampling import RequestError, describe, is_int, unicode_text
from app.serving.requests import printable, read_json
from trainer.weights import bucket_sizes, join_process_group, unflatten_bucket

GROUP_TIMEOUT_S = 600.0
"""How long joining a group, and each receive, may wait for the trainer."""
FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def weight_version_of(body: dict) -> str | int | None:
    """The request's ``weight_version`` (None when absent), checked: a string (an int is taken as one)."""
    version = body.get("weight_version")
    if version is not None and (not isinstance(version, (str, int)) or isinstance(version, bool)):
        raise RequestError(f"weight_version must be a string, got {describe(version)}")
    if isinstance(version, str):
        unicode_text(version, "weight_version")  # it comes back in /model_info and in every response
    return version


def _answer(success: bool, message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"success": success, "message": printable(message)}, status_code=200 if success else status)


async def _object(request: Request) -> dict:
    state = request.app.state.native
    body = await read_json(request, state.max_body_bytes, allow_empty=True)
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {describe(body)}")
    return body


def _field(body: dict, key: str, check: Callable[[Any], bool], expected: str) -> Any:
    value = body.get(key)
    if not check(value):
        raise RequestError(f"{key} must be {expected}, got {describe(value)}")
    return value


def _group_name(body: dict) -> str:
    return _field(body, "group_name", lambda v: isinstance(v, str) and 0 < len(v) <= 256, "a non-empty string")


async def init_weights_update_group(request: Request) -> JSONResponse:
    state = request.app.state.native
    try:
        body = await _object(request)
        address = _field(body, "master_address", lambda v: isinstance(v, str) and v != "", "a host name or address")
        port = _field(body, "master_port", lambda v: is_int(v) and 0 < v < 65536, "a TCP port (1-65535)")
        world_size = _field(body, "world_size", lambda v: is_int(v) and v >= 2, "an integer >= 2")
        rank = _field(
            body, "rank_offset", lambda v: is_int(v) and 1 <= v < world_size, f"an integer in [1, {world_size})"
        )
        name = _group_name(body)
        backend = body.get("backend", "nccl")
        if backend != "gloo":
            raise RequestError(
                f"backend {backend!r}: the built-in CPU server receives weights over gloo only (backend: gloo)"
            )
        if name in state.weight_groups:
            raise RequestError(f"a weight-update group named {name!r} already exists; destroy it first")
    except RequestError as exc:
        return _answer(False, exc.message, exc.status)

    timeout = timedelta(seconds=GROUP_TIMEOUT_S)

    def join() -> dist.ProcessGroup:
        store = dist.TCPStore(address, int(port), int(world_size), is_master=False, timeout=timeout)
        return join_process_group(store, int(rank), int(world_size), name, "gloo", timeout)

    state.weight_groups[name] = None  # reserved while joining: a second request with this name is refused
    try:
        state.weight_groups[name] = await in_daemon_thread(join)
    except Exception as exc:  # noqa: BLE001 - the trainer never came, or its address is wrong: say so
        state.weight_groups.pop(name, None)
        return _answer(False, f"Failed to init group {name!r} at {address}:{port} as rank {rank}: {exc}")
    return _answer(True, f"Succeeded to initialize group {name!r} as rank {rank} of {world_size}.")


async def begin_weight_update(request: Request) -> JSONResponse:
    state = request.app.state.native
    await _object(request)
    if state.update_session:
        return _answer(False, "a weight update session is already open; end it with /end_weight_update first")
    state.update_session = True
    return _answer(True, "Weight update session started.")


async def end_weight_update(request: Request) -> JSONResponse:
    state = request.app.state.native
    await _object(request)
    state.update_session = False
    return _answer(True, "Weight update session ended.")


def _check_tensors(state, body: dict) -> tuple[list[str], list[str], list[list[int]]]:
    """The request's names, dtypes and shapes, each checked against the served model."""
    names = _field(body, "names", lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list of names")
    dtypes = _field(body, "dtypes", lambda v: isinstance(v, list) and len(v) == len(names), "one dtype per name")
    shapes = _field(body, "shapes", lambda v: isinstance(v, list) and len(v) == len(names), "one shape per name")
    model = state.model.engine.model.state_dict()
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if not isinstance(name, str) or name not in model:
            raise RequestError(f"names[{i}] = {printable(str(name))[:200]!r} is not a weight of the served model")
        if dtype not in FLOAT_DTYPES:
            raise RequestError(f"dtypes[{i}] = {describe(dtype)}: expected one of {list(FLOAT_DTYPES)}")
        if not isinstance(shape, list) or list(model[name].shape) != shape:
            raise RequestError(f"shapes[{i}] = {describe(shape)} for {name}: the model's is {list(model[name].shape)}")
    if len(set(names)) != len(names):
        raise RequestError("names has duplicates")
    return names, dtypes, shapes


async def update_weights_from_distributed(request: Request) -> JSONResponse:
    state = request.app.state.native
    try:
        body = await _object(request)
        name = _group_name(body)
        if state.weight_groups.get(name) is None:
            raise RequestError(f"no weight-update group named {name!r}: call /init_weights_update_group first")
        if not state.update_session:
            raise RequestError("no weight update session: call /begin_weight_update first")
        names, dtypes, shapes = _check_tensors(state, body)
        version = weight_version_of(body)
        load_format = body.get("load_format")
        if load_format not in (None, "flattened_bucket"):
            raise RequestError(f"load_format {load_format!r} is not supported; use 'flattened_bucket' or none")
    except RequestError as exc:
        return _answer(False, exc.message, exc.status)

    group = state.weight_groups[name]

    def receive() -> list[torch.Tensor]:
        if load_format == "flattened_bucket":
            buffer = torch.empty(sum(bucket_sizes(dtypes, shapes)), dtype=torch.uint8)
            dist.broadcast(buffer, group=group, group_src=0)
            return unflatten_bucket(buffer, dtypes, shapes)
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in zip(dtypes, shapes, strict=True)]
        for tensor in tensors:
            dist.broadcast(tensor, group=group, group_src=0)
        return tensors

    try:
        tensors = await in_daemon_thread(receive)
    except Exception as exc:  # noqa: BLE001 - the group cannot be trusted after a failed collective
        state.weight_groups.pop(name, None)
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)
        return _answer(False, f"Failed to receive the weights over group {name!r} (the group is dropped): {exc}")
    if body.get("abort_all_requests"):
        state.scheduler.abort_queued()
    try:
        source = WeightSource(state_dict=dict(zip(names, tensors, strict=True)))
        await state.load_weights(source, version, complete=False)
    except (ValueError, OSError) as exc:
        return _answer(False, f"Failed to update weights: {exc}")
    return _answer(True, "Succeeded to update model weights.")


async def destroy_weights_update_group(request: Request) -> JSONResponse:
    state = request.app.state.native
    try:
        name = _group_name(await _object(request))
    except RequestError as exc:
        return _answer(False, exc.message, exc.status)
    group = state.weight_groups.pop(name, None)
    if group is None:
        return _answer(False, f"no weight-update group named {name!r}")
    with contextlib.suppress(Exception):  # the trainer may have torn its side down first
        dist.destroy_process_group(group)
    return _answer(True, f"Succeeded to destroy group {name!r}.")


WEIGHT_UPDATE_ROUTES = [
    ("/init_weights_update_group", init_weights_update_group, ["POST"]),
    ("/begin_weight_update", begin_weight_update, ["POST"]),
    ("/update_weights_from_distributed", update_weights_from_distributed, ["POST"]),
    ("/end_weight_update", end_weight_update, ["POST"]),
    ("/destroy_weights_update_group", destroy_weights_update_group, ["POST"]),
]
