"""Two tiny text verifiers: ``format`` (a regular expression the completion must match) and ``exact``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rewards.registry import config_from_params, register
from rewards.types import Score, Verifier, VerifierInput

DEFAULT_PATTERN = r"\A(?=(.*?\\boxed\{))\1.+\}"
FULL_BOXED = r"\\boxed\{.+\}"
"""With ``full_match``, the default pattern means what it always did: the whole completion is one ``\\boxed{...}``
(anchored at both ends, so this form is linear too)."""


@dataclass
class FormatVerifierConfig:
    """Parameters of the ``format`` verifier."""

    pattern: str = DEFAULT_PATTERN
    r"""Regular expression searched for in the completion (Python ``re``, DOTALL). The default wants a
    ``\\boxed{`` with a ``}`` somewhere after it; the lookahead (atomic in ``re``) commits to the first ``\\boxed{``, so it is
    linear where the plain ``\\boxed\{.+\}`` is quadratic on a repetition loop of unclosed boxes. A pattern
    runs in C code that no time limit interrupts (the runner then kills the worker): keep yours linear."""
    full_match: bool = False
    """Require the whole (stripped) completion to match, not just a part of it."""
    max_scan_chars: int = 65536
    """Only the last this-many characters are matched (with ``full_match``, a longer completion fails)."""

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(
                f"format verifier params.pattern={self.pattern!r} is not a valid regex: {e}"
            ) from e
        if self.max_scan_chars <= 0:
            raise ValueError(f"format verifier params.max_scan_chars={self.max_scan_chars!r} must be > 0")


@register("format", params=FormatVerifierConfig)
def format_verifier(**params: Any) -> Verifier:
    """Reward 1.0 when the completion matches ``pattern``, else 0.0 (a shaping term, weighted beside math)."""
    cfg = config_from_params(FormatVerifierConfig, params, "format")
    pattern = FULL_BOXED if cfg.full_match and cfg.pattern == DEFAULT_PATTERN else cfg.pattern
    regex = re.compile(pattern, re.DOTALL)

    def verify(sample: VerifierInput) -> Score:
        text = (sample.completion or "").strip()
        if cfg.full_match:
            ok = len(text) <= cfg.max_scan_chars and bool(regex.fullmatch(text))
        else:
            ok = bool(regex.search(text[-cfg.max_scan_chars :]))
        return Score(1.0 if ok else 0.0, ok, {})

    return verify


@dataclass
class ExactVerifierConfig:
    """Parameters of the ``exact`` verifier."""

    case_sensitive: bool = True
    """Compare case-sensitively."""
    strip: bool = True
    """Strip surrounding whitespace from both sides before comparing."""


@register("exact", params=ExactVerifierConfig)
def exact_verifier(**params: Any) -> Verifier:
    """Reward 1.0 when the completion equals ``reference`` (or one of a list of references), else 0.0."""
    cfg = config_from_params(ExactVerifierConfig, params, "exact")

    def norm(text: str) -> str:
        text = text.strip() if cfg.strip else text
        return text if cfg.case_sensitive else text.casefold()

    def verify(sample: VerifierInput) -> Score:
        refs = sample.reference if isinstance(sample.reference, (list, tuple)) else [sample.reference]
        refs = [str(r) for r in refs if r is not None]
        if not refs:
            return Score(0.0, None, {}, error=f"exact: sample has no reference (got {sample.reference!r})")
        ok = norm(sample.completion or "") in {norm(r) for r in refs}
        return Score(1.0 if ok else 0.0, ok, {})

    return verify
