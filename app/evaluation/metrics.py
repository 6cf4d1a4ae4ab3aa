"""The statistics of an evaluation: accuracy with a standard error clustered by prompt, paired gains, pass@k.

Standard errors are clustered by prompt: samples of one prompt are correlated, so the SE of an accuracy is the
standard deviation of the per-prompt values divided by sqrt(#prompts). Two evaluations on the same prompts
(before and after training) give a paired gain whose SE uses the per-prompt differences.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
eq. 1): for a prompt with n samples of which c are correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``, the chance
that k samples drawn without replacement from the n include a correct one (so pass@1 = c / n). It is averaged
over prompts, its SE clustered by prompt. Drawing n > k samples lowers the variance of pass@k without biasing
it. Reported: k = 1, the powers of two below k, and k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def clustered_stderr(per_prompt: list[float]) -> float:
    """Standard error of the mean of per-prompt values (NaN with fewer than two prompts)."""
    n = len(per_prompt)
    if n < 2:
        return float("nan")
    mean = sum(per_prompt) / n
    var = sum((x - mean) ** 2 for x in per_prompt) / (n - 1)
    return math.sqrt(var / n)


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Gain in accuracy and its standard error, pairing two evaluations' per-prompt values prompt by prompt."""
    if len(before) != len(after):
        raise ValueError("paired_gain needs evaluations over the same prompts")
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    return sum(diffs) / len(diffs), clustered_stderr(diffs)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``n`` samples, ``c`` of them correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: correct count c={c} must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in [1, n={n}] (draw at least k samples per prompt)")
    # Exact integers, one rounding: 1 - ratio would lose the digits of a small pass@k (large n, few correct).
    # With fewer than k incorrect samples C(n-c, k) = 0: every draw holds a correct one.
    draws = math.comb(n, k)
    return (draws - math.comb(n - c, k)) / draws


@dataclass(frozen=True)
class PassAtK:
    k: int
    value: float
    """Mean over prompts of the per-prompt estimates."""
    stderr: float
    """Clustered by prompt (NaN with fewer than two prompts)."""
    per_prompt: list[float]


def summarize(correct: list[int], n: int, k: int) -> PassAtK:
    """pass@k over prompts from each prompt's correct count (``n`` samples each)."""
    if not correct:
        raise ValueError("summarize: no prompts")
    per_prompt = [pass_at_k(n, c, k) for c in correct]
    return PassAtK(k, sum(per_prompt) / len(per_prompt), clustered_stderr(per_prompt), per_prompt)


def reported_ks(k: int) -> list[int]:
    """1, the powers of two below k, and k."""
    ks, power = {1, k}, 2
    while power < k:
        ks.add(power)
        power *= 2
    return sorted(ks)
