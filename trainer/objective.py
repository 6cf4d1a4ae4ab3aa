"""Policy objectives: the ESS trust-batch objective and its baselines, as pure tensor functions.

The math is in `trainer/README.md` ("The ESS objective"); this module is its code. Everything here is a pure
function of tensors and floats: no collectives, no model, no optimizer. The caller (`trainer/step.py`) owns
the two global quantities the objective needs and passes them in:

- `num_tokens` (N): the global number of valid tokens of the whole optimizer step (all micro-batches, all
  ranks). Every sum below is divided by it (DAPO token-level normalisation), so summing the losses of all
  micro-batches and ranks gives the global token mean.
- `ess`: the effective sample size of the ratios. The caller computes it with `ess_partial_sums` on each
  micro-batch, SUM-reduces the three sums across ranks (and, for the per-step scope, across micro-batches)
  and calls `ess_from_sums`. When `ess` is None, `policy_objective` computes it from this call's tokens alone.
  The per-sequence scope passes a [B] tensor instead (`ess_per_sequence`, local to each row: no collective):
  each row's tokens are then capped at, and pulled toward the behaviour policy by, that row's own ESS.

Departures from the paper's reference code (FeynRL `algs/P3O/p3o.py`):
- ESS is passed in, not computed inside the loss with an all-reduce; the two halves are `ess_partial_sums`
  and `ess_from_sums`, and the collective lives in `trainer/step.py`.
- The ratio is exp(clamp(ℓ − b, ±max_log_ratio)) in float32, so a far-off-policy token cannot overflow.
- Tokens whose behaviour logprob is non-finite are dropped from the mask (and so from the ESS sums), not
  zeroed. Because the caller counted N, it must drop them *before* counting: build the mask with
  `valid_token_mask(loss_mask, old_logprobs)` and count `num_tokens` from that mask.

Metrics returned by `policy_objective` (all detached 0-dim float32 tensors), by reduction:

- SUM-ready (a masked sum divided by `num_tokens`; a SUM all-reduce over micro-batches and ranks gives the
  global mean): `loss/total`, `loss/policy`, `loss/kl_behaviour`, `loss/clipfrac`, `loss/ratio/mean`,
  `loss/entropy` (only when `entropy` is given), `loss/ref_kl` (only when `ref_logprobs` is given).
  `loss/kl_knee_fraction` (valid tokens with log r < −10, where `k3_kl`'s knee binds).
- MAX (keys ending in `/max`; reduce with MAX): `loss/ratio/max` (0 when the call has no valid token).
- MIN (keys ending in `/min`; reduce with MIN): `loss/log_ratio/min`, the smallest log r = ℓ − b before any clamp
  (+inf when the call has no valid token).
- Per call (neither SUM nor MAX; the caller averages it over calls): `loss/ess`, the ESS the call used (with
  per-sequence ESS, their mean over the call's valid tokens).

Objectives are registered by name in `LOSSES` (`register_loss`): each entry is a pure per-token function
returning (per-token loss, capped-token mask) and whether the objective carries the (1 − ESS)-weighted
behaviour-KL trust-region term. A new surrogate is one such function under `@register_loss("name")`;
`ObjectiveConfig` accepts exactly the registered names, and `policy_objective` reduces, normalises and adds
the shared terms for all of them alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

BehaviourKL = Literal["k3", "k2", "k3_capped"]
BEHAVIOUR_KL_NAMES: tuple[str, ...] = ("k3", "k2", "k3_capped")
LossPart = Literal["all", "policy", "behaviour_kl"]
# The terms each loss part holds: `all` is the objective; the other two are the gradient diagnostics' parts.
LOSS_PARTS: dict[str, frozenset[str]] = {
    "all": frozenset({"policy", "behaviour_kl", "entropy", "ref_kl"}),
    "policy": frozenset({"policy"}),
    "behaviour_kl": frozenset({"behaviour_kl"}),
}

# Bound on exp() arguments inside the k3 KL estimator (trainer/README.md).
_KL_EXP_CLAMP = 10.0


@dataclass
class ObjectiveConfig:
    """Which policy objective to optimise, and its coefficients (`objective.*` in the run config)."""

    name: str = "ess"
    """Objective, a name registered in `LOSSES`: `ess` (ESS trust batch, the default), `ppo_clip` (GRPO/DAPO
    surrogate) or `reinforce`."""

    clip_low: float = 0.2
    """ppo_clip only: the ratio is clipped below at 1 - clip_low."""

    clip_high: float = 0.28
    """ppo_clip only: the ratio is clipped above at 1 + clip_high (clip-higher when != clip_low)."""

    entropy_coef: float = 0.0
    """Weight of the entropy bonus, -entropy_coef * mean token entropy; 0 turns it off."""

    ref_kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the reference policy, the run's starting weights (a training run keeps a frozen
    copy of them: one more copy of the weights and one more no-grad forward per micro-batch); 0 turns it off."""

    max_log_ratio: float = 20.0
    """|logprob - behaviour logprob| is clamped to this before exp(), so ratios stay finite in float32."""

    behaviour_kl: BehaviourKL = "k3"
    """ess only: the estimator of the (1 - ESS)-weighted KL to the behaviour policy. `k3` is the paper's
    (gradient 1 - 1/r, large where a ratio r has fallen toward 0); `k2` is (log r)^2 / 2 (gradient log r);
    `k3_capped` is k3 with 1/r capped at `behaviour_kl_cap` (gradient bounded by cap - 1). trainer/README.md."""

    behaviour_kl_cap: float = 10.0
    """k3_capped only: the cap on 1/r; below r = 1/cap the estimator continues linearly (> 1)."""

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(
                f"objective.name={self.name!r} is not a known objective; "
                f"use one of {list(LOSSES)}, e.g. objective.name=ess"
            )
        if self.behaviour_kl not in BEHAVIOUR_KL_NAMES:
            raise ValueError(
                f"objective.behaviour_kl={self.behaviour_kl!r} is not a known estimator; "
                f"use one of {list(BEHAVIOUR_KL_NAMES)} (k3 is the paper's), e.g. objective.behaviour_kl=k3"
            )
        for key in ("clip_low", "clip_high", "entropy_coef", "ref_kl_coef", "max_log_ratio", "behaviour_kl_cap"):
            value = getattr(self, key)
            if not math.isfinite(value):
                raise ValueError(f"objective.{key}={value!r} must be a finite number")
        if self.clip_low < 0:
            raise ValueError(f"objective.clip_low={self.clip_low} must be >= 0 (e.g. objective.clip_low=0.2)")
        if self.clip_high < 0:
            raise ValueError(
                f"objective.clip_high={self.clip_high} must be >= 0 (e.g. objective.clip_high=0.28)"
            )
        if self.ref_kl_coef < 0:
            raise ValueError(
                f"objective.ref_kl_coef={self.ref_kl_coef} must be >= 0; use 0 to turn the penalty off"
            )
        if self.behaviour_kl_cap <= 1:
            raise ValueError(
                f"objective.behaviour_kl_cap={self.behaviour_kl_cap} must be > 1 (the default is 10.0)"
            )
        if self.max_log_ratio <= 0:
            raise ValueError(
                f"objective.max_log_ratio={self.max_log_ratio} must be > 0 (the default is 20.0)"
            )


# ----------------------------------------------------------------------------------------------------------
# ESS in two halves: local sums (reduced by the caller), then the scalar.


def valid_token_mask(loss_mask: Tensor, old_logprobs: Tensor) -> Tensor:
    """Tokens the objective trains on: `loss_mask` and a finite behaviour logprob. [B, T] bool.

    The caller counts `num_tokens` from this mask (summed over micro-batches and ranks), so that tokens
    whose behaviour logprob is NaN/inf are dropped from both the loss and its denominator.
    """
    return loss_mask & torch.isfinite(old_logprobs)


def importance_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, max_log_ratio: float) -> Tensor:
    """r = exp(clamp(ℓ − b, ±max_log_ratio)) in float32, [B, T]; 1 where `mask` is False (log-ratio 0).

    Keeps the gradient of `logprobs`; pass `logprobs.detach()` for the ESS sums alone.
    """
    log_ratio = torch.where(mask, logprobs.float() - old_logprobs.float(), 0.0)
    return torch.exp(log_ratio.clamp(-max_log_ratio, max_log_ratio))


def ess_partial_sums(ratio: Tensor, mask: Tensor) -> Tensor:
    """Local ESS sums (Σr, Σr², n) over the masked tokens of `ratio` [B, T]; float64 [3], detached.

    These are additive: the sums of disjoint pieces (micro-batches, ranks) add up to the sums of the whole,
    so the caller SUM-reduces them and passes the result to `ess_from_sums`.
    """
    r = torch.where(mask, ratio.detach().to(torch.float64), 0.0)
    return torch.stack([r.sum(), (r * r).sum(), mask.sum().to(torch.float64)])


def ess_per_sequence(ratio: Tensor, mask: Tensor) -> Tensor:
    """One ESS per row: (Σ_t r)² / (n_i · Σ_t r²) over row i's masked tokens; float64 [B], detached.

    The per-sequence scope (FeynRL `calculate_seq_ess`): a sequence whose own ratios are uneven gets a tight
    cap and a strong pull toward the behaviour policy, whatever the rest of the batch looks like. Each value is
    `ess_from_sums` of that row's sums: 1.0 for a row with no valid token or a non-finite or zero sum,
    otherwise clamped into [1/n_i, 1].
    """
    r = torch.where(mask, ratio.detach().to(torch.float64), 0.0)
    sums = torch.stack([r.sum(-1), (r * r).sum(-1), mask.sum(-1).to(torch.float64)], dim=-1).cpu()
    return torch.tensor([ess_from_sums(row) for row in sums], dtype=torch.float64, device=ratio.device)


def ess_from_sums(sums: Tensor) -> float:
    """ESS = (Σr)² / (n · Σr²) from the (reduced) sums of `ess_partial_sums`, in (0, 1].

    Returns 1.0 (no trust-region pull) when n == 0, when any sum is non-finite or when Σr² == 0. Otherwise
    the value is clamped into [1/n, 1], its exact range for non-negative ratios, against rounding.
    """
    total, total_sq, count = (float(x) for x in sums.detach().to(torch.float64).cpu())
    if count <= 0 or not all(math.isfinite(x) for x in (total, total_sq, count)) or total_sq <= 0:
        return 1.0
    ess = total * total / (count * total_sq)
    if not math.isfinite(ess):
        return 1.0
    return min(1.0, max(ess, 1.0 / count))


# ----------------------------------------------------------------------------------------------------------
# Token-level terms: the KL estimators, then the registered surrogates, each returning (per-token loss [B, T],
# capped [B, T] bool); reduction is elsewhere.


def k3_kl(logprobs: Tensor, other_logprobs: Tensor) -> Tensor:
    """k3 estimator of KL(π ‖ π_other) per token: (ℓ − o) + exp(clamp(o − ℓ, −10, 10)) − 1, ≥ 0. [B, T].

    The value is FeynRL's, clamp included (so the loss and its metrics equal FeynRL's). The gradient is not
    the clamped expression's: below the knee log r = ℓ − o < −10 the clamp makes the exp term constant, and
    the rest, ℓ − o, has gradient +1, which pushes a token that already fell e^10 below the other policy
    further down. The gradient here is k3's own, 1 − 1/r, with 1/r held at its knee value e^10 below the
    knee: the same sign as k3's everywhere (toward the other policy), continuous, and at most e^10 − 1 in
    size (trainer/README.md, "The k3 knee").
    """
    log_ratio = logprobs - other_logprobs
    value = log_ratio + torch.exp((-log_ratio).clamp(-_KL_EXP_CLAMP, _KL_EXP_CLAMP)) - 1.0
    grad = 1.0 - torch.exp((-log_ratio).clamp(max=_KL_EXP_CLAMP))  # d value / d ℓ, knee held below −10
    # value in the forward; grad (and −grad for o) in the backward.
    return value.detach() + grad.detach() * (log_ratio - log_ratio.detach())


def kl_knee_mask(logprobs: Tensor, other_logprobs: Tensor) -> Tensor:
    """Where `k3_kl`'s knee binds: log r = ℓ − o below −10 (its value clamped, its gradient held). [B, T] bool."""
    return (logprobs - other_logprobs) < -_KL_EXP_CLAMP


def k2_kl(logprobs: Tensor, other_logprobs: Tensor) -> Tensor:
    """k2 estimator of KL(π ‖ π_other) per token: ½(ℓ − o)², ≥ 0. Its gradient in ℓ is ℓ − o = log r. [B, T]."""
    log_ratio = logprobs - other_logprobs
    return 0.5 * log_ratio * log_ratio


def k3_kl_capped(logprobs: Tensor, other_logprobs: Tensor, cap: float) -> Tensor:
    """k3 with 1/r capped at `cap`: equal to k3 where r ≥ 1/cap, continued linearly with slope 1 − cap below.

    Convex, ≥ 0 and continuously differentiable; its gradient in ℓ is 1 − min(1/r, cap), so its magnitude is
    at most cap − 1 (k3's grows as 1/r). [B, T].
    """
    if not cap > 1:
        raise ValueError(f"cap={cap} must be > 1")
    log_ratio = logprobs - other_logprobs
    knee = -math.log(cap)  # log r at which 1/r reaches the cap
    inside = torch.maximum(log_ratio, torch.full_like(log_ratio, knee))
    k3 = inside + torch.exp(-inside) - 1.0  # k3 at max(log r, knee): finite everywhere
    return torch.where(log_ratio >= knee, k3, k3 + (1.0 - cap) * (log_ratio - knee))


def behaviour_kl_estimate(logprobs: Tensor, other_logprobs: Tensor, cfg: ObjectiveConfig) -> Tensor:
    """The per-token behaviour-KL estimator `cfg.behaviour_kl` (k3, the paper's, by default). [B, T]."""
    match cfg.behaviour_kl:
        case "k3":
            return k3_kl(logprobs, other_logprobs)
        case "k2":
            return k2_kl(logprobs, other_logprobs)
        case "k3_capped":
            return k3_kl_capped(logprobs, other_logprobs, cfg.behaviour_kl_cap)
        case _:
            raise ValueError(f"objective.behaviour_kl={cfg.behaviour_kl!r} is not one of {list(BEHAVIOUR_KL_NAMES)}")


class TokenLoss(Protocol):
    """A surrogate's pure per-token function: (per-token loss [B, T], capped [B, T] bool).

    Called with the sanitised, masked tensors of one micro-batch: `logprobs` ℓ (with gradient), `ratio` r
    (with gradient through ℓ), `advantages` A, `ess` (a float, or [B, 1] with one ESS per row) and the
    config. It may ignore any of them; reduction, normalisation and the shared terms are `policy_objective`'s.
    """

    def __call__(
        self, *, logprobs: Tensor, ratio: Tensor, advantages: Tensor, ess: float | Tensor,
        cfg: ObjectiveConfig,
    ) -> tuple[Tensor, Tensor]: ...  # fmt: skip


@dataclass(frozen=True)
class RegisteredLoss:
    """An objective of the registry: its per-token policy term, and whether it adds the trust-region term."""

    token_loss: TokenLoss
    behaviour_kl: bool
    """True: the loss also holds (1 − ESS)·Σ kl_t, the behaviour-KL trust-region term (the ESS objective)."""


LOSSES: dict[str, RegisteredLoss] = {}
"""`objective.name` → its registered loss, filled by `register_loss`; the names `ObjectiveConfig` accepts."""


def register_loss(name: str, *, behaviour_kl: bool = False) -> Callable[[TokenLoss], TokenLoss]:
    """Decorator: register a `TokenLoss` as the objective `name` (`behaviour_kl`: see `RegisteredLoss`)."""

    def register(token_loss: TokenLoss) -> TokenLoss:
        if name in LOSSES:
            raise ValueError(f"objective {name!r} is already registered")
        LOSSES[name] = RegisteredLoss(token_loss, behaviour_kl)
        return token_loss

    return register


@register_loss("ess", behaviour_kl=True)
def ess_token_loss(
    *, logprobs: Tensor, ratio: Tensor, advantages: Tensor, ess: float | Tensor, cfg: ObjectiveConfig
) -> tuple[Tensor, Tensor]:
    """ESS policy term: −ρ·ℓ·A with ρ = stopgrad(clamp(r, 0, ESS)) (README, "the cap").

    `ess` is one float, or a [B, 1] tensor (one cap per row, the per-sequence scope). Its gradient is
    −ρ·A·∇ℓ: the capped weight carries none. The (1 − ESS)·kl trust-region term (`behaviour_kl=True`) is added
    by `policy_objective`, which reports it separately (`loss/kl_behaviour`).
    """
    r = ratio.detach()
    cap = torch.as_tensor(ess, dtype=r.dtype, device=r.device)
    weight = torch.minimum(r.clamp(min=0.0), cap)
    return -weight * logprobs * advantages, r > cap


@register_loss("ppo_clip")
def ppo_clip_token_loss(
    *, logprobs: Tensor, ratio: Tensor, advantages: Tensor, ess: float | Tensor, cfg: ObjectiveConfig
) -> tuple[Tensor, Tensor]:
    """PPO/DAPO clipped surrogate: −min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A), gradient through r.

    A token is "capped" when the clipped branch is active and cuts its gradient to zero.
    """
    clip_low, clip_high = cfg.clip_low, cfg.clip_high
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    r = ratio.detach()
    capped = ((advantages > 0) & (r > 1.0 + clip_high)) | ((advantages < 0) & (r < 1.0 - clip_low))
    return -torch.minimum(unclipped, clipped), capped


@register_loss("reinforce")
def reinforce_token_loss(
    *, logprobs: Tensor, ratio: Tensor, advantages: Tensor, ess: float | Tensor, cfg: ObjectiveConfig
) -> tuple[Tensor, Tensor]:
    """REINFORCE without importance correction: −ℓ·A. Nothing is capped."""
    return -logprobs * advantages, torch.zeros_like(logprobs, dtype=torch.bool)


# ----------------------------------------------------------------------------------------------------------


def policy_objective(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: ObjectiveConfig,
    *,
    num_tokens: float,
    ess: float | Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    part: LossPart = "all",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of one micro-batch for `cfg.name`, normalised by the global token count; and its metrics.

    Args:
        logprobs: [B, T] current-policy logprobs of the sampled tokens, with gradient.
        old_logprobs: [B, T] behaviour logprobs (from the engine that sampled the tokens).
        advantages: [B, T] per-token advantages.
        loss_mask: [B, T] bool, True on response tokens to train on. Tokens whose `old_logprobs` is
            non-finite are dropped here too; count `num_tokens` from `valid_token_mask` so N agrees.
        cfg: the objective config.
        num_tokens: N, the global number of valid tokens in the optimizer step (all micro-batches, ranks).
            0 is allowed (an all-padding step) and gives a zero loss.
        ess: the ESS reduced by the caller (`ess_from_sums`); a [B] tensor gives each row its own ESS (the
            per-sequence scope, `ess_per_sequence`); None computes one from this call alone.
        ref_logprobs: [B, T] reference-policy logprobs; required when `cfg.ref_kl_coef > 0`.
        entropy: [B, T] token entropies, with gradient; required when `cfg.entropy_coef > 0`.
        part: which terms the returned loss holds: `all` (the objective), or for gradient diagnostics only
            `policy` (the surrogate alone) or `behaviour_kl` (the (1 − ESS)-weighted KL alone; zero for the
            objectives without one). Neither part holds the entropy or reference-KL terms. The metrics but
            `loss/total` (the returned loss) are the same whatever the part.

    Returns:
        (loss, metrics): the 0-dim float32 loss [Σ per-token terms] / N, and the metrics listed in the
        module docstring. Padded positions may hold any value, NaN included: they never reach the loss,
        its gradient or the metrics.
    """
    _check_inputs(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs, entropy, cfg)
    num_tokens = float(num_tokens)
    if not math.isfinite(num_tokens) or num_tokens < 0:
        raise ValueError(
            f"num_tokens={num_tokens} must be a finite count >= 0 (the global valid-token count)"
        )
    denom = num_tokens if num_tokens > 0 else 1.0

    mask = valid_token_mask(loss_mask, old_logprobs)
    # Sanitise first: torch.where gives padded positions a zero gradient and keeps garbage (even NaN) there
    # out of every product downstream, in the forward and the backward pass.
    logp = torch.where(mask, logprobs.float(), 0.0)
    old = torch.where(mask, old_logprobs.float(), 0.0)
    adv = torch.where(mask, advantages.float(), 0.0)

    ratio = importance_ratio(logp, old, mask, cfg.max_log_ratio)
    kl_behaviour = torch.where(mask, behaviour_kl_estimate(logp, old, cfg), 0.0)

    if part not in LOSS_PARTS:
        raise ValueError(f"part={part!r} must be one of {list(LOSS_PARTS)}")
    if ess is None:
        ess = ess_from_sums(ess_partial_sums(ratio, mask))
    if isinstance(ess, Tensor) and ess.ndim == 0:
        ess = float(ess)
    if isinstance(ess, Tensor):
        ess = ess.to(mask.device)
        if ess.shape != (mask.shape[0],):
            raise ValueError(
                f"a per-sequence ess must have shape [B] = ({mask.shape[0]},), got {tuple(ess.shape)}"
            )
        if not bool(((ess > 0) & (ess <= 1)).all()):
            raise ValueError("every per-sequence ess must be in (0, 1]; compute them with ess_per_sequence")
        ess_cap: float | Tensor = ess.detach().to(torch.float32)[:, None]  # [B, 1]
        counts = mask.sum(-1).to(torch.float64)
        ess_used = float((ess.double() * counts).sum() / counts.sum()) if counts.sum() > 0 else 1.0
    else:
        ess = float(ess)
        if not 0.0 < ess <= 1.0:
            raise ValueError(f"ess={ess} must be in (0, 1]; compute it with ess_from_sums")
        ess_cap, ess_used = ess, ess

    registered = LOSSES.get(cfg.name)
    if registered is None:
        raise ValueError(f"objective.name={cfg.name!r} is not one of {list(LOSSES)}")
    token_loss, capped = registered.token_loss(
        logprobs=logp, ratio=ratio, advantages=adv, ess=ess_cap, cfg=cfg
    )
    kl_coef: float | Tensor = 1.0 - ess_cap if registered.behaviour_kl else 0.0  # the behaviour-KL term's weight
    policy_sum = torch.where(mask, token_loss, 0.0).sum()
    kl_sum = kl_behaviour.sum()
    weighted_kl_sum: Tensor | None = None  # (1 − ESS)·Σ kl; None: no behaviour-KL term (baselines, ESS = 1)
    if isinstance(kl_coef, Tensor):
        weighted_kl_sum = (kl_coef * kl_behaviour).sum()
    elif kl_coef != 0:
        weighted_kl_sum = kl_coef * kl_sum
    terms = LOSS_PARTS[part]
    # 0 · policy_sum keeps the graph (and FSDP's hooks) the same when the part leaves the policy term out.
    loss_sum = policy_sum if "policy" in terms else 0.0 * policy_sum
    if "behaviour_kl" in terms and weighted_kl_sum is not None:
        loss_sum = loss_sum + weighted_kl_sum

    metrics: dict[str, Tensor] = {}
    if entropy is not None:
        ent = torch.where(mask, entropy.float(), 0.0)
        if cfg.entropy_coef != 0 and "entropy" in terms:
            loss_sum = loss_sum - cfg.entropy_coef * ent.sum()
        metrics["loss/entropy"] = ent.sum().detach() / denom
    if ref_logprobs is not None:
        ref = torch.where(mask, ref_logprobs.float(), 0.0)
        ref_kl = torch.where(mask, k3_kl(logp, ref), 0.0)
        if cfg.ref_kl_coef > 0 and "ref_kl" in terms:
            loss_sum = loss_sum + cfg.ref_kl_coef * ref_kl.sum()
        metrics["loss/ref_kl"] = ref_kl.sum().detach() / denom

    loss = loss_sum / denom
    ratio_valid = torch.where(mask, ratio.detach(), 0.0)
    log_ratio_valid = torch.where(mask, (logp - old).detach(), math.inf)
    metrics.update(
        {
            "loss/total": loss.detach(),
            "loss/policy": policy_sum.detach() / denom,
            "loss/kl_behaviour": kl_sum.detach() / denom,
            "loss/kl_knee_fraction": (kl_knee_mask(logp, old) & mask).sum().float() / denom,
            "loss/log_ratio/min": log_ratio_valid.min() if log_ratio_valid.numel() else logp.new_tensor(math.inf),
            "loss/clipfrac": (capped & mask).sum().float() / denom,
            "loss/ratio/mean": ratio_valid.sum() / denom,
            "loss/ratio/max": ratio_valid.max() if ratio_valid.numel() else ratio_valid.new_zeros(()),
            "loss/ess": torch.tensor(ess_used, dtype=torch.float32, device=logprobs.device),
        }
    )
    return loss, metrics


def _check_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    ref_logprobs: Tensor | None,
    entropy: Tensor | None,
    cfg: ObjectiveConfig,
) -> None:
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be a bool tensor, got {loss_mask.dtype}")
    tensors = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages}
    tensors.update({"ref_logprobs": ref_logprobs, "entropy": entropy})
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != loss_mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but loss_mask has {tuple(loss_mask.shape)}; "
                "all inputs are [B, T]"
            )
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError(
            f"objective.entropy_coef={cfg.entropy_coef} needs the token entropies: pass entropy=..., "
            "or set objective.entropy_coef=0"
        )
    if cfg.ref_kl_coef > 0 and ref_logprobs is None:
        raise ValueError(
            f"objective.ref_kl_coef={cfg.ref_kl_coef} needs reference logprobs: pass ref_logprobs=..., "
            "or set objective.ref_kl_coef=0"
        )
