"""Supervised fine-tuning, the algorithm: masked next-token cross-entropy over length-sorted micro-batches.

An example is a token sequence and the index where its target starts: the loss covers ``ids[start:]`` only (the
assistant's tokens; the prompt is context). One optimizer step takes a batch of examples, sorts this rank's share
by length and cuts it into micro-batches of ``trainer.micro_batch_size`` rows, so rows of one micro-batch have
similar lengths and padding stays small (`plan_sft_step` reports the padded share). The loss of the step is the
mean over every target token of the batch, on all ranks:

    loss = - Σ_ranks Σ_micro Σ_t mask · log π(token_t) / N_target_tokens(global)

Each micro-batch backpropagates its own part, scaled by the world size, since FSDP2 averages gradients over
ranks (the same convention as trainer/step.py: no per-micro-batch mean is ever taken). Clipping, the non-finite
guard and the optimizer step are trainer/step.py's. The command around it (data, checkpoints, tracking,
evaluation) is app/training/sft.py; the tiny model's warm start (app/training/bootstrap.py) uses it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from trainer.distributed import LocalReducer, Reducer
from trainer.logprobs import token_logprobs
from trainer.precision import compute
from trainer.step import clip_and_guard, optimizer_step


@dataclass
class SFTConfig:
    """`trustbatch sft` (the ``sft`` section): how long, how much per step, what is checked on held-out rows.
    The learning rate and its schedule are ``optim.*``; micro-batches and clipping ``trainer.*``."""

    steps: int = 0
    """Optimizer steps; 0 = as many as ``epochs`` passes over data.train take."""
    epochs: float = 1.0
    """Passes over data.train when ``steps`` is 0 (fractions allowed)."""
    batch_size: int = 32
    """Examples per optimizer step, over all ranks."""
    eval_every: int = 0
    """Held-out loss every this many steps (always before the first step and after the last); 0 = only then."""
    num_eval: int = 256
    """Held-out examples (of data.eval) the held-out loss averages over."""
    on_long: Literal["error", "drop"] = "error"
    """An example (prompt + target) longer than the model's context: error (stop at start-up, naming the file,
    row and fix) or drop (skip it, counted in the log and in MLflow as sft/dropped_long/<split>). Nothing is ever
    cut short."""
    verify: bool = True
    """After the last step, sample the held-out prompts with the fine-tuned model and score them with the run's
    verifiers (``eval.*`` settings, the evaluation `train` and `eval` use): greedy accuracy, sampled pass@1 and
    the answer rate. Needs data.eval rows with an answer or tests."""

    def __post_init__(self) -> None:
        for key in ("steps", "eval_every"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"sft.{key}={value!r} must be an integer >= 0")
        if not (math.isfinite(self.epochs) and self.epochs > 0):
            raise ValueError(f"sft.epochs={self.epochs} must be > 0 (or set sft.steps)")
        for key in ("batch_size", "num_eval"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"sft.{key}={value!r} must be an integer >= 1")
        if self.on_long not in ("error", "drop"):
            raise ValueError(f"sft.on_long={self.on_long!r}: choose error or drop")

    def total_steps(self, num_examples: int) -> int:
        """Optimizer steps of the run: ``steps``, or ``epochs`` passes over ``num_examples`` (at least 1)."""
        if self.steps:
            return self.steps
        return max(1, math.ceil(self.epochs * num_examples / self.batch_size))


@dataclass(frozen=True)
class Example:
    """One supervised sequence: token ids, where the target (the trained tokens) starts, and the positions past
    that start that are not trained (a tool's output inside a tool-use transcript: context, not the model's)."""

    ids: tuple[int, ...]
    start: int
    untrained: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.start < len(self.ids):
            raise ValueError(f"an example's target must start inside it (0 < {self.start} < {len(self.ids)})")
        if any(not self.start <= i < len(self.ids) for i in self.untrained) or len(set(self.untrained)) != len(
            self.untrained
        ):
            raise ValueError(f"an example's untrained positions must be distinct and in [{self.start}, {len(self.ids)})")
        if len(self.untrained) >= len(self.ids) - self.start:
            raise ValueError("an example must train on at least one token")

    @property
    def num_targets(self) -> int:
        return len(self.ids) - self.start - len(self.untrained)


@dataclass
class MicroBatch:
    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor


def collate(examples: list[Example], pad_id: int) -> MicroBatch:
    """Right-padded [B, L] tensors; ``loss_mask`` is True on target tokens."""
    length = max(len(e.ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    loss_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for i, e in enumerate(examples):
        input_ids[i, : len(e.ids)] = torch.tensor(e.ids)
        attention_mask[i, : len(e.ids)] = 1
        loss_mask[i, e.start : len(e.ids)] = True
        if e.untrained:
            loss_mask[i, list(e.untrained)] = False
    return MicroBatch(input_ids, attention_mask, loss_mask)


@dataclass
class SFTPlan:
    micro_batches: list[MicroBatch]
    num_targets: float
    """Target tokens of the whole step, over all ranks."""
    tokens: int
    """Real (unpadded) tokens of this rank's share."""
    padded_tokens: int
    """Tokens this rank's micro-batches hold, padding included."""


def plan_sft_step(
    examples: list[Example], micro_batch_size: int, pad_id: int, reducer: Reducer | None = None
) -> SFTPlan:
    """This rank's examples, sorted by length and cut into micro-batches, and the step's global target count.

    Every rank runs the same number of micro-batches (FSDP2 gathers parameters in each forward, so a rank that
    ran fewer would leave the others waiting): the most any rank needs at ``micro_batch_size`` rows each, this
    rank's rows spread evenly over them; a rank with no rows left runs a one-token row without targets.
    """
    reducer = reducer or LocalReducer()
    ordered = sorted(examples, key=lambda e: len(e.ids))
    local_micro = math.ceil(len(ordered) / micro_batch_size)
    count = int(reducer.max_(torch.tensor([float(local_micro)], dtype=torch.float64)).item())
    bounds = [round(i * len(ordered) / count) for i in range(count + 1)] if count else [0]
    micro = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        if hi > lo:
            micro.append(collate(ordered[lo:hi], pad_id))
        else:  # nothing of this rank's share left: take part in the collectives, train nothing
            one = torch.full((1, 1), pad_id, dtype=torch.long)
            micro.append(MicroBatch(one, torch.ones_like(one), torch.zeros_like(one, dtype=torch.bool)))
    local = float(sum(e.num_targets for e in examples))
    num_targets = float(reducer.sum_(torch.tensor([local], dtype=torch.float64)).item())
    return SFTPlan(
        micro, num_targets, sum(len(e.ids) for e in examples), sum(m.input_ids.numel() for m in micro)
    )


def masked_nll_sum(model: torch.nn.Module, mb: MicroBatch, compute_dtype: str = "float32") -> Tensor:
    """−Σ log π(target token) over the micro-batch's target positions (float32; the forward computes in
    ``compute_dtype``, trainer/precision.py)."""
    with compute(model, compute_dtype):
        logprobs, _ = token_logprobs(model, mb.input_ids, mb.attention_mask, loss_mask=mb.loss_mask)
    return -(logprobs * mb.loss_mask).sum()


def sft_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: SFTPlan,
    *,
    max_grad_norm: float,
    reducer: Reducer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    compute_dtype: str = "float32",
) -> dict[str, float]:
    """One optimizer step on ``plan``; returns the step's mean target-token loss (all ranks), the gradient norm,
    the learning rate and whether a non-finite loss or gradient made it skip the update."""
    reducer = reducer or LocalReducer()
    device = next(model.parameters()).device
    scale = reducer.world_size / max(plan.num_targets, 1.0)
    local = torch.zeros((), dtype=torch.float64)
    for mb in plan.micro_batches:
        nll = masked_nll_sum(
            model, MicroBatch(mb.input_ids.to(device), mb.attention_mask.to(device), mb.loss_mask.to(device)),
            compute_dtype,
        )
        (nll * scale).backward()
        local += nll.detach().to(torch.float64).cpu()
    grad_norm, clipped, skipped = clip_and_guard(model, local, max_grad_norm, reducer)
    lr = optimizer_step(optimizer, scheduler, skipped=skipped)
    total = float(reducer.sum_(local.reshape(1)).item())
    return {
        "sft/loss": total / max(plan.num_targets, 1.0),
        "sft/grad_norm": grad_norm,
        "sft/clipped": float(clipped),
        "sft/skipped": float(skipped),
        "sft/lr": lr,
    }


@torch.no_grad()
def held_out_loss(
    model: torch.nn.Module,
    examples: list[Example],
    micro_batch_size: int,
    pad_id: int,
    reducer: Reducer | None = None,
    compute_dtype: str = "float32",
) -> float:
    """Mean target-token loss over ``examples`` (this rank's share; summed over ranks), in eval mode."""
    reducer = reducer or LocalReducer()
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    plan = plan_sft_step(examples, micro_batch_size, pad_id, reducer)
    local = torch.zeros(1, dtype=torch.float64)
    for mb in plan.micro_batches:
        local += masked_nll_sum(
            model, MicroBatch(mb.input_ids.to(device), mb.attention_mask.to(device), mb.loss_mask.to(device)),
            compute_dtype,
        ).to(torch.float64).cpu()
    model.train(was_training)
    return float(reducer.sum_(local).item()) / max(plan.num_targets, 1.0)
