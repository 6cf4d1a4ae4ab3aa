"""Export weights to rollout engines: the trainer side of SGLang's ``/update_weights_from_distributed``.

SGLang (0.5.23) receives new weights over a torch.distributed process group that it joins *after* start-up,
next to its own groups: ``POST /init_weights_update_group {master_address, master_port, rank_offset,
world_size, group_name, backend}`` makes every TP rank of the server call SGLang's
``init_custom_process_group`` (srt/utils/common.py) with rank ``rank_offset + tp_rank``; then each
``POST /update_weights_from_distributed {names, dtypes, shapes, ...}`` makes them receive broadcasts from rank 0
of that group, in the order of ``names``. The trainer is rank 0. This module holds what rank 0 does, and
nothing about HTTP (the requests and the orchestration of both halves live in app/rollout/weight_sync.py, which
reaches this module through app/rollout/joint.py):

- `WeightUpdateGroup`: rank 0 of such a group, built exactly as ``init_custom_process_group`` builds it on the
  server side: a ``TCPStore`` hosted here (SGLang's ``tcp://`` rendezvous makes rank 0 the store's host),
  wrapped in ``PrefixStore(group_name, store)``, then ``_new_process_group_helper(..., group_name=group_name)``.
  A plain ``dist.init_process_group`` on the trainer side hangs: it prefixes its store keys with
  ``default_pg`` instead of the group name, so the two sides never see each other's keys.
- `plan_buckets` / `tensor_specs` / `flatten_bucket`: the name, dtype and shape lists SGLang needs, and the
  "flattened_bucket" wire format (SGLang's ``FlattenedTensorBucket``: the tensors' bytes concatenated as one
  uint8 tensor in list order), so a whole bucket travels in one broadcast.
- `state_dict_for_sync`: the full (unsharded) state dict of a plain or FSDP2-sharded model, cast to the dtype
  sent: the one gather-and-cast of every in-memory publication (the embedded engine, the distributed method).

The group is gloo on CPU and NCCL between GPUs: NCCL broadcasts CUDA tensors only, so with ``backend="nccl"``
each bucket is copied to ``device`` (the current CUDA device) before it is sent.

The receiving side is SGLang's; the built-in CPU server mirrors it (app/serving/weight_updates.py) with
`join_process_group` and `unflatten_bucket`.

Not covered: data-parallel SGLang servers (SGLang asserts dp_size == 1 for this
path: run one server per replica instead), ``/update_weights_from_tensor`` (CUDA IPC, same node only; on CPU it
killed the server), and tensor-parallel resharding (each SGLang TP rank
receives the full tensor and takes its own shard).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.distributed import full_state_dict
from trainer.lora import lora_of, merged_state_dict

DEFAULT_GROUP_NAME = "weight_update_group"
"""SGLang's default group name; a name can be initialised once per server (re-use needs a destroy first)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as SGLang's request wants it (``"float32"``, ``"bfloat16"``): it does ``getattr(torch, name)``."""
    return str(dtype).removeprefix("torch.")


def tensor_specs(tensors: Iterable[tuple[str, Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
    """``(names, dtypes, shapes)`` of ``(name, tensor)`` pairs, in order: the body of one update request."""
    names, dtypes, shapes = [], [], []
    for name, tensor in tensors:
        names.append(name)
        dtypes.append(dtype_name(tensor.dtype))
        shapes.append(list(tensor.shape))
    return names, dtypes, shapes


def plan_buckets(tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], bucket_bytes: int):
    """Split ``(name, tensor)`` pairs, in their order, into buckets of at most ``bucket_bytes`` bytes each.

    A new bucket also starts where the dtype changes: SGLang's receiver needs every tensor's byte offset in a
    flattened bucket to be a multiple of its item size, which one dtype per bucket guarantees. A tensor larger
    than ``bucket_bytes`` gets a bucket of its own. Returns ``list[list[tuple[str, Tensor]]]``.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    buckets: list[list[tuple[str, Tensor]]] = []
    size = 0
    for name, tensor in items:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or size + nbytes > bucket_bytes or buckets[-1][-1][1].dtype != tensor.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


def flatten_bucket(bucket: list[tuple[str, Tensor]]) -> Tensor:
    """One bucket as SGLang's ``FlattenedTensorBucket`` reads it: every tensor's bytes, concatenated (uint8)."""
    if not bucket:
        raise ValueError("cannot flatten an empty bucket")
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (expected a torch dtype name, e.g. 'float32')")
    return dtype


def bucket_sizes(dtypes: list[str], shapes: list[list[int]]) -> list[int]:
    """The byte size of each tensor of a bucket, from the dtype names and shapes of its update request."""
    if len(dtypes) != len(shapes):
        raise ValueError(f"{len(dtypes)} dtypes for {len(shapes)} shapes")
    return [
        torch.Size(shape).numel() * torch.empty((), dtype=_torch_dtype(name)).element_size()
        for name, shape in zip(dtypes, shapes, strict=True)
    ]


def unflatten_bucket(buffer: Tensor, dtypes: list[str], shapes: list[list[int]]) -> list[Tensor]:
    """The inverse of `flatten_bucket`: the tensors of a received uint8 buffer, in order (views into it)."""
    sizes = bucket_sizes(dtypes, shapes)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != sum(sizes):
        raise ValueError(
            f"a flattened bucket of {buffer.numel()} {buffer.dtype} elements cannot hold tensors of "
            f"{sum(sizes)} bytes"
        )
    out, offset = [], 0
    for name, shape, size in zip(dtypes, shapes, sizes, strict=True):
        out.append(buffer[offset : offset + size].view(_torch_dtype(name)).reshape(shape))
        offset += size
    return out


def join_process_group(
    store: dist.Store, rank: int, world_size: int, group_name: str, backend: str, timeout: timedelta
) -> dist.ProcessGroup:
    """Join the weight-update group ``group_name`` as ``rank``; blocks until every rank has joined.

    What ``sglang.srt.utils.common.init_custom_process_group`` does on SGLang's side, so both sides meet:
    the store (a ``TCPStore`` hosted by rank 0) wrapped in ``PrefixStore(group_name, ...)``, then a process
    group beside the default one (there need not be a default one). Rank 0 is the trainer
    (`WeightUpdateGroup`); the built-in server joins with the same function (app/serving/weight_updates.py).
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
        device_id=None,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def state_dict_for_sync(
    model: torch.nn.Module, *, dtype: torch.dtype | str | None = None, every_rank: bool = False
) -> dict[str, Tensor]:
    """The full state dict to push to rollout engines, floating-point tensors cast to ``dtype``.

    For an FSDP2-sharded model this is a collective (`trainer.distributed.full_state_dict`): every trainer rank
    must call it. By default only rank 0 gets the tensors (gathered straight to CPU) and the other ranks ``{}``;
    ``every_rank=True`` gives each rank the whole state dict (when every rank feeds engines of its own).
    ``dtype`` (a torch dtype or its name, e.g. ``"bfloat16"`` for bf16 engines: half the bytes sent) casts the
    floating-point tensors; None keeps them as they are (SGLang copies into its own dtype either way).
    """
    state = full_state_dict(model, rank0_only=not every_rank)
    lora = lora_of(model)
    if lora is not None:  # engines serve the merged weights under the base model's names (trainer/lora.py)
        state = merged_state_dict(state, lora.scaling)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state


class WeightUpdateGroup:
    """Rank 0 of a weight-update process group that SGLang servers join through /init_weights_update_group.

    Two steps, because the servers must learn the port before anyone can finish joining:

    1. ``WeightUpdateGroup(world_size=..., group_name=..., ...)`` hosts the group's TCPStore and returns at
       once; ``master_port`` is the port it listens on (a free one when ``master_port=0``).
    2. ``connect()`` blocks until every other rank has joined (SGLang's ranks join while the
       /init_weights_update_group request runs, so run the two concurrently), or raises after ``timeout_s``.

    Then ``broadcast_bucket`` sends tensors from rank 0, and ``destroy()`` tears the group down.

    Args:
        world_size: 1 (this trainer process) + the TP ranks of every server that joins.
        group_name: the name given to the servers; SGLang keeps one group per name.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors; needs a GPU here and on the servers).
        master_address: the address the servers connect to (this host as they see it).
        master_port: TCP port of the store; 0 picks a free one.
        timeout_s: time limit of joining and of each collective (a broadcast whose receivers never come).
        device: where tensors are staged before sending: cpu for gloo, the current CUDA device for nccl.
    """

    def __init__(
        self,
        *,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 600.0,
        device: torch.device | str | None = None,
    ) -> None:
        if world_size < 2:
            raise ValueError(
                f"world_size must be >= 2 (the trainer + at least one server rank), got {world_size}"
            )
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (CUDA), got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs a CUDA device in the trainer process; use 'gloo' on CPU")
        if not group_name:
            raise ValueError("group_name must not be empty (SGLang refuses an empty group name)")
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend
        self.master_address = master_address
        self.timeout = timedelta(seconds=timeout_s)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        self.device = torch.device(device)
        # is_master: SGLang's tcp:// rendezvous makes rank 0 the host of the store; the servers connect to it.
        # wait_for_workers=False: return now, the servers are told the port only after this.
        self._store = dist.TCPStore(
            host_name=master_address,
            port=master_port,
            world_size=world_size,
            is_master=True,
            timeout=self.timeout,
            wait_for_workers=False,
            multi_tenant=True,
        )
        self.master_port: int = self._store.port
        self.process_group: dist.ProcessGroup | None = None
        self._lock = threading.Lock()

    def connect(self) -> None:
        """Create the process group as rank 0; blocks until every rank has joined (or ``timeout_s``)."""
        with self._lock:
            if self.process_group is not None:
                return
            self.process_group = join_process_group(
                self._store, 0, self.world_size, self.group_name, self.backend, self.timeout
            )

    def broadcast_bucket(self, bucket: list[tuple[str, Tensor]], *, flattened: bool = True) -> None:
        """Send one bucket from rank 0, matching one /update_weights_from_distributed request's names.

        ``flattened=True`` sends one uint8 tensor (the request carries ``load_format: "flattened_bucket"``);
        ``flattened=False`` sends one broadcast per tensor in order (SGLang's default load format).
        """
        if self.process_group is None:
            raise RuntimeError("WeightUpdateGroup.connect() has not completed: no process group to send on")
        tensors = [flatten_bucket(bucket)] if flattened else [t.detach().contiguous() for _, t in bucket]
        for tensor in tensors:
            dist.broadcast(tensor.to(self.device), group=self.process_group, group_src=0)

    def destroy(self) -> None:
        """Tear down the process group (if it was created) and stop hosting the store."""
        with self._lock:
            if self.process_group is not None:
                dist.destroy_process_group(self.process_group)
                self.process_group = None
            self._store = None
