"""Where the rollout side meets the trainer: the only app/rollout module that imports trainer/.

Everything else under app/rollout talks to engines (in process or over HTTP) and never imports trainer/
(tests/unit/test_import_rules.py holds it to that). What rollout needs from the trainer is here, and only here:

- `gather_weights`: the one gather-and-cast of a new policy version for engines that take tensors (the embedded
  engine in memory, SGLang over a process group): every rank's full state dict, floating point cast to the dtype
  sent. Under FSDP2 it is a collective: every trainer rank takes part;
- `save_version`: the Hugging Face directory of a version that servers load with /update_weights_from_disk
  (gathered by every rank, written by rank 0; every rank returns once it is complete);
- `save_adapter_version`: a LoRA run's version as its PEFT adapter directory alone (/load_lora_adapter), the
  same way;
- `reference_logprobs`: the trainer's float32 log-probabilities of a token sequence, with the weights rounded to
  the engines' weight dtype, what the weight-publication check (app/rollout/probe.py) compares every engine with
  (a collective forward under FSDP2);
- for the distributed method (app/rollout/weight_sync.py): `WeightUpdateGroup` (rank 0 of the weight-update
  process group), `plan_buckets` and `tensor_specs` (the buckets and the name/dtype/shape lists of SGLang's
  /update_weights_from_distributed), all from trainer/weights.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import Tensor

from trainer.checkpoint import save_hf_checkpoint
from trainer.distributed import barrier
from trainer.logprobs import token_logprobs
from trainer.lora import lora_of, lora_weights, save_adapter
from trainer.precision import weights_rounded_to
from trainer.weights import WeightUpdateGroup, plan_buckets, state_dict_for_sync, tensor_specs

__all__ = [
    "WeightUpdateGroup", "gather_weights", "plan_buckets", "reference_logprobs", "save_adapter_version",
    "save_version", "tensor_specs",
]  # fmt: skip


def reference_logprobs(model: torch.nn.Module, ids: list[int], *, weight_dtype: str | None = None) -> list[float]:
    """The trainer's log-probabilities of ``ids[1:]`` given their prefix (float32 arithmetic, temperature 1, no
    autocast), from the master weights, or from them rounded to ``weight_dtype`` (e.g. "bfloat16": the weights a
    bf16 engine holds; `weights_rounded_to`). Under FSDP2 every rank calls it (the forward all-gathers the
    weights)."""
    device = next(model.parameters()).device
    tokens = torch.tensor([list(ids)], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), weights_rounded_to(model, weight_dtype):
            logprobs, _ = token_logprobs(model, tokens, torch.ones_like(tokens))
    finally:
        model.train(was_training)
    return logprobs[0, 1:].float().cpu().tolist()


def gather_weights(model: torch.nn.Module, *, dtype: str | None = None) -> dict[str, Tensor]:
    """Every rank's copy of the full state dict (each rank feeds engines of its own), detached from the model
    and cast to ``dtype`` (e.g. ``"bfloat16"``; None keeps the model's); a collective under FSDP2."""
    return state_dict_for_sync(model, dtype=dtype, every_rank=True)


def save_version(model: torch.nn.Module, tokenizer, path: Path, *, is_main: bool) -> Path:
    """Write ``model`` (and ``tokenizer``) as the HF directory ``path``: every rank takes part in gathering the
    weights, rank 0 writes them (atomically), and all wait until the directory is complete."""
    save_hf_checkpoint(model, tokenizer, path, is_main=is_main)
    barrier()
    return Path(path)


def save_adapter_version(model: torch.nn.Module, path: Path, *, is_main: bool) -> Path:
    """Write the LoRA adapter of ``model`` alone as the PEFT directory ``path`` (adapter_config.json +
    adapter_model.safetensors, a few MB): every rank gathers the adapter, rank 0 writes it (into a temporary
    sibling, then renamed), and all wait until it is complete."""
    lora = lora_of(model)
    if lora is None:
        raise ValueError("an adapter publication needs a LoRA model (trainer.lora.rank > 0)")
    weights = lora_weights(model)  # collective under FSDP2
    path = Path(path)
    if is_main:
        tmp = path.with_name(f".{path.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_adapter(weights, lora, getattr(model.config, "_name_or_path", ""), tmp)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    barrier()
    return path
