"""AdamW and its learning-rate schedule (`optim.*` in the run config).

The schedule is a multiplier on `lr`, indexed by the number of optimizer steps already taken (s = 0 for the
first step): linear warmup (s + 1) / warmup_steps for s < warmup_steps, then over the remaining
`total_steps - warmup_steps` steps either constant 1, linear decay or cosine decay. The first step after
warmup runs at the peak and the decay reaches `min_lr_ratio` at s = total_steps, i.e. just after the last
step (the Hugging Face `get_*_schedule_with_warmup` convention); later steps stay at `min_lr_ratio`. Weight decay applies to matrices only (parameters with ndim >= 2), not to biases or norm
gains, as is usual for transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")


@dataclass
class OptimConfig:
    """AdamW hyperparameters and the learning-rate schedule."""

    lr: float = 1e-5
    """Peak learning rate (reached after warmup). RL on small models: 1e-6 to 3e-5."""

    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay, applied to weight matrices only; 0 turns it off."""

    beta1: float = 0.9
    """Adam first-moment decay, in [0, 1)."""

    beta2: float = 0.999
    """Adam second-moment decay, in [0, 1)."""

    eps: float = 1e-8
    """Adam denominator epsilon, > 0."""

    schedule: str = "constant"
    """Learning-rate shape after warmup: constant | linear | cosine (decay to min_lr_ratio * lr)."""

    warmup_steps: int = 0
    """Optimizer steps of linear warmup from lr / warmup_steps up to lr; 0 starts at lr."""

    min_lr_ratio: float = 0.1
    """linear/cosine only: the final learning rate as a fraction of lr, in [0, 1]."""

    def __post_init__(self) -> None:
        for key in ("lr", "weight_decay", "beta1", "beta2", "eps", "min_lr_ratio"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"optim.{key}={value!r} must be a finite number")
        if self.lr <= 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0 (e.g. optim.lr=1e-5)")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay={self.weight_decay} must be >= 0; use 0 to turn it off")
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            if not 0 <= value < 1:
                raise ValueError(f"optim.{key}={value} must be in [0, 1) (defaults: beta1=0.9, beta2=0.999)")
        if self.eps <= 0:
            raise ValueError(f"optim.eps={self.eps} must be > 0 (e.g. optim.eps=1e-8)")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"optim.schedule={self.schedule!r} is not a known schedule; use one of {list(SCHEDULES)}"
            )
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps!r} must be an integer >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1] (e.g. 0.1)")


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The factor on `cfg.lr` for the optimizer step that follows `step` steps already taken."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - cfg.min_lr_ratio) * progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, total_steps: int
) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW over the trainable parameters of `model` (sharded or not) and its LambdaLR schedule.

    Build it after `shard_model`, so the optimizer holds the sharded parameters. Call `scheduler.step()`
    once per optimizer step (`train_step` does).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1 (the number of optimizer steps of the run)")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"{type(model).__name__} has no trainable parameters (all requires_grad=False)")
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [
        {"params": params, "weight_decay": wd}
        for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0))
        if params
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    scheduler = LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))
    return optimizer, scheduler
