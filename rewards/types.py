"""The verifier contract: text in, a Score out.

A verifier never sees token ids, tensors, the model or the root config. It is a plain callable,
``Verifier = Callable[[VerifierInput], Score]``, built by a factory that takes keyword parameters from the config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class VerifierInput:
    """One sample to score."""

    prompt: str
    """The prompt text the completion answers."""
    completion: str
    """The generated text (decoded, without the prompt)."""
    reference: Any = None
    """What the completion is checked against: a gold answer (math) or a list of tests (code)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form row metadata; ``metadata["task"]`` routes the sample to verifiers."""


@dataclass(frozen=True)
class Score:
    """What a verifier says about one sample."""

    reward: float
    """The scalar reward (built-ins return values in [0, 1])."""
    correct: bool | None = None
    """Whether the answer is right, where that question makes sense (None: not applicable)."""
    breakdown: dict[str, Any] = field(default_factory=dict)
    """Small, picklable details for logs (what was extracted, which tests failed and why)."""
    error: str | None = None
    """Set when the verifier could not judge the sample (exception, time limit, sandbox failure).
    The runner then uses ``rewards.error_reward`` and counts the sample in ``reward/error_rate``; an error that
    starts with ``"timeout"`` is also counted in ``reward/timeout_rate``."""


Verifier = Callable[[VerifierInput], Score]
"""A verifier: any callable from one VerifierInput to one Score."""

VerifierFactory = Callable[..., Verifier]
"""Builds a verifier from the keyword parameters given in ``rewards.verifiers[i].params``."""
