"""Math answers checked symbolically with math-verify 0.9.

Departures from calling ``math_verify.parse`` on the whole completion:
- **Our own answer extraction.** math-verify takes the *first* ``\\boxed{}``; a model's final answer is the *last*
  one. The default extraction is the last ``\\boxed{}``, else the last ``<answer>`` tag, else the final
  non-empty line; math-verify's own
  extractors over the whole text are available as ``"latex"`` and ``"expr"``.
- **Gold parsed as LaTeX.** A bare gold string is wrapped in ``$...$`` before parsing; bare, ``\\{1,2\\}``,
  ``(0,1]``, ``2\\sqrt{2}`` or ``\\infty`` are not recognised and equal answers would be judged wrong.
- **Our own time limit.** math-verify's timeouts use ``signal.alarm`` and cancel any outer alarm, so they are
  turned off and ``rewards.time_limit`` (nestable, sub-second) bounds each check instead. In a worker of the
  reward runner's process pool a check that hangs inside C code is also killed from outside.
- **Caches.** Each gold string is parsed once, and each (gold, extraction, extracted answer) is judged once per
  verifier instance (its parameters are fixed, so the instance is the parameter key): arithmetic answers repeat
  heavily within a group of samples. A check that timed out is cached as a timeout, so one pathological answer
  costs its time limit once, not once per copy.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rewards.registry import config_from_params, register
from rewards.time_limit import TimeLimitExceeded, time_limit
from rewards.types import Score, Verifier, VerifierInput

EXTRACTIONS = ("boxed", "answer_tag", "last_line", "latex", "expr")


@dataclass
class MathVerifierConfig:
    """Parameters of the ``math`` verifier (``rewards.verifiers[i].params``)."""

    extraction: list[str] = field(default_factory=lambda: ["boxed", "answer_tag", "last_line"])
    """Where the answer is taken from, tried in order until one finds something: ``boxed`` (the last
    ``\\boxed{}``/``\\fbox{}``), ``answer_tag`` (the last ``<answer>...</answer>``), ``last_line`` (the final
    non-empty line, an "Answer:" prefix dropped), ``latex`` / ``expr`` (math-verify's LatexExtractionConfig /
    ExprExtractionConfig over the whole completion)."""
    timeout_s: float = 5.0
    """Wall-clock limit for parsing and comparing one answer (main thread only; see rewards/time_limit.py)."""
    float_rounding: int = 6
    """Decimal places floats are rounded to before comparing (math-verify ``float_rounding``)."""
    numeric_precision: int = 15
    """Significant digits of numeric comparisons (math-verify ``numeric_precision``)."""
    strict: bool = True
    """math-verify strict mode: variables matter, and sets are not equal to tuples."""
    max_answer_chars: int = 1000
    """An extracted answer longer than this is judged wrong without parsing (deeply nested input hangs sympy)."""
    cache_size: int = 65536
    """Entries kept in each of the gold and verdict caches (least recently used dropped); 0 disables them."""
    max_scan_chars: int = 65536
    """Only the last this-many characters of a completion are searched for the answer. Extraction is linear
    in this length (bench/extraction.py); it bounds the cost of a degenerate, megabyte-long completion."""
    numeric_answer: bool = False
    """Only a number literal (integer, decimal, a/b or \\frac{a}{b}, optionally signed) can be correct. For
    computation tasks: symbolic equivalence alone would accept the question echoed back ("2+7" for "2+7=")."""

    def __post_init__(self) -> None:
        bad = [e for e in self.extraction if e not in EXTRACTIONS]
        if not self.extraction or bad:
            raise ValueError(
                f"math verifier params.extraction={list(self.extraction)!r} is not valid: "
                f"use a non-empty list of {list(EXTRACTIONS)}, e.g. ['boxed', 'answer_tag', 'last_line']"
            )
        for name in ("timeout_s", "max_answer_chars", "max_scan_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"math verifier params.{name}={getattr(self, name)!r} must be > 0")
        if self.cache_size < 0:
            raise ValueError(
                f"math verifier params.cache_size={self.cache_size!r} must be >= 0 (0: no cache)"
            )


# ---------------------------------------------------------------- answer extraction (pure string functions)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)  # an escaped character, or a brace
_ANSWER_OPEN = re.compile(r"<answer>", re.IGNORECASE)
_ANSWER_CLOSE = re.compile(r"</answer>", re.IGNORECASE)
_ANSWER_PREFIX = re.compile(
    r"^(?:\*\*)?(?:final answer|the final answer is|the answer is|answer)(?:\*\*)?\s*[:：]?\s*(?:\*\*)?",
    re.IGNORECASE,
)
_WORD = re.compile(r"[A-Za-z]{2,}")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")

# Every extraction below is one left-to-right pass (regex scans that cannot backtrack across the text, plus
# a stack), so its cost is linear in the text's length. A repetition loop (an unclosed "\boxed{x " or
# "<answer>" thousands of times) made the earlier "match each opener, then scan to its close" quadratic.


def last_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``.

    "Last" is the complete group whose opener comes last (so ``\\boxed{\\boxed{1}}`` gives ``1``). Braces
    match as in LaTeX: an escaped character (``\\{`` in a set) neither opens nor closes a group.
    """
    boxed_braces = {m.end() - 1 for m in _BOXED.finditer(text)}
    if not boxed_braces:
        return None
    best: tuple[int, int] | None = None  # (opening brace, closing brace) of the last-opened complete group
    stack: list[int] = []
    for token in _BRACE_TOKEN.finditer(text):
        ch = token.group()
        if ch == "{":
            stack.append(token.start())
        elif ch == "}" and stack:
            start = stack.pop()
            if start in boxed_braces and (best is None or start > best[0]):
                best = (start, token.start())
    return text[best[0] + 1 : best[1]].strip() if best else None


def last_answer_tag(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` (tags paired left to right, case-insensitive)."""
    closes = [m.start() for m in _ANSWER_CLOSE.finditer(text)]
    found: tuple[int, int] | None = None
    pos, j = 0, 0
    for m in _ANSWER_OPEN.finditer(text):
        if m.start() < pos:
            continue  # inside the pair just taken
        while j < len(closes) and closes[j] < m.end():
            j += 1
        if j == len(closes):
            break
        found = (m.end(), closes[j])
        pos = closes[j] + len("</answer>")
    return text[found[0] : found[1]].strip() if found else None


def last_line(text: str) -> str | None:
    """The final non-empty line, with an "Answer:" prefix, markdown bold and a trailing period removed."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    line = _ANSWER_PREFIX.sub("", lines[-1]).strip().strip("*`").strip()
    if line.endswith(".") and not line.endswith(".."):
        line = line[:-1].rstrip()
    return line or None


def extract_answer(
    text: str, extraction: list[str], max_scan_chars: int | None = None
) -> tuple[str, str] | None:
    """``(method, answer text)`` from the first extraction method that finds something, else None.

    Only the last ``max_scan_chars`` characters are searched (a final answer sits at the end); None scans all.
    """
    if max_scan_chars is not None and len(text) > max_scan_chars:
        text = text[-max_scan_chars:]
    for method in extraction:
        if method == "boxed":
            found = last_boxed(text)
        elif method == "answer_tag":
            found = last_answer_tag(text)
        elif method == "last_line":
            found = last_line(text)
        else:  # latex / expr: math-verify's own extractors run over the (scanned part of the) text later
            found = text if text.strip() else None
        if found:
            return method, found
    return None


def looks_like_math(text: str) -> bool:
    """Whether ``text`` reads as a bare formula rather than prose (no word of 2+ letters outside LaTeX commands)."""
    return _WORD.search(_LATEX_COMMAND.sub(" ", text)) is None


# ---------------------------------------------------------------- the verifier


_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed")
"""Math delimiters of a formula math-verify can parse as it is: `$` (not an escaped dollar sign `\\$`, as in
`\\$42`), `\\(`, `\\[`, `\\boxed`. Anything else is wrapped in `$...$` first."""

_INTEGER = re.compile(r"[+-]?\d{1,64}")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:\s*/\s*\d+)?|[+-]?\\[dt]?frac\{\d+\}\{\d+\}")


class _LRU(OrderedDict):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def get_item(self, key: Any) -> Any:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key: Any, value: Any) -> None:
        if self.size <= 0:
            return
        self[key] = value
        if len(self) > self.size:
            self.popitem(last=False)


class _TimeoutFilter(logging.Filter):
    """Drop math-verify's "Timeout is disabled" warning: we disable its alarms on purpose (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


class MathVerifier:
    """Reward 1.0 when the extracted answer equals the reference under math-verify, else 0.0.

    ``reference`` is the gold answer (a string such as ``"\\frac{1}{2}"``, a number, or a list of accepted
    answers). A completion with no answer is wrong, not an error; a missing reference or a check that runs out
    of time is an error (``Score.error``), which the runner turns into the configured error reward.
    """

    def __init__(self, cfg: MathVerifierConfig) -> None:
        import math_verify  # lazily: importing sympy takes about a second, and `import rewards` must stay cheap

        for name in ("math_verify.parser", "math_verify.grader"):
            logger = logging.getLogger(name)
            if not any(isinstance(f, _TimeoutFilter) for f in logger.filters):
                logger.addFilter(_TimeoutFilter())
        self.cfg = cfg
        self._mv = math_verify
        self._latex = [math_verify.LatexExtractionConfig()]
        self._expr = [math_verify.ExprExtractionConfig()]
        self._both = [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]
        self._golds = _LRU(cfg.cache_size)
        self._verdicts = _LRU(cfg.cache_size)

    def warmup(self) -> None:
        """Pay math-verify's first-call cost (about 0.3 s: lazy regexes, the LaTeX parser) before real samples."""
        self(VerifierInput("", "\\boxed{\\frac{1}{2}}", "0.5", {}))
        self._verdicts.clear()
        self._golds.clear()

    # -- parsing (math-verify's own timeouts off: rewards.time_limit bounds the whole check)
    def _parse(self, text: str, configs: list) -> list:
        return self._mv.parse(text, extraction_config=configs, parsing_timeout=None)

    def _parse_formula(self, text: str) -> list:
        """Parse a bare formula as LaTeX (wrapped in $...$), falling back to a plain expression."""
        if _DELIMITED.search(text):
            return self._parse(text, self._both)
        parsed = self._parse(f"${text}$", self._latex)
        if not any(not isinstance(p, str) for p in parsed):
            parsed = self._parse(text, self._expr) or parsed
        return parsed

    def _parse_prediction(self, method: str, answer: str) -> list:
        if method == "latex":
            return self._parse(answer, self._latex)
        if method == "expr":
            return self._parse(answer, self._expr)
        if method == "last_line" and not looks_like_math(answer):
            return self._parse(answer, self._both)  # prose: let math-verify find the math in it
        return self._parse_formula(answer)

    def _gold(self, gold: str) -> list:
        parsed = self._golds.get_item(gold)
        if parsed is None:
            parsed = self._parse_formula(gold)
            self._golds.put(gold, parsed)
        return parsed

    def _judge(self, golds: tuple[str, ...], method: str, answer: str) -> tuple[bool | None, str | None]:
        cfg = self.cfg
        if _INTEGER.fullmatch(answer) and all(_INTEGER.fullmatch(g) for g in golds):
            # Two integer literals are equal exactly when their values are: the verdict math-verify would
            # reach, at a thousandth of its cost (parsing dominates the reward time of arithmetic tasks).
            return int(answer) in {int(g) for g in golds}, None
        with time_limit(cfg.timeout_s, "math-verify check") as mine:
            try:
                prediction = self._parse_prediction(method, answer)
                if not prediction:
                    return False, None
                for gold in golds:
                    parsed_gold = self._gold(gold)
                    if self._mv.verify(
                        parsed_gold,
                        prediction,
                        float_rounding=cfg.float_rounding,
                        numeric_precision=cfg.numeric_precision,
                        strict=cfg.strict,
                        timeout_seconds=None,
                    ):
                        return True, None
                return False, None
            except TimeLimitExceeded as e:
                if e is not mine:
                    raise
                return None, f"timeout: math-verify check took more than {cfg.timeout_s:g} s"

    def __call__(self, sample: VerifierInput) -> Score:
        golds = _gold_strings(sample.reference)
        if not golds:
            return Score(
                0.0, None, {}, error=f"math: sample has no reference answer (got {sample.reference!r})"
            )
        found = extract_answer(sample.completion or "", self.cfg.extraction, self.cfg.max_scan_chars)
        if found is None:
            return Score(0.0, False, {"extracted": None})
        method, answer = found
        breakdown = {"extraction": method, "extracted": answer[:200]}
        if method not in ("latex", "expr") and len(answer) > self.cfg.max_answer_chars:
            return Score(0.0, False, {**breakdown, "reason": "answer too long"})
        if self.cfg.numeric_answer and not _NUMBER.fullmatch(answer.strip()):
            return Score(0.0, False, {**breakdown, "reason": "not a number"})
        key = (golds, method, answer)
        verdict = self._verdicts.get_item(key)
        if verdict is None:
            verdict = self._judge(golds, method, answer)
            self._verdicts.put(key, verdict)
        correct, error = verdict
        if error is not None:
            return Score(0.0, None, breakdown, error=error)
        return Score(1.0 if correct else 0.0, correct, breakdown)


def _gold_strings(reference: Any) -> tuple[str, ...]:
    if reference is None:
        return ()
    items = reference if isinstance(reference, (list, tuple)) else [reference]
    return tuple(str(r).strip() for r in items if r is not None and str(r).strip())


@register("math", params=MathVerifierConfig)
def math_verifier(**params: Any) -> Verifier:
    """The ``math`` verifier; ``params`` are the fields of MathVerifierConfig."""
    return MathVerifier(config_from_params(MathVerifierConfig, params, "math"))
