"""One optimizer step: micro-batches, the global token count, the ESS reduction, backward, clipping, update.

This is the one module that calls both sides: the pure objective (`trainer/objective.py`) and the
systems code (`trainer/distributed.py`, through the injected `Reducer`; no collective is called here).

`train_step` in order (torchtitan `train_step`), each stage a module-level function (the ESS's: `EssScope`):
1. `plan_step`: valid tokens = `valid_token_mask(loss_mask, old_logprobs)` (tokens with a non-finite
   behaviour logprob are dropped, not zeroed). N = their count SUM-reduced over ranks, once, before any
   forward.
2. `plan_step`: the batch is cut into micro-batches of `micro_batch_size` rows (`StepPlan`). Every rank must
   run the same number of forwards and backwards (FSDP2 communicates in each), so the count is MAX-reduced and
   a rank with fewer rows runs padding micro-batches: one of its rows with an all-False mask, which adds 0 to
   the loss, the gradient, N and the ESS sums. Any batch size on any rank works; no divisibility is required.
3. `EssScope` (`EssScope.prepare`, then `EssScope.micro_batch_ess` per micro-batch): ESS (trainer/README.md)
   from the detached ratios: local (Σr, Σr², n) → `reducer.sum_` → `ess_from_sums`.
   `ess_scope="micro_batch"` (default, as FeynRL): one ESS per micro-batch index, over that micro-batch on
   all ranks. `ess_scope="step"`: one ESS over the whole step, from an extra no-grad forward pass over all
   micro-batches before the training pass (one more forward per step). `ess_scope="sequence"`: one ESS per
   sequence over its own tokens (`ess_per_sequence`; no collective).
4. `forward_backward`, per micro-batch: the forward (`PolicyForward`), loss =
   `policy_objective(..., num_tokens=N, ess=ess)`, `(loss * dp_scale).backward()`.
5. `clip_and_guard`: pre-clip global grad norm, clipped to `max_grad_norm` with
   `torch.nn.utils.clip_grad_norm_`. With `diagnose=True`, `grad_diagnostics` runs two passes before the
   training pass to measure the pre-clip norms of the policy term's gradient and of the behaviour-KL term's
   alone (two more forwards and backwards; the gradients are discarded).
6. `clip_and_guard`, the non-finite guard: when the loss or the grad norm is non-finite on ANY rank (a flag
   MAX-reduced), the gradients are zeroed and neither the optimizer nor the scheduler steps.
7. `optimizer_step`: `optimizer.step()`, `scheduler.step()`, `optimizer.zero_grad()`. Then `reduce_metrics`
   reduces the training pass's metrics over micro-batches and ranks.

Gradient convention (DP scaling). Each micro-batch loss is its masked token sum divided by the
GLOBAL N, so gradients accumulated over micro-batches and summed over ranks are the gradient of
(global token-sum loss) / N. FSDP2 reduce-scatters gradients with an AVERAGE over the W data-parallel ranks;
backpropagating `loss * dp_scale` with `dp_scale = W` cancels it. After the step every parameter's gradient
equals ∇[(Σ over all tokens of all ranks) / N], whatever the world size and the micro-batch size. No
gradient-accumulation factor appears (FeynRL's `dp_scale = ga_steps * world_size` cancels a per-micro-batch
mean, which we never take). This assumes gradients averaged over the reducer's group, as `shard_model` sets
up: a multi-rank reducer with an unsharded model (no gradient sync at all) is refused.

Metrics returned (Python floats, identical on every rank): the objective's `loss/*` keys reduced over
micro-batches and ranks as trainer/objective.py describes, plus `train/grad_norm` (before clipping),
`train/clipped` (1 when clipping changed the gradient), `train/lr`, `train/num_tokens`, `train/micro_batches`,
`train/skipped` and `timing/train_step`; with `diagnose=True` also `train/grad_norm/policy` and
`train/grad_norm/behaviour_kl`; with `TrainBatch.fresh` rows at policy lag 0, `loss/ess_lag0`,
`loss/logprob_gap_lag0` and `loss/lag0_tokens` (the engine's mismatch apart from staleness); with
`TrainBatch.turns` (multi-turn trajectories), `loss/ess_turn/<k>`, `loss/logprob_gap_turn/<k>` and
`loss/tokens_turn/<k>` for turns 0, 1, 2 and 3-or-later (`TURN_BUCKETS`). What each one
means is in the metric glossary, trainer/README.md.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from trainer.distributed import Reducer, full_value, is_sharded
from trainer.logprobs import shared_prefix_token_logprobs, token_logprobs
from trainer.lora import LoraConfig
from trainer.objective import (
    LossPart,
    ObjectiveConfig,
    ess_from_sums,
    ess_partial_sums,
    ess_per_sequence,
    importance_ratio,
    policy_objective,
    valid_token_mask,
)
from trainer.precision import check_compute_dtype, compute

ESS_SCOPES: tuple[str, ...] = ("micro_batch", "step", "sequence")
# ess_scope=sequence: Σ ESS_i·n_i and Σ n_i, reduced with the SUM metrics and popped from the result.
_SEQ_ESS_SUM, _SEQ_ESS_TOKENS = "_sequence_ess/weighted_sum", "_sequence_ess/tokens"


@dataclass
class TrainBatch:
    """The tensors of one optimizer step on one rank, all [B, L] and aligned by token (index t = token t).

    Validated once, here; values at positions where `loss_mask` is False are never read.
    """

    input_ids: Tensor
    """[B, L] int64 prompt + response token ids, right- or left-padded."""
    attention_mask: Tensor
    """[B, L] bool or integer, 1 on real tokens."""
    loss_mask: Tensor
    """[B, L] bool, True where input_ids[:, t] is a response token that is trained on; False at t = 0."""
    old_logprobs: Tensor
    """[B, L] float32 behaviour logprob of token t (from the engine that sampled it); non-finite → dropped."""
    advantages: Tensor
    """[B, L] float32 advantage of token t; must be finite where loss_mask is True."""
    ref_logprobs: Tensor | None = None
    """[B, L] float32 reference-policy logprob of token t, or None (needed when objective.ref_kl_coef > 0)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts: the trainer's logprobs and entropies are computed at it, so they
    are comparable with the behaviour logprobs (which engines report at the sampling temperature)."""
    fresh: Tensor | None = None
    """[B] bool, True for rows sampled with the weights the trainer holds (policy lag 0), or None (unknown).
    Their ratios differ from 1 only by the engine's mismatch with the trainer (precision, kernels, batching):
    `loss/ess_lag0` and `loss/logprob_gap_lag0` measure it apart from staleness."""
    turns: Tensor | None = None
    """[B, L] int64 model turn of token t in a multi-turn trajectory (-1 off the response), or None (one turn).
    Only read for the per-turn metrics `loss/ess_turn/<k>` and `loss/logprob_gap_turn/<k>`."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(
                f"TrainBatch.temperature={self.temperature} must be > 0 (the sampling temperature)"
            )
        fields = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "loss_mask": self.loss_mask,
            "old_logprobs": self.old_logprobs,
            "advantages": self.advantages,
            "ref_logprobs": self.ref_logprobs,
        }
        given = {k: v for k, v in fields.items() if v is not None}
        for name, value in given.items():
            if not isinstance(value, Tensor):
                raise ValueError(f"TrainBatch.{name} must be a torch.Tensor, got {type(value).__name__}")
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in given.items())
        if self.input_ids.dim() != 2 or any(v.shape != self.input_ids.shape for v in given.values()):
            raise ValueError(f"TrainBatch tensors must all be [B, L] with the same shape; got {shapes}")
        if self.input_ids.shape[0] < 1 or self.input_ids.shape[1] < 2:
            raise ValueError(f"TrainBatch needs B >= 1 rows of L >= 2 tokens; got {shapes}")
        devices = {str(v.device) for v in given.values()}
        if len(devices) > 1:
            raise ValueError(f"TrainBatch tensors must be on one device; got {sorted(devices)}")
        if self.input_ids.dtype != torch.int64:
            raise ValueError(f"TrainBatch.input_ids must be int64 (use .long()); got {self.input_ids.dtype}")
        if self.attention_mask.dtype != torch.bool and self.attention_mask.is_floating_point():
            raise ValueError(
                f"TrainBatch.attention_mask must be bool or integer; got {self.attention_mask.dtype}"
            )
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"TrainBatch.loss_mask must be bool (use .bool()); got {self.loss_mask.dtype}")
        for name in ("old_logprobs", "advantages", "ref_logprobs"):
            value = given.get(name)
            if value is not None and value.dtype != torch.float32:
                raise ValueError(f"TrainBatch.{name} must be float32 (use .float()); got {value.dtype}")
        if self.loss_mask[:, 0].any():
            raise ValueError(
                f"TrainBatch.loss_mask is True at index 0 (rows {_rows(self.loss_mask[:, 0])}); nothing "
                f"predicts the first token, so it cannot be trained on ({shapes})"
            )
        outside = self.loss_mask & ~self.attention_mask.bool()
        if outside.any():
            raise ValueError(
                f"TrainBatch.loss_mask is True on padding (attention_mask 0) in rows {_rows(outside.any(1))} "
                f"({shapes})"
            )
        if self.fresh is not None and (
            not isinstance(self.fresh, Tensor) or self.fresh.dtype != torch.bool
            or tuple(self.fresh.shape) != (self.input_ids.shape[0],)
        ):  # fmt: skip
            raise ValueError(f"TrainBatch.fresh must be a [B] bool tensor or None ({shapes})")
        if self.turns is not None and (
            not isinstance(self.turns, Tensor) or self.turns.dtype != torch.int64
            or self.turns.shape != self.input_ids.shape
        ):  # fmt: skip
            raise ValueError(f"TrainBatch.turns must be a [B, L] int64 tensor or None ({shapes})")
        bad_adv = self.loss_mask & ~torch.isfinite(self.advantages)
        if bad_adv.any():
            raise ValueError(
                f"TrainBatch.advantages has {int(bad_adv.sum())} NaN/inf values on loss_mask tokens "
                f"(rows {_rows(bad_adv.any(1))}; {shapes}); fix the reward/advantage computation"
            )

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def num_valid_tokens(self) -> int:
        """Tokens trained on: loss_mask and a finite behaviour logprob (this rank's share of N)."""
        return int(valid_token_mask(self.loss_mask, self.old_logprobs).sum())


def _rows(row_flags: Tensor, limit: int = 5) -> str:
    rows = row_flags.nonzero().flatten().tolist()
    return ", ".join(map(str, rows[:limit])) + (", ..." if len(rows) > limit else "")


@dataclass
class TrainerConfig:
    """How `train_step` runs one optimizer step (`trainer.*` in the run config)."""

    micro_batch_size: int = 64
    """Rows per forward/backward on each rank; bounds activation memory, does not change the gradient."""

    max_grad_norm: float = 1.0
    """Clip the global gradient L2 norm to this; 0 disables clipping (the norm is still reported)."""

    ess_scope: str = "micro_batch"
    """ESS computed per micro-batch across ranks (`micro_batch`, as FeynRL), once per step (`step`) or per
    sequence over its own tokens (`sequence`, FeynRL's `calculate_seq_ess`). trainer/README.md."""

    share_prompts: bool = False
    """Run each group's shared prompt once per micro-batch: its completions are packed after it under a block
    mask, with their own positions (trainer/logprobs.py). Same logprobs, fewer tokens through the model; pays
    when prompts are long next to the completions. Needs sdpa or eager attention. trainer/README.md."""

    compute_dtype: str = "float32"
    """float32, or bfloat16: forwards compute in bf16 over the float32 master weights (autocast on CPU, FSDP2's
    MixedPrecisionPolicy on GPUs); logits are cast to float32 before the log-softmax, so logprobs, ratios,
    the ESS and the loss stay float32 (trainer/precision.py; its cost measured in bench/README.md)."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (rank, alpha, target_modules; rank 0 = full fine-tuning): only the adapters train, and the
    engines, checkpoints and `serve` get the merged weights (trainer/lora.py)."""

    grad_diagnostics_every: int = 0
    """Every this many steps, also log the pre-clip gradient norms of the policy term and of the behaviour-KL
    term alone (`train/grad_norm/policy`, `train/grad_norm/behaviour_kl`): two more forward+backward passes on
    those steps. 0 = never."""

    def __post_init__(self) -> None:
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1:
            raise ValueError(
                f"trainer.micro_batch_size={self.micro_batch_size!r} must be an integer >= 1 (e.g. 64)"
            )
        if not math.isfinite(self.max_grad_norm) or self.max_grad_norm < 0:
            raise ValueError(
                f"trainer.max_grad_norm={self.max_grad_norm} must be a finite number >= 0; 0 disables clipping"
            )
        if not isinstance(self.grad_diagnostics_every, int) or self.grad_diagnostics_every < 0:
            raise ValueError(
                f"trainer.grad_diagnostics_every={self.grad_diagnostics_every!r} must be an integer >= 0 "
                "(0 = never)"
            )
        if not isinstance(self.share_prompts, bool):
            raise ValueError(f"trainer.share_prompts={self.share_prompts!r} must be true or false")
        check_compute_dtype(self.compute_dtype)
        if self.ess_scope not in ESS_SCOPES:
            raise ValueError(f"trainer.ess_scope={self.ess_scope!r} must be one of {list(ESS_SCOPES)}")


@dataclass
class _MicroBatch:
    input_ids: Tensor
    attention_mask: Tensor
    mask: Tensor  # valid tokens (all False for a padding micro-batch)
    old_logprobs: Tensor
    advantages: Tensor
    ref_logprobs: Tensor | None
    fresh: Tensor | None = None  # [b] bool: rows at policy lag 0 (TrainBatch.fresh)
    turns: Tensor | None = None  # [b, l] int64: each token's model turn (TrainBatch.turns)


def _micro_batches(
    batch: TrainBatch, valid: Tensor, size: int, count: int, device: torch.device
) -> list[_MicroBatch]:
    """`count` micro-batches of up to `size` rows on `device`; the ones past the data are padding."""
    out = []
    for i in range(count):
        start = i * size
        padding = start >= batch.batch_size
        rows = slice(0, 1) if padding else slice(start, min(start + size, batch.batch_size))
        attention = batch.attention_mask[rows]
        # Drop trailing columns that are padding in every row: they change no attended token's logprob.
        length = int(attention.bool().any(0).nonzero().max()) + 1 if attention.bool().any() else 2
        cols = (rows, slice(0, max(length, 2)))
        mask = valid[cols]
        if padding:
            mask = torch.zeros_like(mask)
        ref = batch.ref_logprobs[cols] if batch.ref_logprobs is not None else None
        fresh = batch.fresh[rows] if batch.fresh is not None else None
        turns = batch.turns[cols] if batch.turns is not None else None
        out.append(
            _MicroBatch(
                input_ids=batch.input_ids[cols].to(device, non_blocking=True),
                attention_mask=attention[:, cols[1]].to(device, non_blocking=True),
                mask=mask.to(device, non_blocking=True),
                old_logprobs=batch.old_logprobs[cols].to(device, non_blocking=True),
                advantages=batch.advantages[cols].to(device, non_blocking=True),
                ref_logprobs=ref.to(device, non_blocking=True) if ref is not None else None,
                fresh=fresh.to(device, non_blocking=True) if fresh is not None else None,
                turns=turns.to(device, non_blocking=True) if turns is not None else None,
            )
        )
    return out


@dataclass(frozen=True)
class PolicyForward:
    """How a micro-batch goes through the model: as padded rows, or with each shared prompt run once
    (`trainer.share_prompts`); logprobs and entropies at the rollouts' sampling temperature."""

    model: torch.nn.Module
    share_prompts: bool
    temperature: float
    compute_dtype: str = "float32"

    def __call__(self, mb: _MicroBatch) -> tuple[Tensor, Tensor]:
        """(logprobs, entropy), both [b, l] float32, with gradient unless run under no_grad."""
        with compute(self.model, self.compute_dtype):
            logprobs, entropy = self._forward(mb, with_entropy=True)
        assert entropy is not None
        return logprobs, entropy

    def logprobs(self, mb: _MicroBatch) -> Tensor:
        """[b, l] float32 logprobs alone (no entropy), without gradient: the reference policy's."""
        with torch.no_grad(), compute(self.model, self.compute_dtype):
            return self._forward(mb, with_entropy=False)[0]

    def _forward(self, mb: _MicroBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        if self.share_prompts:
            return shared_prefix_token_logprobs(
                self.model, mb.input_ids, mb.attention_mask, mb.mask,
                temperature=self.temperature, with_entropy=with_entropy,
            )  # fmt: skip
        return token_logprobs(
            self.model, mb.input_ids, mb.attention_mask, temperature=self.temperature, with_entropy=with_entropy,
            loss_mask=mb.mask,
        )  # fmt: skip


@dataclass(frozen=True)
class StepPlan:
    """This rank's micro-batches and the global scale of their losses (the module docstring's convention)."""

    num_tokens: float
    """N, the global number of valid tokens of the step: every micro-batch loss is divided by it."""
    micro_batches: list[_MicroBatch]
    """As many on every rank; the ones past this rank's rows are padding."""
    dp_scale: float
    """W, the data-parallel world size: `(loss * dp_scale).backward()` cancels FSDP2's gradient average."""


def plan_step(batch: TrainBatch, micro_batch_size: int, reducer: Reducer, device: torch.device) -> StepPlan:
    """Stages 1-2: N (SUM over ranks, once, before any forward) and the micro-batches, as many on every rank
    (MAX over ranks; a rank with fewer rows runs padding micro-batches)."""
    valid = valid_token_mask(batch.loss_mask, batch.old_logprobs)
    num_tokens = float(reducer.sum_(valid.sum().to(torch.float64).cpu().reshape(1)).item())
    local_micro = math.ceil(batch.batch_size / micro_batch_size)
    num_micro = int(reducer.max_(torch.tensor([local_micro], dtype=torch.float64)).item())
    micro_batches = _micro_batches(batch, valid, micro_batch_size, num_micro, device)
    return StepPlan(num_tokens, micro_batches, dp_scale=float(reducer.world_size))


def _reduced_ess(sums: Tensor, reducer: Reducer) -> float:
    return ess_from_sums(reducer.sum_(sums.detach().to(torch.float64).cpu()))


@dataclass(frozen=True)
class EssScope:
    """Stage 3, the one place that tells the `trainer.ess_scope`s apart: the ESS each micro-batch is trained
    with, and the step's `loss/ess`. Build it with `EssScope.prepare`.

    - `micro_batch`: the ESS of that micro-batch over all ranks (its sums SUM-reduced: one collective per
      micro-batch and pass); `loss/ess` is the mean over the micro-batches.
    - `step`: `step_ess` for every micro-batch, computed once by `prepare` from an extra no-grad forward over
      all micro-batches; `loss/ess` is that value.
    - `sequence`: a [B] tensor, each row's ESS over its own tokens (no collective); `loss/ess` is the rows'
      ESS weighted by their valid tokens over all micro-batches and ranks, from two SUM metrics
      (`_SEQ_ESS_*`).
    """

    scope: str
    reducer: Reducer
    max_log_ratio: float
    step_ess: float | None = None

    @classmethod
    def prepare(
        cls, scope: str, forward: PolicyForward, micro_batches: list[_MicroBatch], max_log_ratio: float,
        reducer: Reducer,
    ) -> EssScope:  # fmt: skip
        """The scope, with `step`'s ESS from a no-grad pass over all micro-batches, before any backward."""
        if scope != "step":
            return cls(scope, reducer, max_log_ratio)
        sums = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for mb in micro_batches:
                logprobs, _ = forward(mb)
                ratio = importance_ratio(logprobs.detach(), mb.old_logprobs, mb.mask, max_log_ratio)
                sums += ess_partial_sums(ratio, mb.mask).cpu()
        return cls(scope, reducer, max_log_ratio, step_ess=_reduced_ess(sums, reducer))

    def micro_batch_ess(self, logprobs: Tensor, mb: _MicroBatch) -> tuple[float | Tensor, dict[str, Tensor]]:
        """(the ESS to train `mb` with, a float or [B]; the SUM metrics it adds toward `loss/ess`)."""
        if self.scope == "step":
            assert self.step_ess is not None, "ess_scope=step needs EssScope.prepare's no-grad pass"
            return self.step_ess, {}
        ratio = importance_ratio(logprobs.detach(), mb.old_logprobs, mb.mask, self.max_log_ratio)
        if self.scope == "sequence":
            ess = ess_per_sequence(ratio, mb.mask)
            counts = mb.mask.sum(-1).to(torch.float64)
            return ess, {_SEQ_ESS_SUM: (ess * counts).sum(), _SEQ_ESS_TOKENS: counts.sum()}
        return _reduced_ess(ess_partial_sums(ratio, mb.mask), self.reducer), {}

    def reported(self, reduced: dict[str, float], ess_values: list[float]) -> float:
        """The step's `loss/ess`, from the reduced SUM metrics (whose `_SEQ_ESS_*` keys it pops) or the scalar
        ESS of each micro-batch."""
        if self.scope == "sequence":
            weighted, count = reduced.pop(_SEQ_ESS_SUM), reduced.pop(_SEQ_ESS_TOKENS)
            return weighted / count if count > 0 else 1.0
        return sum(ess_values) / len(ess_values)


@dataclass
class PassResult:
    """What one `forward_backward` pass leaves besides the gradients in .grad: this rank's sums, unreduced."""

    local_loss: Tensor
    """float64 sum of the micro-batch losses on this rank."""
    sum_metrics: dict[str, Tensor] = field(default_factory=dict)
    """SUM-reduced metrics (float64), `_SEQ_ESS_*` included."""
    max_metrics: dict[str, Tensor] = field(default_factory=dict)
    """MAX-reduced metrics (keys ending in `/max`; keys ending in `/min` are held negated here)."""
    ess_values: list[float] = field(default_factory=list)
    """The scalar ESS of each micro-batch (none for the per-sequence scope)."""

    def add(self, key: str, value: Tensor) -> None:
        """Accumulate one micro-batch's metric: MAX for keys ending in `/max`, MIN for `/min`, SUM for the rest."""
        value = value.detach().to(torch.float64)
        if key.endswith("/min"):
            value = -value  # min x = −max(−x): one MAX reduction for both
        if key.endswith(("/max", "/min")):
            old = self.max_metrics.get(key)
            self.max_metrics[key] = value if old is None else torch.maximum(old, value)
        else:
            old = self.sum_metrics.get(key)
            self.sum_metrics[key] = value if old is None else old + value


def forward_backward(
    forward: PolicyForward, plan: StepPlan, objective: ObjectiveConfig, ess_scope: EssScope, part: LossPart
) -> PassResult:
    """Stage 4: per micro-batch, the forward, its ESS (`EssScope`), `policy_objective` holding `part` and
    `(loss * dp_scale).backward()`; the gradients accumulate in .grad."""
    device = plan.micro_batches[0].input_ids.device
    result = PassResult(local_loss=torch.zeros((), dtype=torch.float64, device=device))
    for mb in plan.micro_batches:
        logprobs, entropy = forward(mb)
        if objective.entropy_coef == 0:
            entropy = entropy.detach()  # a metric only: no gradient path through it
        ess, ess_sums = ess_scope.micro_batch_ess(logprobs, mb)
        for key, value in ess_sums.items():
            result.add(key, value)
        if mb.fresh is not None:
            for key, value in _lag0_sums(logprobs, mb).items():
                result.add(key, value)
        if mb.turns is not None:
            for key, value in _turn_sums(logprobs, mb).items():
                result.add(key, value)
        loss, metrics = policy_objective(
            logprobs,
            mb.old_logprobs,
            mb.advantages,
            mb.mask,
            objective,
            num_tokens=plan.num_tokens,
            ess=ess,
            ref_logprobs=mb.ref_logprobs,
            entropy=entropy,
            part=part,
        )
        (loss * plan.dp_scale).backward()
        result.local_loss += loss.detach().to(torch.float64)
        if isinstance(ess, float):  # a scalar scope's; a per-sequence ESS went into the SUM metrics
            result.ess_values.append(ess)
        for key, value in metrics.items():
            if key != "loss/ess":  # the step's loss/ess is EssScope.reported's
                result.add(key, value)
    return result


def trainable_parameters(model: torch.nn.Module) -> list[Tensor]:
    """Read after a backward: under FSDP2 a no-grad forward (ess_scope=step) leaves the unsharded parameters
    registered until the next backward reshards them."""
    return [p for p in model.parameters() if p.requires_grad]


def grad_diagnostics(
    forward: PolicyForward, plan: StepPlan, objective: ObjectiveConfig, ess_scope: EssScope
) -> dict[str, float]:
    """Stage 5's diagnostics, before the training pass: the pre-clip norms of the policy term's gradient and
    of the behaviour-KL term's alone, each from its own `forward_backward` pass; the gradients are dropped."""
    diagnostics: dict[str, float] = {}
    for part in ("policy", "behaviour_kl"):
        forward_backward(forward, plan, objective, ess_scope, part)
        norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(forward.model), math.inf)
        diagnostics[f"train/grad_norm/{part}"] = float(full_value(norm))
        for param in trainable_parameters(forward.model):  # all, not only the optimizer's: nothing leaks
            param.grad = None
    return diagnostics


def clip_and_guard(
    model: torch.nn.Module, local_loss: Tensor, max_grad_norm: float, reducer: Reducer
) -> tuple[float, bool, bool]:
    """Stages 5-6: the pre-clip global gradient norm, clipped to `max_grad_norm` (0: no clipping); then the
    non-finite guard, agreed by all ranks (MAX of a flag). Returns (grad_norm, clipped, skipped)."""
    max_norm = max_grad_norm if max_grad_norm > 0 else math.inf
    grad_norm = float(full_value(torch.nn.utils.clip_grad_norm_(trainable_parameters(model), max_norm)))
    local_bad = not (math.isfinite(float(local_loss)) and math.isfinite(grad_norm))
    skipped = float(reducer.max_(torch.tensor([float(local_bad)], dtype=torch.float64)).item()) > 0
    return grad_norm, not skipped and grad_norm > max_norm, skipped


def optimizer_step(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None, *, skipped: bool
) -> float:
    """Stage 7: step the optimizer and the scheduler unless `skipped`, then clear the gradients (always).
    Returns the learning rate the step used."""
    lr = float(optimizer.param_groups[0]["lr"])
    if not skipped:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return lr


_LAG0 = ("_lag0/sum_r", "_lag0/sum_r2", "_lag0/tokens", "_lag0/sum_abs_log_r")


def _lag0_sums(logprobs: Tensor, mb: _MicroBatch) -> dict[str, Tensor]:
    """SUM-reduced sums over the micro-batch's valid tokens of lag-0 rows: Σr, Σr², n and Σ|log r| (detached)."""
    assert mb.fresh is not None
    mask = mb.mask & mb.fresh[:, None]
    log_ratio = torch.where(mask, logprobs.detach().float() - torch.where(mask, mb.old_logprobs, 0.0), 0.0)
    sums = ess_partial_sums(log_ratio.exp(), mask)
    return dict(zip(_LAG0, [*sums, log_ratio.abs().sum().to(torch.float64)], strict=True))


def _lag0_metrics(reduced: dict[str, float]) -> dict[str, float]:
    """`loss/ess_lag0` and `loss/logprob_gap_lag0` from the reduced lag-0 sums (popped); none without lag-0
    tokens in the step."""
    sums = [reduced.pop(key, 0.0) for key in _LAG0]
    if sums[2] <= 0:
        return {}
    return {
        "loss/ess_lag0": ess_from_sums(torch.tensor(sums[:3], dtype=torch.float64)),
        "loss/logprob_gap_lag0": sums[3] / sums[2],
        "loss/lag0_tokens": sums[2],
    }


TURN_BUCKETS = 4
"""Per-turn metrics for turns 0, 1, 2 and 3-or-later: as many keys on every rank, whatever its trajectories."""


def _turn_sums(logprobs: Tensor, mb: _MicroBatch) -> dict[str, Tensor]:
    """SUM-reduced sums per turn bucket over the micro-batch's valid tokens: Σr, Σr², n and Σ|log r| (detached)."""
    assert mb.turns is not None
    out: dict[str, Tensor] = {}
    for k in range(TURN_BUCKETS):
        in_turn = mb.turns == k if k < TURN_BUCKETS - 1 else mb.turns >= k
        mask = mb.mask & in_turn
        log_ratio = torch.where(mask, logprobs.detach().float() - torch.where(mask, mb.old_logprobs, 0.0), 0.0)
        sums = ess_partial_sums(log_ratio.exp(), mask)
        for name, value in zip(("sum_r", "sum_r2", "tokens", "sum_abs_log_r"),
                               [*sums, log_ratio.abs().sum().to(torch.float64)], strict=True):  # fmt: skip
            out[f"_turn{k}/{name}"] = value
    return out


def _turn_metrics(reduced: dict[str, float]) -> dict[str, float]:
    """`loss/ess_turn/<k>`, `loss/logprob_gap_turn/<k>` and `loss/tokens_turn/<k>` from the reduced sums (popped);
    a turn with no token in the step reports nothing."""
    out: dict[str, float] = {}
    for k in range(TURN_BUCKETS):
        keys = [f"_turn{k}/{name}" for name in ("sum_r", "sum_r2", "tokens", "sum_abs_log_r")]
        if keys[0] not in reduced:
            continue
        sums = [reduced.pop(key) for key in keys]
        if sums[2] > 0:
            out[f"loss/ess_turn/{k}"] = ess_from_sums(torch.tensor(sums[:3], dtype=torch.float64))
            out[f"loss/logprob_gap_turn/{k}"] = sums[3] / sums[2]
            out[f"loss/tokens_turn/{k}"] = sums[2]
    return out


def reduce_metrics(result: PassResult, ess_scope: EssScope, reducer: Reducer) -> dict[str, float]:
    """The pass's metrics over micro-batches and ranks: SUM keys summed, `/max` keys maxed, and `loss/ess`."""
    reduced: dict[str, float] = {}
    sum_keys, max_keys = sorted(result.sum_metrics), sorted(result.max_metrics)
    if sum_keys:
        summed = reducer.sum_(torch.stack([result.sum_metrics[k] for k in sum_keys]).cpu())
        reduced.update(zip(sum_keys, summed.tolist(), strict=True))
    if max_keys:
        maxed = reducer.max_(torch.stack([result.max_metrics[k] for k in max_keys]).cpu())
        for key, value in zip(max_keys, maxed.tolist(), strict=True):
            if key.endswith("/min"):  # held negated; +inf (no valid token anywhere) is reported as NaN
                value = -value if math.isfinite(value) else math.nan
            reduced[key] = value
    reduced["loss/ess"] = ess_scope.reported(reduced, result.ess_values)
    reduced.update(_lag0_metrics(reduced))
    reduced.update(_turn_metrics(reduced))
    return reduced


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    objective: ObjectiveConfig,
    reducer: Reducer,
    cfg: TrainerConfig,
    *,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    diagnose: bool = False,
    reference: torch.nn.Module | None = None,
) -> dict[str, float]:
    """One optimizer step on `batch` (this rank's share); returns the metrics in the module docstring.

    `diagnose` (the same on every rank) adds the per-term gradient norms, at the cost of two more passes.
    `reference` (a frozen copy of the starting policy, sharded like `model` under FSDP2) fills each micro-batch's
    reference logprobs with one no-grad forward, computed as the policy's are (shared prompts, compute dtype),
    for `objective.ref_kl_coef`; a batch that already carries `ref_logprobs` keeps them.

    A collective when `reducer` spans several ranks: every rank calls it with its own batch. The model runs
    in whatever train/eval mode it is in (RL wants dropout off; the tiny model is built in eval mode).
    """
    start_time = time.perf_counter()
    if reducer.world_size > 1 and not is_sharded(model):
        raise ValueError(
            f"train_step got a reducer over {reducer.world_size} ranks but an unsharded model, whose "
            "gradients would never be synchronised: wrap it with trainer.distributed.shard_model first"
        )
    device = next(model.parameters()).device
    plan = plan_step(batch, cfg.micro_batch_size, reducer, device)
    forward = PolicyForward(model, cfg.share_prompts, batch.temperature, cfg.compute_dtype)
    if reference is not None and batch.ref_logprobs is None:
        reference_forward = PolicyForward(reference, cfg.share_prompts, batch.temperature, cfg.compute_dtype)
        for mb in plan.micro_batches:  # every rank runs as many (padding included): FSDP2 gathers in each
            mb.ref_logprobs = reference_forward.logprobs(mb)
    ess_scope = EssScope.prepare(cfg.ess_scope, forward, plan.micro_batches, objective.max_log_ratio, reducer)
    diagnostics = grad_diagnostics(forward, plan, objective, ess_scope) if diagnose else {}
    trained = forward_backward(forward, plan, objective, ess_scope, part="all")
    grad_norm, clipped, skipped = clip_and_guard(model, trained.local_loss, cfg.max_grad_norm, reducer)
    lr = optimizer_step(optimizer, scheduler, skipped=skipped)
    return {
        **reduce_metrics(trained, ess_scope, reducer),
        "train/grad_norm": grad_norm,
        "train/clipped": float(clipped),
        **diagnostics,
        "train/lr": lr,
        "train/num_tokens": plan.num_tokens,
        "train/micro_batches": float(len(plan.micro_batches)),
        "train/skipped": float(skipped),
        "timing/train_step": time.perf_counter() - start_time,
    }
