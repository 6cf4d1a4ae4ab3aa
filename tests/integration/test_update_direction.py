"""Which way one RL step moves each completion: a penalised one (advantage < 0) loses probability and a rewarded
one (advantage > 0) gains it, under every objective, every trainer dtype setting, shared prompts or not, with the
behaviour logprobs of a float32 or a bf16 engine, and with the run's optimizer (AdamW) as with plain SGD.

Issue 40 asked whether math RL made SmolLM2's wrong sums (reward 0) more likely through a sign, mask, position or
cast slip in the update. This is the property such a slip breaks: it is checked on a real (tiny, random) Qwen2
with `train_step` as the training loop calls it, completion by completion.
"""

import itertools

import pytest
import torch

from tests.integration.dist_worker import build_batch, build_model
from trainer.distributed import LocalReducer
from trainer.logprobs import token_logprobs
from trainer.objective import ObjectiveConfig
from trainer.optim import OptimConfig, build_optimizer
from trainer.precision import compute
from trainer.step import TrainBatch, TrainerConfig, train_step

ROWS = 8  # four groups of two completions of one prompt: the first rewarded, the second penalised
SETTINGS = {  # trainer dtype settings: model.dtype (the weights) and trainer.compute_dtype
    "float32": (torch.float32, "float32"),
    "bf16-compute": (torch.float32, "bfloat16"),
    "bf16-weights": (torch.bfloat16, "float32"),
}


def _sequence_logprobs(model, batch: TrainBatch) -> torch.Tensor:
    """Each row's summed response logprob, read in float32."""
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=batch.temperature)
    return torch.where(batch.loss_mask, logprobs.float(), 0.0).sum(dim=1)


def _batch(model, engine: str) -> TrainBatch:
    """Groups of two sharing a prompt, advantages +1 / -1, behaviour logprobs from the same weights as an engine
    in ``engine`` dtype computes them (bf16: off-policy by the rounding, as in a bf16 run)."""
    batch = build_batch(build_model(0), rows=ROWS, shared_prompts=ROWS // 2)
    with torch.no_grad(), compute(model, "bfloat16" if engine == "bfloat16" else "float32"):
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    old = torch.where(batch.loss_mask, logprobs.float(), float("nan"))
    signs = torch.tensor([1.0, -1.0] * (ROWS // 2))[:, None].expand_as(old)
    advantages = torch.where(batch.loss_mask, signs, 0.0)
    return TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, old, advantages, temperature=1.0)


@pytest.mark.parametrize(
    "objective, setting, engine, share_prompts",
    list(itertools.product(["ess", "ppo_clip", "reinforce"], SETTINGS, ["float32", "bfloat16"], [True, False])),
)
def test_a_step_lowers_penalised_completions_and_raises_rewarded_ones(objective, setting, engine, share_prompts):
    weights, compute_dtype = SETTINGS[setting]
    model = build_model(0).to(weights)
    batch = _batch(model, engine)
    before = _sequence_logprobs(model, batch)
    cfg = TrainerConfig(micro_batch_size=4, share_prompts=share_prompts, compute_dtype=compute_dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    metrics = train_step(model, optimizer, batch, ObjectiveConfig(name=objective), LocalReducer(), cfg)
    assert metrics["train/skipped"] == 0.0
    change = _sequence_logprobs(model, batch) - before
    for row in range(ROWS):
        rewarded = row % 2 == 0
        assert (change[row] > 0) == rewarded, (
            f"row {row} ({'rewarded' if rewarded else 'penalised'}) moved its logprob by {float(change[row]):+.4f}"
        )


@pytest.mark.parametrize("objective", ["ess", "ppo_clip", "reinforce"])
def test_the_runs_optimizer_moves_both_kinds_the_right_way(objective):
    """AdamW as runs build it (its first step moves every weight by about lr, whatever the gradient's size): the
    penalised completions lose probability on average and the rewarded ones gain it."""
    model = build_model(0)
    batch = _batch(model, "bfloat16")
    before = _sequence_logprobs(model, batch)
    optimizer, _ = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.0), total_steps=1)
    train_step(model, optimizer, batch, ObjectiveConfig(name=objective), LocalReducer(), TrainerConfig())
    change = _sequence_logprobs(model, batch) - before
    assert change[0::2].mean() > 0 > change[1::2].mean()
    assert (change[0::2] > 0).sum() >= 3 and (change[1::2] < 0).sum() >= 3
