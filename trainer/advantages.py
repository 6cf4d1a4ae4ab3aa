"""Group-relative advantages (GRPO-style), pure torch.

Each prompt is sampled `group_size` times; a sample's advantage is its reward minus its group's mean reward,
optionally divided by the group's standard deviation (`scale_by_std`, the original GRPO normalisation; off by
default, as in Dr. GRPO, because dividing by a small std over-weights nearly-solved and nearly-failed
prompts). A group whose rewards are all equal carries no learning signal: its advantages are exactly 0.

Advantages here are per sample, [num_groups, group_size]; spreading them over the response tokens ([B, T]
for `trainer.objective.policy_objective`) is done where the `TrainBatch` is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AdvantageConfig:
    """How rewards become advantages (`advantage.*` in the run config)."""

    scale_by_std: bool = False
    """Divide each group's centred rewards by (its sample std + eps), as in GRPO; False only centres them."""
    drop_zero_variance_groups: bool = True
    """Leave groups whose rewards are all equal out of the train batch (DAPO's dynamic-sampling filter,
    without the resampling): their advantages are 0, so they only cost compute and dilute the token mean."""


def informative_groups(rewards: Tensor) -> Tensor:
    """[num_groups] bool: True for groups whose rewards are not all equal (the ones with a learning signal)."""
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    return ~(rewards == rewards[:, :1]).all(dim=1)


def group_advantages(
    rewards: Tensor, *, scale_by_std: bool = False, eps: float = 1e-6
) -> tuple[Tensor, dict[str, float]]:
    """Per-group mean-centred rewards, optionally scaled by 1 / (std + eps).

    Args:
        rewards: [num_groups, group_size] rewards, one row per prompt; must be finite.
        scale_by_std: divide by the group's sample standard deviation (Bessel-corrected, as `torch.std`).
        eps: added to the std so a near-constant group does not blow up.

    Returns:
        (advantages, stats): advantages with the shape of `rewards` (floating point), and
        `advantage/zero_variance_groups` (number of groups whose rewards are all equal; their advantages
        are exactly 0), `advantage/zero_variance_frac` (that number over num_groups) and
        `advantage/mean_abs` (mean |advantage| over all samples).
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    if not bool(torch.isfinite(rewards).all()):
        bad = int((~torch.isfinite(rewards)).sum())
        raise ValueError(
            f"rewards hold {bad} non-finite value(s) in shape {tuple(rewards.shape)}; "
            "verifier failures should score the configured error reward, not NaN"
        )
    num_groups, group_size = rewards.shape

    zero_variance = ~informative_groups(rewards)  # [num_groups]; also true for group_size 1
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        advantages = advantages / (rewards.std(dim=1, keepdim=True) + eps)
    # Exactly 0, not a rounding residue of the mean (e.g. three rewards of 0.1).
    advantages = torch.where(zero_variance[:, None], 0.0, advantages)

    num_zero = int(zero_variance.sum())
    stats = {
        "advantage/zero_variance_groups": float(num_zero),
        "advantage/zero_variance_frac": num_zero / num_groups if num_groups else 0.0,
        "advantage/mean_abs": float(advantages.abs().mean()) if advantages.numel() else 0.0,
    }
    return advantages, stats
