"""Built-in task `builtin:arithmetic`: integer expressions such as `7+5*3-4=` (plain prompts), and `split_of`,
the hash that assigns every built-in problem to train or test (never by the seed, so the splits never share one).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

from app.data.rows import PromptRow
from tools.formats import FencedFormat

_OPERATORS = "+-*"
TEST_FRACTION = 10
"""One expression in TEST_FRACTION goes to the test split, chosen by a hash of its text (never by the seed)."""


@dataclass
class ArithmeticConfig:
    """Built-in task: multi-step integer arithmetic with standard precedence, e.g. `7+5*3-4=` -> `18`."""

    min_ops: int = 1
    """Fewest operators in an expression."""
    max_ops: int = 3
    """Most operators in an expression; each expression draws its operator count uniformly in [min, max]."""
    max_operand: int = 9
    """Operands are integers drawn uniformly from 0..max_operand."""
    operators: str = "+-*"
    """Operators to draw from, a subset of '+-*' (no division: answers stay exact integers)."""
    seed: int = 0
    """Seed of the generator; the train/test assignment does not depend on it, so splits never overlap."""
    solutions: Literal["answer", "worked", "tool"] = "answer"
    """The reply `trustbatch sft` (and model.bootstrap) learns, each row's `completion`: the answer alone
    (`18`), worked step by step in the \\boxed{} answer format (`5*3=15. 7+15=22. 22-4=18. \\boxed{18}`), or
    computed with the python tool (a ```python block printing the expression, its ```output block, then the
    boxed answer; docs/tools.md)."""

    def __post_init__(self) -> None:
        if self.solutions not in ("answer", "worked", "tool"):
            raise ValueError(f"data.arithmetic.solutions={self.solutions!r}: choose answer, worked or tool")
        if self.min_ops < 1:
            raise ValueError(f"data.arithmetic.min_ops={self.min_ops} must be >= 1")
        if self.max_ops < self.min_ops:
            raise ValueError(
                f"data.arithmetic.max_ops={self.max_ops} is below data.arithmetic.min_ops={self.min_ops}; "
                f"set max_ops >= min_ops"
            )
        if self.max_operand < 1:
            raise ValueError(f"data.arithmetic.max_operand={self.max_operand} must be >= 1")
        bad = sorted(set(self.operators) - set(_OPERATORS))
        if not self.operators or bad or len(set(self.operators)) != len(self.operators):
            raise ValueError(
                f"data.arithmetic.operators={self.operators!r} must be a non-empty string of distinct characters "
                f"from {_OPERATORS!r}" + (f" (not {bad})" if bad else "")
            )


def evaluate_expression(expr: str) -> int:
    """Exact value of an expression of non-negative integers and + - * with standard precedence."""
    total, term, sign, number = 0, 1, 1, ""
    for char in expr + "+":  # a trailing "+" flushes the last term
        if char.isdigit():
            number += char
            continue
        if char not in _OPERATORS or not number:
            raise ValueError(f"not an expression of integers and {_OPERATORS!r}: {expr!r}")
        term *= int(number)
        number = ""
        if char != "*":  # a term ends: add it with its sign, start the next one
            total += sign * term
            sign, term = (1 if char == "+" else -1), 1
    return total


def solution(expr: str, kind: str) -> str:
    """The reply of `ArithmeticConfig.solutions` ``kind`` for ``expr``."""
    value = evaluate_expression(expr)
    if kind == "worked":
        return worked_solution(expr)
    if kind == "tool":
        fenced = FencedFormat()
        return f"```python\nprint({expr})\n```{fenced.before}{value}{fenced.after}\\boxed{{{value}}}"
    return str(value)


def worked_solution(expr: str) -> str:
    """The steps a reader takes, products first, then sums and differences left to right, each as ``a*b=c.``,
    and the value in \\boxed{}: ``7+5*3-4`` -> ``5*3=15. 7+15=22. 22-4=18. \\boxed{18}``."""
    tokens = re.findall(r"\d+|[-+*]", expr)
    steps, terms = [], [int(tokens[0])]
    ops = []
    for op, number in zip(tokens[1::2], tokens[2::2], strict=True):
        if op == "*":
            product = terms[-1] * int(number)
            steps.append(f"{terms[-1]}*{number}={product}.")
            terms[-1] = product
        else:
            ops.append(op)
            terms.append(int(number))
    total = terms[0]
    for op, term in zip(ops, terms[1:], strict=True):
        value = total + term if op == "+" else total - term
        steps.append(f"{total}{op}{term}={value}.")
        total = value
    return " ".join(steps + [f"\\boxed{{{total}}}"])


def split_of(expr: str, test_fraction: int = TEST_FRACTION) -> Literal["train", "test"]:
    """The split a problem belongs to: a stable hash of its canonical text (SHA-256), 1 in `test_fraction` is
    test."""
    digest = hashlib.sha256(expr.encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:8], "big") % test_fraction == 0 else "train"


def arithmetic_prompts(cfg: ArithmeticConfig, split: Literal["train", "test"], n: int) -> list[PromptRow]:
    """`n` distinct arithmetic prompts of `split`, deterministic from `cfg.seed`.

    Prompts are `f"{expr}="` and answers the exact integer as a string. A longer request extends a shorter one
    (the first n rows never depend on n). Raises ValueError when the split has fewer than n expressions.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} must be 'train' or 'test'")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    rng = random.Random(f"arithmetic:{cfg.seed}:{split}")
    operands = cfg.max_operand + 1
    space = {k: operands ** (k + 1) * len(cfg.operators) ** k for k in range(cfg.min_ops, cfg.max_ops + 1)}
    seen: dict[int, set[str]] = {k: set() for k in space}  # every expression drawn, either split
    open_counts = list(space)  # operator counts with expressions not yet drawn
    fix = (
        "raise data.arithmetic.max_operand or data.arithmetic.max_ops (or add data.arithmetic.operators), "
        "or lower data.num_train / data.num_eval"
    )
    if n > sum(space.values()):
        raise ValueError(
            f"{n} arithmetic prompts requested but only {sum(space.values())} expressions exist; {fix}"
        )
    rows: list[PromptRow] = []
    while len(rows) < n:
        if not open_counts:
            raise ValueError(
                f"the arithmetic {split} split has {len(rows)} expressions, {n} requested; {fix}"
            )
        k = rng.choice(open_counts)
        parts = [str(rng.randint(0, cfg.max_operand))]
        for _ in range(k):
            parts += [rng.choice(cfg.operators), str(rng.randint(0, cfg.max_operand))]
        expr = "".join(parts)
        if expr in seen[k]:
            continue
        seen[k].add(expr)
        if len(seen[k]) == space[k]:
            open_counts.remove(k)
        if split_of(expr) != split:
            continue
        rows.append(
            PromptRow(
                prompt=f"{expr}=",
                messages=None,
                answer=str(evaluate_expression(expr)),
                tests=None,
                task="math",
                id=f"arithmetic-{split}-{len(rows)}",
                metadata={"source": "builtin:arithmetic", "num_ops": k},
                completion=solution(expr, cfg.solutions),
            )
        )
    return rows


