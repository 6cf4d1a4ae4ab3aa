"""Every sampling value trustbatch takes, checked in one place (no fastapi, no torch: config code imports it).

The same checks guard the engine's ``SamplingParams`` (app/rollout/base.py), the config's rollout section
(app/config.py), the evaluation settings (app/evaluation/config.py) and both HTTP APIs of the built-in server (app/serving/): SGLang's native
``sampling_params`` and OpenAI's ``/v1`` fields. What they refuse:

- numbers that are not finite: NaN, infinities and integers too large for a float (``1e999`` parses to inf);
- a temperature other than 0 (greedy) below ``MIN_TEMPERATURE``: a denormal such as 1e-320 turns the logits
  into infinities; ``greedy=False`` (RL sampling) refuses 0 too;
- ``top_p`` outside (0, 1]; seeds outside ``SEED_RANGE`` (what ``torch.Generator.manual_seed`` takes);
  token budgets outside [1, ``MAX_NEW_TOKENS``]; stop ids outside the vocabulary; text with lone surrogates
  (no tokenizer takes them and no response could carry them);
- a field the built-in engine cannot honour set to anything but its neutral value (``UNSUPPORTED``: penalties,
  top-k, constrained decoding, ...), so nothing is silently ignored.

A refusal is a ``RequestError``: a ValueError that names the field (``field``, a dotted path such as
``sampling_params.top_p``) and carries the HTTP status (400 unless said) and an optional OpenAI error code; each
route module of app/serving/ renders it in its API's shape.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable
from typing import Any

MIN_TEMPERATURE = 1e-6
"""Smallest temperature other than 0 (greedy): logits / T must stay finite in float32 (1e-320 made them inf)."""
MAX_TEMPERATURE = 2.0
"""OpenAI's upper bound, kept by the /v1 API and `trustbatch eval` (the native API and the config have none)."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""What ``torch.Generator.manual_seed`` accepts; a seed outside it would fail inside the engine."""
MAX_NEW_TOKENS = 2**31 - 1
"""Largest token budget taken (any budget past the context is cut to it by the engine anyway)."""
TOP_K_ALL = 1 << 30
"""SGLang's default top_k (1073741824): no top-k truncation."""


class RequestError(ValueError):
    """A refused value or request: ``message``, the offending ``field`` (None: the request as a whole), the HTTP
    ``status`` and an OpenAI error ``code`` (e.g. ``context_length_exceeded``)."""

    def __init__(
        self, message: str, field: str | None = None, *, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.field, self.status, self.code = message, field, status, code


def describe(value: Any, limit: int = 60) -> str:
    """A short JSON rendering of a client's value for an error message (ASCII; never fails)."""
    if isinstance(value, (str, list)) and len(value) > limit:
        value = value[:limit]
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def finite_number(value: Any, field: str) -> float:
    """``value`` as a finite float: RequestError for a non-number, NaN, an infinity or a too large integer."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RequestError(f"{field} must be a number, got {describe(value)}", field)
    try:
        number = float(value)
    except OverflowError:
        raise RequestError(
            f"{field} must be a finite number, got an integer of {len(str(value))} digits", field
        ) from None
    if not math.isfinite(number):
        raise RequestError(f"{field} must be a finite number, got {describe(number)}", field)
    return number


def temperature(value: Any, field: str, *, maximum: float | None = None, greedy: bool = True) -> float:
    """0 (greedy, unless ``greedy`` is False) or a number in [MIN_TEMPERATURE, maximum]."""
    number = finite_number(value, field)
    if greedy and number == 0:
        return 0.0
    if number < MIN_TEMPERATURE or (maximum is not None and number > maximum):
        allowed = (
            f"at least {MIN_TEMPERATURE:g}" if maximum is None else f"in [{MIN_TEMPERATURE:g}, {maximum:g}]"
        )
        prefix = "0 (greedy) or " if greedy else ""
        raise RequestError(f"{field} must be {prefix}{allowed}, got {describe(value)}", field)
    return number


def top_p(value: Any, field: str) -> float:
    number = finite_number(value, field)
    if not 0 < number <= 1:
        raise RequestError(f"{field} must be a number in (0, 1], got {describe(value)}", field)
    return number


def bounded_int(value: Any, field: str, low: int, high: int | None = None) -> int:
    if not is_int(value) or value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"{field} must be an integer {allowed}, got {describe(value)}", field)
    return int(value)


def seed(value: Any, field: str) -> int:
    if not is_int(value):
        raise RequestError(f"{field} must be an integer, got {describe(value)}", field)
    if not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise RequestError(f"{field} must be an integer in [-2**63, 2**64 - 1], got {describe(value)}", field)
    return int(value)


def token_ids(value: Any, field: str, vocab_size: int | None) -> list[int]:
    """A list of token ids, each in [0, vocab_size) (>= 0 when the vocabulary is not known)."""
    if not isinstance(value, (list, tuple)) or not all(
        is_int(t) and 0 <= t and (vocab_size is None or t < vocab_size) for t in value
    ):
        raise RequestError(
            f"{field} must be a list of token ids in [0, {vocab_size or 'vocab_size'}), got {describe(value)}",
            field,
        )
    return [int(t) for t in value]


def unicode_text(value: str, field: str) -> str:
    """``value`` if it can be encoded as UTF-8; RequestError for a lone surrogate such as ``"\\ud800"``."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"{field} is not valid Unicode: {exc.reason} at character {exc.start} (a lone UTF-16 surrogate)",
            field,
        ) from None
    return value


def stop_strings(value: Any, field: str, max_count: int) -> tuple[str, ...]:
    """A stop string or a list of at most ``max_count`` non-empty ones, deduplicated in order."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"{field} must be a string or an array of strings, got {describe(value)}", field)
    if len(stops) > max_count:
        raise RequestError(f"{field} has {len(stops)} strings; give at most {max_count}", field)
    if any(s == "" for s in stops):
        raise RequestError(f"{field} strings must not be empty", field)
    return tuple(dict.fromkeys(unicode_text(s, field) for s in stops))


def check_sampling(
    values: dict[str, tuple[str, Any]],
    *,
    vocab_size: int | None = None,
    max_n: int | None = None,
    max_temperature: float | None = None,
) -> dict[str, Any]:
    """The engine's sampling fields checked: ``values`` maps a ``SamplingParams`` field (``max_new_tokens``,
    ``temperature``, ``top_p``, ``n``, ``stop_token_ids``, ``seed``) to (its name in the request, its value);
    None values are left out. Returns the checked values by ``SamplingParams`` field."""
    checks: dict[str, Callable[[Any, str], Any]] = {
        "max_new_tokens": lambda v, f: bounded_int(v, f, 1, MAX_NEW_TOKENS),
        "temperature": lambda v, f: temperature(v, f, maximum=max_temperature),
        "top_p": top_p,
        "n": lambda v, f: bounded_int(v, f, 1, max_n),
        "stop_token_ids": lambda v, f: tuple(token_ids(v, f, vocab_size)),
        "seed": seed,
    }
    return {key: checks[key](value, name) for key, (name, value) in values.items() if value is not None}


def empty(value: Any) -> bool:
    return value is None or value == "" or value == [] or value == {}


def _neutral(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or (not isinstance(value, bool) and value in values)


def _false(value: Any) -> bool:
    return value is None or value is False


def _no_choice(value: Any) -> bool:
    return value in (None, "none", "auto")


_PENALTY = "penalties are not supported"
_TOOLS = "the legacy functions API is not supported; use tools (chat completions)"
_CONSTRAINED = "constrained decoding is not supported"
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "top_k": (_neutral(-1, 0, TOP_K_ALL), f"top-k sampling is not supported; use -1 or {TOP_K_ALL} (all tokens)"),
    "min_p": (_neutral(0), "min-p sampling is not supported; use 0"),
    "frequency_penalty": (_neutral(0), f"{_PENALTY}; use 0"),
    "presence_penalty": (_neutral(0), f"{_PENALTY}; use 0"),
    "repetition_penalty": (_neutral(1), f"{_PENALTY}; use 1"),
    "min_new_tokens": (_neutral(0), "a minimum length is not supported; use 0"),
    "min_tokens": (_neutral(0), "a minimum length is not supported; use 0"),
    "top_logprobs": (_neutral(0), "top alternatives are not computed; use 0"),
    "beam_width": (_neutral(0, 1), "beam search is not supported; use 0 or 1"),
    "ignore_eos": (_false, "the EOS token always ends a sequence; use false"),
    "echo": (_false, "echoing the prompt is not supported; use false"),
    **{key: (empty, _CONSTRAINED) for key in ("json_schema", "regex", "ebnf", "structural_tag", "choice")},
    "functions": (empty, _TOOLS),
    "function_call": (_no_choice, _TOOLS),
    "logit_bias": (empty, "logit biases are not supported"),
    "suffix": (lambda v: v is None or v == "", "insertion (a suffix) is not supported"),
    "custom_params": (empty, "custom logit processors are not supported"),
    "watermark": (empty, "watermarking is not supported"),
}  # fmt: skip
"""Fields the built-in engine cannot honour: field -> (is this value neutral?, why else it is refused)."""


def check_supported(fields: dict[str, Any], prefix: str = "") -> None:
    """RequestError for the first field of ``UNSUPPORTED`` in ``fields`` that is not at its neutral value."""
    for key, (neutral, why) in UNSUPPORTED.items():
        if key in fields and not neutral(fields[key]):
            raise RequestError(
                f"{prefix}{key} = {describe(fields[key])}: {why} (built-in server)", f"{prefix}{key}"
            )
