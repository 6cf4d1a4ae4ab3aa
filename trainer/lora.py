"""LoRA adapters (`trainer.lora`): low-rank updates trained over frozen base weights, through PEFT.

``apply_lora(model, cfg)`` injects PEFT's LoRA layers into the Hugging Face model in place
(``peft.inject_adapter_in_model``): the model stays its own transformers class, so everything that drives it
(the forward of trainer/logprobs.py, FSDP2's ``shard_model`` per decoder layer, ``save_pretrained`` of the
config, DCP checkpoints) is unchanged. Each targeted linear ``X`` becomes ``X.base_layer`` (frozen) plus
``X.lora_A.default`` (r x in) and ``X.lora_B.default`` (out x r, zero at the start, so the model starts
exactly where the base is). Only the LoRA matrices require gradients; the optimizer holds only them.

Where the weights leave the trainer they are merged, ``W + (alpha / r) B A``, under the base model's own names
(`merged_state_dict`): every published version (disk or broadcast, so the built-in server and SGLang load a
plain model; SGLang's ``--enable-lora`` does not run on its CPU backend), unless ``rollout.sglang.lora_adapters``
publishes the adapter alone to SGLang GPU servers (`lora_weights`, app/rollout/fleet.py), and every checkpoint's ``model/``
directory, which ``serve``, ``eval`` and ``train`` take like any other. Each checkpoint also keeps the adapter
alone as a PEFT directory (``adapter/``: adapter_config.json + adapter_model.safetensors, loadable with
``peft.PeftModel.from_pretrained(base, dir)``).

The merge reads the full state dict (gathered under FSDP2: ``lora_A`` and ``lora_B`` are sharded like any
weight), so it is the same code with one process or many.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

ADAPTER = "default"
_A, _B, _BASE = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight", ".base_layer."


@dataclass
class LoraConfig:
    """``trainer.lora``: rank 0 trains every weight (full fine-tuning); rank >= 1 trains LoRA adapters only."""

    rank: int = 0
    """LoRA rank r; 0 = off (full fine-tuning)."""
    alpha: float = 32.0
    """The update is (alpha / r) B A. With alpha fixed, the best learning rate barely depends on r (LoRA Without
    Regret); it is about 10x full fine-tuning's (bench/README.md, LoRA)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt (``q_proj``, ``v_proj``, ...), or ``all-linear``: every linear layer but the
    output head."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"trainer.lora.rank={self.rank!r} must be an integer >= 0 (0 = off)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) \
                or self.alpha <= 0:  # fmt: skip
            raise ValueError(f"trainer.lora.alpha={self.alpha!r} must be a positive number")
        targets = list(self.target_modules)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"trainer.lora.target_modules={targets!r} must be a non-empty list of module names")
        self.target_modules = targets

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _peft_config(cfg: LoraConfig):
    import peft

    targets = "all-linear" if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    return peft.LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, target_modules=targets, bias="none", task_type="CAUSAL_LM"
    )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, *, seed: int = 0) -> torch.nn.Module:
    """Inject LoRA layers into ``model`` in place (before `shard_model` and the optimizer) and freeze everything
    else; returns the model. A no-op when ``cfg.rank`` is 0.

    ``lora_A``'s random start comes from ``seed`` (the global RNG is left as it was), so every rank of a
    torchrun job, and a one-process run of the same config, start from the same adapters."""
    if not cfg.enabled:
        return model
    import peft

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft.inject_adapter_in_model(_peft_config(cfg), model, adapter_name=ADAPTER)
    except ValueError as exc:  # e.g. a target module name the model does not have
        raise ValueError(f"trainer.lora: {exc}") from None
    trainable = 0
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
        trainable += param.numel() if param.requires_grad else 0
    if trainable == 0:
        raise ValueError(f"trainer.lora.target_modules={cfg.target_modules} matched no linear layer of the model")
    model.trustbatch_lora = cfg  # read by `merged_state_dict` callers and checkpoints
    return model


def lora_of(model: torch.nn.Module) -> LoraConfig | None:
    """The LoRA settings `apply_lora` gave ``model`` (None: a plain model)."""
    return getattr(model, "trustbatch_lora", None)


def merged_state_dict(state: dict[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """A full state dict with LoRA layers -> the base model's state dict with ``W + scaling * B A`` merged in (float32
    arithmetic, cast back to W's dtype). A state dict without LoRA keys comes back as it is."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if _BASE not in key:
            out[key] = value
            continue
        prefix, _, leaf = key.partition(_BASE)
        if leaf == "weight" and prefix + _A in state:
            a, b = state[prefix + _A].float(), state[prefix + _B].float()
            value = (value.float() + scaling * (b @ a)).to(value.dtype)
        out[f"{prefix}.{leaf}"] = value
    return out


def lora_weights(model: torch.nn.Module) -> dict[str, Tensor]:
    """The LoRA matrices of ``model`` alone, full tensors on the CPU, under their state-dict names: what an adapter
    publication sends, without gathering the frozen base. Under FSDP2 each is all-gathered (``full_tensor``), so
    every rank must call it."""
    out = {}
    for name, param in model.named_parameters():
        if ".lora_" in name:
            value = param.detach()
            if hasattr(value, "full_tensor"):  # a DTensor shard under FSDP2
                value = value.full_tensor()
            out[name] = value.cpu()
    return out


def adapter_state_dict(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The LoRA matrices of a full state dict, under PEFT's saved names
    (``base_model.model.<module>.lora_A.weight``)."""
    return {
        "base_model.model." + key.replace(f".{ADAPTER}.", "."): value.contiguous()
        for key, value in state.items()
        if ".lora_" in key
    }


def save_adapter(state: dict[str, Tensor], cfg: LoraConfig, base_model_path: str, out: Path) -> None:
    """Write the adapter of ``state`` as a PEFT directory (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    peft_cfg = _peft_config(cfg)
    peft_cfg.base_model_name_or_path = base_model_path
    peft_cfg.save_pretrained(str(out))
    save_file(adapter_state_dict(state), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "adapter_config.json").read_text())
    if config.get("r") != cfg.rank:  # what PEFT wrote must be what it will read back
        raise RuntimeError(f"{out}/adapter_config.json has r={config.get('r')}, expected {cfg.rank}")
