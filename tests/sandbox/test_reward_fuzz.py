"""Fuzz the reward runner with 1,200 hostile completions on each sandbox backend (tests/fuzz_inputs.py).

Garbage bytes, expression bombs, odd unicode, megabyte repetition loops, mixtures of them, and code-grader hacks
go through the real runner (process pool, math-verify, the sandbox). Nothing may escape as an exception, no
sample may earn a reward (none holds the gold answer, no program passes its test), and only the expression
bombs may run into the time limit: a repetition loop that did would mean extraction is no longer linear.
"""

import math
from collections import Counter

import pytest

from rewards import RewardsConfig, VerifierSpec
from rewards.runner import RewardRunner
from tests.fuzz_inputs import hostile_samples

N = 1200


def fuzz_config(backend: str) -> RewardsConfig:
    return RewardsConfig(
        verifiers=[
            VerifierSpec(name="math", tasks=["math"], params={"timeout_s": 1.0}),
            VerifierSpec(name="format", weight=0.0, tasks=["math"]),
            VerifierSpec(
                name="code",
                tasks=["code"],
                timeout_s=10.0,
                params={"backend": backend, "wall_s": 1.0, "cpu_s": 1.0, "memory_mb": 256},
            ),
        ],
        num_workers=2,
        timeout_s=3.0,
        error_reward=0.0,
    )


@pytest.mark.slow
def test_hostile_completions_earn_nothing_and_stay_bounded(backend):
    samples = hostile_samples(N, seed=0)
    with RewardRunner(fuzz_config(backend)) as runner:
        scores, metrics = runner.score([s.sample for s in samples], [s.task for s in samples])
    assert len(scores) == N
    kinds = Counter(s.kind for s in samples)
    assert min(kinds.values()) >= N // 10, kinds
    rewarded = [
        (s.kind, s.sample.completion[:80], sc)
        for s, sc in zip(samples, scores, strict=True)
        if sc.reward != 0
    ]
    assert rewarded == []
    assert all(math.isfinite(sc.reward) for sc in scores)
    timed_out = Counter(
        s.kind for s, sc in zip(samples, scores, strict=True) if sc.error and "timeout" in sc.error
    )
    assert set(timed_out) <= {"bomb", "mixture"}, timed_out
    code = [sc for s, sc in zip(samples, scores, strict=True) if s.task == "code"]
    assert code and all(sc.error is None and sc.correct is False for sc in code), [
        sc for sc in code if sc.error is not None or sc.correct is not False
    ][:3]
    assert metrics["reward/mean"] == 0.0
