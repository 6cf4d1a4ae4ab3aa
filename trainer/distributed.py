"""Process groups, FSDP2 wrapping and the Reducer: the only module in trustbatch that calls torch.distributed.

Everything else that needs a cross-rank quantity (the global token count, the ESS sums, metrics, the
non-finite flag) goes through a `Reducer`, so the same code runs in one process (`LocalReducer`, the
identity) and under `torchrun` (`ProcessGroupReducer`). Scale-out is torchrun + FSDP2 only:

- `init_distributed()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK). Without it the run is one
  process and no process group is created; with it (even `--nproc_per_node=1`) the default group is created,
  gloo on CPU and nccl on CUDA.
- `shard_model()` applies FSDP2 `fully_shard` per decoder layer, then the root. FSDP2 *averages* gradients
  over the ranks; `trainer/step.py` multiplies the loss by the world size to cancel that (its docstring
  states the convention).
- `full_state_dict()` gathers the unsharded weights (for checkpoints and weight pushes).

Every function here that communicates is a collective: all ranks must call it, in the same order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

_PARAM_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


@runtime_checkable
class Reducer(Protocol):
    """Cross-rank reductions for the trainer. Both methods reduce in place and return their argument."""

    world_size: int
    rank: int

    def sum_(self, t: Tensor) -> Tensor:
        """All-reduce SUM of `t` in place over the data-parallel ranks; returns `t`."""
        ...

    def max_(self, t: Tensor) -> Tensor:
        """All-reduce MAX of `t` in place over the data-parallel ranks; returns `t`."""
        ...


class LocalReducer:
    """The one-process Reducer: every reduction is the identity."""

    world_size = 1
    rank = 0

    def sum_(self, t: Tensor) -> Tensor:
        return t

    def max_(self, t: Tensor) -> Tensor:
        return t


class ProcessGroupReducer:
    """A Reducer over a torch.distributed process group (the default group when `group` is None).

    NCCL reduces only CUDA tensors: a CPU tensor is copied to the current CUDA device, reduced and copied
    back into place, so callers may keep their small bookkeeping tensors (counts, sums, flags) on the CPU.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupReducer needs an initialised process group: call init_distributed() under "
                "torchrun, or use LocalReducer for a single process"
            )
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        backend = dist.get_backend(group)
        self._device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )

    def _all_reduce(self, t: Tensor, op: dist.ReduceOp) -> Tensor:
        if t.device == self._device or self._device.type == "cpu" and t.device.type == "cpu":
            dist.all_reduce(t, op=op, group=self.group)
            return t
        staged = t.to(self._device)
        dist.all_reduce(staged, op=op, group=self.group)
        t.copy_(staged)
        return t

    def sum_(self, t: Tensor) -> Tensor:
        return self._all_reduce(t, dist.ReduceOp.SUM)

    def max_(self, t: Tensor) -> Tensor:
        return self._all_reduce(t, dist.ReduceOp.MAX)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its rank, the world size, its local rank and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    """The process-group backend ("gloo", "nccl"), or None for a single process without a group."""

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def reducer(self) -> Reducer:
        """The Reducer that matches: ProcessGroupReducer under a process group, LocalReducer otherwise."""
        return ProcessGroupReducer() if self.is_distributed else LocalReducer()


def init_distributed(backend: str | None = None) -> DistInfo:
    """Join torchrun's process group, or describe a single process when torchrun's environment is absent.

    `backend` defaults to nccl when CUDA is available and gloo otherwise. On CUDA each process uses device
    `cuda:LOCAL_RANK`. Calling it again after the group exists reuses the group.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return DistInfo(rank=0, world_size=1, local_rank=0, device=device, backend=None)

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    return DistInfo(
        rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=dist.get_backend()
    )


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a HF causal LM (`model.model.layers`, or GPT-2's `transformer.h`)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        module: Any = model
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            return list(module)
    raise ValueError(
        f"shard_model could not find the decoder layers of {type(model).__name__}: expected a HF causal LM "
        "with `model.layers` (Llama, Qwen2, Mistral, ...) or `transformer.h`"
    )


def shard_model(model: torch.nn.Module, *, param_dtype: str | None = None) -> torch.nn.Module:
    """Shard `model` in place with FSDP2: `fully_shard` on each decoder layer, then on the root. Returns it.

    `param_dtype` ("bf16"/"bfloat16", "fp16"/"float16", "fp32"/"float32" or None) sets a
    MixedPrecisionPolicy: parameters are all-gathered and computed in that dtype while the sharded master
    weights, the optimizer state and the gradient reduction stay float32. None computes in the weights' dtype.

    Without a process group (one process, no torchrun) the model is returned unchanged and `param_dtype`
    has no effect: the single-process path trains the plain module in its own dtype.
    """
    if param_dtype is not None and param_dtype not in _PARAM_DTYPES:
        raise ValueError(f"param_dtype={param_dtype!r} is not one of {sorted(_PARAM_DTYPES)} (or None)")
    if not dist.is_initialized():
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=_PARAM_DTYPES[param_dtype], reduce_dtype=torch.float32
        )
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` was sharded by FSDP2 (`shard_model`)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: torch.nn.Module, *, rank0_only: bool = False) -> dict[str, Tensor]:
    """The full (unsharded) state dict as detached CPU tensors that share no memory with the model.

    For an FSDP2-sharded model this is a collective: every rank must call it. With `rank0_only=False` (the
    default) every rank receives the whole state dict; with `rank0_only=True` only rank 0 does (gathered
    straight to CPU, the cheaper path for saving) and the other ranks get `{}`. For an unsharded model it is
    a plain copy of `model.state_dict()` and needs no communication. Keys are the plain module names, the
    same as `model.state_dict()` of the unwrapped model, so the result loads into an unsharded copy.
    """
    if not is_sharded(model):
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_model_state_dict(model, options=options)
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def full_value(t: Tensor) -> Tensor:
    """A plain tensor from `t`: a DTensor (e.g. FSDP2's grad norm) is materialised (a collective), else `t`."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank (pickled); the identity without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait for every rank; a no-op without a process group."""
    if dist.is_initialized():
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank; `[obj]` without a process group."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def destroy_distributed() -> None:
    """Tear down the default process group if this process created one."""
    if dist.is_initialized():
        dist.destroy_process_group()
