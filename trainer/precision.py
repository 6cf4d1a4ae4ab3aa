"""Compute precision of the trainer: bfloat16 matmuls over float32 master weights (`trainer.compute_dtype`).

With ``compute_dtype: bfloat16`` the weights, their gradients and the optimizer state stay in the model's own
dtype (float32 by default, ``model.dtype``); only the forward's matrix products run in bfloat16:

- on CPU, and on one GPU, through ``torch.autocast`` around each forward (`compute`): linear layers and
  attention products in bf16, everything autocast keeps in float32 (norms, softmax) in float32; the backward
  follows the forward's choices and leaves float32 gradients on the float32 weights;
- on GPUs under FSDP2 through its ``MixedPrecisionPolicy`` instead (`fsdp_param_dtype`): each layer's
  parameters are all-gathered in bf16 and its gradients reduce-scattered in float32 onto the float32 shards
  (trainer/distributed.py `shard_model`). FSDP2 on CPU (gloo) keeps autocast.

What stays float32 in both: the logits are cast to float32 before the log-softmax (trainer/logprobs.py), so
log-probabilities, entropies, ratios, the ESS and the loss reduction are all computed in float32; only the
logits themselves carry bf16 rounding. What that costs against float32 compute is measured in
bench/real_model.py (the trainer-engine log-probability gap and the ESS at lag 0, per mode).
"""

from __future__ import annotations

import contextlib

import torch

COMPUTE_DTYPES = ("float32", "bfloat16")


def check_compute_dtype(value: object, key: str = "trainer.compute_dtype") -> None:
    if value not in COMPUTE_DTYPES:
        raise ValueError(f"{key}={value!r} must be one of {list(COMPUTE_DTYPES)}")


def bf16_hardware_problem(device: torch.device | str = "cpu") -> str | None:
    """Why bfloat16 compute would be slow or refused on ``device``, or None where the hardware has it: a CUDA
    device without bf16 (before Ampere), or a CPU without avx512_bf16 or AMX (bf16 then runs emulated, slower
    than float32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return None if torch.cuda.is_bf16_supported() else f"{torch.cuda.get_device_name(device)} has no bfloat16"
    if device.type != "cpu":
        return None
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return None  # not Linux: nothing to read, nothing to say
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        return None
    return "this CPU has no bfloat16 instructions (avx512_bf16 or amx_bf16): bf16 runs emulated, slower than float32"


def fsdp_param_dtype(compute_dtype: str, device: torch.device) -> str | None:
    """The ``param_dtype`` to give `shard_model`: bf16 FSDP2 mixed precision on CUDA, None elsewhere (autocast)."""
    check_compute_dtype(compute_dtype)
    return "bfloat16" if compute_dtype == "bfloat16" and device.type == "cuda" else None


def compute(model: torch.nn.Module, compute_dtype: str) -> contextlib.AbstractContextManager:
    """The context a forward of ``model`` runs in: autocast to bf16 for ``compute_dtype="bfloat16"`` unless the
    model's parameters are already bf16 during compute (bf16 weights, or FSDP2 mixed precision); a no-op for
    float32. Wrap the forward only: the backward replays the forward's dtype choices by itself."""
    check_compute_dtype(compute_dtype)
    if compute_dtype == "float32":
        return contextlib.nullcontext()
    param = next(model.parameters())
    if param.dtype == torch.bfloat16 or _mixed_precision_sharded(model):
        return contextlib.nullcontext()
    return torch.autocast(param.device.type, dtype=torch.bfloat16)


def _mixed_precision_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 already computes ``model`` in a lower precision (a ``mp_policy`` with a param dtype)."""
    state = getattr(model, "_get_fsdp_state", None)
    if state is None:
        return False
    param_group = getattr(state(), "_fsdp_param_group", None)
    policy = getattr(param_group, "mp_policy", None)
    return policy is not None and policy.param_dtype not in (None, torch.float32)


@contextlib.contextmanager
def weights_rounded_to(model: torch.nn.Module, dtype: str | None):
    """Inside, every parameter of ``model`` holds its value rounded to ``dtype`` (stored in its own dtype); on
    exit the exact values come back. None, or the parameters' own dtype: nothing changes.

    What a forward then computes is what an engine holding the weights in ``dtype`` would, up to its arithmetic:
    a bf16 copy of float32 weights is not the float32 weights plus noise. An RL update is far smaller than a
    bf16 step for weights near 1 (norm gains: at lr 5e-5, 75 steps moved them by 2e-4, and 0-7% of their bf16
    values changed), so the engine keeps serving the start's norm gains while the trainer's move. Each rank
    rounds its own shard under FSDP2 (no communication). Costs one copy of the parameters while inside."""
    if dtype is None:
        yield
        return
    from torch.distributed.tensor import DTensor

    target = getattr(torch, dtype)
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for param in model.parameters():  # a tied weight is one parameter: rounded once
            local = param.to_local() if isinstance(param, DTensor) else param.data
            if local.dtype == target or not local.is_floating_point():
                continue
            saved.append((local, local.clone()))
            local.copy_(local.to(target))
    try:
        yield
    finally:
        with torch.no_grad():
            for local, exact in saved:
                local.copy_(exact)
