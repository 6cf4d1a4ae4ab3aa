"""Held-out evaluation: sampled pass@1 at the training temperature, and greedy accuracy.

Standard errors are clustered by prompt: samples of one prompt are correlated, so the SE of an accuracy is
the standard deviation of the per-prompt mean accuracies divided by sqrt(#prompts). Two evaluations on the
same prompts (before and after training) give a paired gain whose SE uses the per-prompt differences.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.data import PromptRow
from app.rollout.base import Completion, SamplingParams
from app.scoring import score_texts
from rewards.runner import RewardRunner
from trainer.distributed import Reducer


@dataclass
class EvalResult:
    per_prompt: list[float]
    """Mean correctness of each prompt's samples (all prompts, in order)."""
    samples: int
    """Completions the estimate uses (prompts x samples per prompt)."""

    @property
    def accuracy(self) -> float:
        return sum(self.per_prompt) / len(self.per_prompt)

    @property
    def stderr(self) -> float:
        return clustered_stderr(self.per_prompt)


def clustered_stderr(per_prompt: list[float]) -> float:
    n = len(per_prompt)
    if n < 2:
        return float("nan")
    mean = sum(per_prompt) / n
    var = sum((x - mean) ** 2 for x in per_prompt) / (n - 1)
    return math.sqrt(var / n)


def paired_gain(before: EvalResult, after: EvalResult) -> tuple[float, float]:
    """Gain in accuracy and its standard error, pairing the two evaluations prompt by prompt."""
    if len(before.per_prompt) != len(after.per_prompt):
        raise ValueError("paired_gain needs evaluations over the same prompts")
    diffs = [a - b for a, b in zip(after.per_prompt, before.per_prompt, strict=True)]
    return sum(diffs) / len(diffs), clustered_stderr(diffs)


def evaluate(
    generate: Callable[[list[list[int]], SamplingParams], list[Completion]],
    rows: list[PromptRow],
    prompt_ids: list[list[int]],
    decode,
    runner: RewardRunner,
    params: SamplingParams,
    reducer: Reducer,
) -> EvalResult:
    """Score `params.n` samples of every prompt; prompts are split across ranks, results summed."""
    world, rank = reducer.world_size, reducer.rank
    mine = list(range(rank, len(rows), world))
    correct = torch.zeros(len(rows), dtype=torch.float64)
    if mine:
        completions = generate([prompt_ids[i] for i in mine], params)
        owners = [mine[j // params.n] for j in range(len(completions))]
        scores, _ = score_texts(
            runner, [rows[i] for i in owners], [decode(c.output_ids) for c in completions]
        )
        for i, score in zip(owners, scores, strict=True):
            correct[i] += float(bool(score.correct))
    reducer.sum_(correct)
    per_prompt = (correct / params.n).tolist()
    return EvalResult(per_prompt=per_prompt, samples=len(rows) * params.n)
