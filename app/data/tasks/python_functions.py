"""Built-in task `builtin:python_functions`: short function-writing problems graded by the sandboxed code verifier.

Arithmetic on arguments, strings (reverse, count, case, palindromes), lists (sum, max, filter, index), loops and
conditionals: the table is python_function_templates.py. Each problem is one chat request, e.g. "Write a Python
function `times_7(x)` that returns x multiplied by 7. For example, `times_7(3)` returns `21`. Answer with the
code in a ```python block.", and `num_tests` assert tests (task `code`) that the `code` verifier runs in its
sandbox after the extracted program.

How the tests are made: the problem's own random generator (seeded by `seed` and the problem's key, so a problem's
tests never depend on which other problems were drawn) draws argument tuples from ARG_KINDS; trustbatch's
reference solution (from the table) computes each expected value. The tests are chosen to cover as many
different expected values as the draws allow and must hold at least two, so no constant function passes them
all (a boolean function's tests hold both True and False). Each test checks the exact type as well
(`type(result) is int and result == 21`): True is not 1, 21.0 is not 21, and an object whose `==` is always true
fails. Before a problem is kept, each test is run on the reference solution itself; one that fails (an expected
value whose repr does not read back, a solution whose value changes from call to call) refuses the problem with
an error naming the template and parameters.

The train/test split hashes the problem's key (template and parameters, e.g. `times_k:k=7`), 1 in
TEST_FRACTION to test, so the held-out problems are functions never seen in training, whatever the seed.
"""

from __future__ import annotations

import copy
import functools
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from app.data.rows import PromptRow
from app.data.tasks.arithmetic import split_of
from app.data.tasks.pools import draw_problems
from app.data.tasks.python_function_templates import FUNCTION_TEMPLATES, FunctionTemplate

TEST_FRACTION = 2
"""One problem in TEST_FRACTION (by a hash of its key) is held out: about half of the table's problems, so a built-in
evaluation of 500 problems (`trustbatch eval --data builtin:python_functions`) fits in the test split."""
INSTRUCTION = "Answer with the code in a ```python block."
_CANDIDATE_DRAWS = 200
_CATEGORIES = ("arithmetic", "strings", "lists", "loops")

_TEXT_WORDS = ("Hello", "world", "Data", "apple", "Sky", "river", "blue", "Open", "code", "quiet", "Tiger", "moon",
               "idea", "under", "Echo", "sand")  # fmt: skip
_NAME_WORDS = ("cat", "dog", "sun", "tree", "lamp", "river", "stone", "apple", "moon", "bird", "sky", "book")


def _letters(rng: random.Random, low: int = 0, high: int = 10) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(low, high)))


def _letters_with(rng: random.Random, c: str) -> str:
    """Lowercase letters, each one `c` with probability 1/4: tests see strings with and without it."""
    return "".join(c if rng.random() < 0.25 else rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 10)))


def _maybe_palindrome(rng: random.Random) -> str:
    half = _letters(rng, 1, 4)
    return rng.choice((half + half[::-1], half + rng.choice("abc") + half[::-1], _letters(rng, 2, 7)))


def _ints(rng: random.Random, low: int, high: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(low, high))]


ARG_KINDS: dict[str, Callable[[random.Random, dict[str, Any]], Any]] = {
    "int": lambda rng, s: rng.randint(-50, 50),
    "small_int": lambda rng, s: rng.randint(-9, 9),
    "nat": lambda rng, s: rng.choice((rng.randint(0, 9), rng.randint(10, 99), rng.randint(100, 999))),
    "small_nat": lambda rng, s: rng.randint(0, 12),
    "positive": lambda rng, s: rng.randint(1, 60),
    "percent": lambda rng, s: rng.randint(0, 100),
    "digit": lambda rng, s: rng.randint(0, 9),
    "word": lambda rng, s: rng.choice(_NAME_WORDS),
    "letters": lambda rng, s: _letters(rng),
    "letters_c": lambda rng, s: _letters_with(rng, s["c"]),
    "text": lambda rng, s: " ".join(rng.choice(_TEXT_WORDS) for _ in range(rng.randint(1, 4))),
    "maybe_palindrome": lambda rng, s: _maybe_palindrome(rng),
    "int_list": lambda rng, s: _ints(rng, 0, 7, -20, 20),
    "nonempty_int_list": lambda rng, s: _ints(rng, 1, 7, -20, 20),
    "long_int_list": lambda rng, s: _ints(rng, 5, 8, -20, 20),
    "small_int_list": lambda rng, s: _ints(rng, 0, 5, -5, 5),
    "digit_list": lambda rng, s: _ints(rng, 0, 8, 0, 9),
}
"""Argument kinds of the table's `args`: (rng, the problem's parameters) -> one argument value."""


@dataclass
class PythonFunctionsConfig:
    """Built-in task: write a short Python function (a fenced ```python block), graded by assert tests."""

    categories: list[str] = field(default_factory=list)
    """Categories to draw from; empty = all: arithmetic, strings, lists, loops."""
    templates: list[str] = field(default_factory=list)
    """Templates to draw from (names in app/data/tasks/python_function_templates.py); empty = all of the
    chosen categories."""
    num_tests: int = 3
    """Assert tests per problem (2-5); one more input is shown in the prompt as an example."""
    seed: int = 0
    """Seed of the generator (which problems, in which order, and their test inputs); the train/test assignment is
    a hash of each problem's template and parameters, so the splits never share a problem whatever the seed."""

    def __post_init__(self) -> None:
        bad = sorted(set(self.categories) - set(_CATEGORIES))
        if bad or len(set(self.categories)) != len(self.categories):
            raise ValueError(
                f"data.python_functions.categories={list(self.categories)!r} must list distinct categories from "
                f"{list(_CATEGORIES)} (empty = all)" + (f"; unknown: {bad}" if bad else "")
            )
        bad = [t for t in self.templates if t not in FUNCTION_TEMPLATES]
        if bad or len(set(self.templates)) != len(self.templates):
            raise ValueError(
                f"data.python_functions.templates={list(self.templates)!r} must list distinct template names from "
                f"{list(FUNCTION_TEMPLATES)} (empty = all)" + (f"; unknown: {bad}" if bad else "")
            )
        if not 2 <= self.num_tests <= 5:
            raise ValueError(f"data.python_functions.num_tests={self.num_tests} must be between 2 and 5")
        if not self.chosen():
            raise ValueError(
                f"no template of data.python_functions.templates={list(self.templates)} is in "
                f"data.python_functions.categories={list(self.categories)}; widen one of them"
            )

    def chosen(self) -> list[FunctionTemplate]:
        """The templates this config draws from, in FUNCTION_TEMPLATES order."""
        return [
            t
            for t in FUNCTION_TEMPLATES.values()
            if (not self.templates or t.name in self.templates)
            and (not self.categories or t.category in self.categories)
        ]


def function_problem_key(template: str, slots: dict[str, Any]) -> str:
    """A problem's canonical content, e.g. `times_k:k=7`: what the train/test split hashes."""
    return f"{template}:" + ",".join(f"{k}={v}" for k, v in slots.items())


@functools.cache
def _pool(template: str, split: Literal["train", "test"]) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """The parameter assignments of every problem of `template` in `split`, in the table's order."""
    spec = FUNCTION_TEMPLATES[template]
    return tuple(
        tuple(slots.items())
        for slots in spec.problems()
        if split_of(function_problem_key(template, slots), TEST_FRACTION) == split
    )


def python_function_prompts(
    cfg: PythonFunctionsConfig, split: Literal["train", "test"], n: int
) -> list[PromptRow]:
    """`n` distinct function-writing problems of `split` as chat rows with assert tests, deterministic from
    `cfg.seed`.

    Each problem draws its template uniformly among those with problems left, then one of that template's
    problems not yet drawn. A longer request extends a shorter one (the first n rows never depend on n). Raises
    ValueError when the split has fewer than n problems, or when a problem's tests fail on its own reference
    solution.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} must be 'train' or 'test'")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    templates = cfg.chosen()
    pools = [_pool(t.name, split) for t in templates]
    if n > sum(len(pool) for pool in pools):
        both = sum(len(_pool(t.name, s)) for t in templates for s in ("train", "test"))
        raise ValueError(
            f"{n} python_functions problems requested but the {split} split has only "
            f"{sum(len(p) for p in pools)} distinct problems ({both} in both splits) of the chosen templates; "
            f"widen data.python_functions.categories / templates (empty = all) or lower data.num_train / "
            f"data.num_eval"
        )
    rng = random.Random(f"python_functions:{cfg.seed}:{split}")
    rows: list[PromptRow] = []
    for i, index in itertools.islice(draw_problems([len(pool) for pool in pools], rng), n):
        problem = make_problem(templates[i], dict(pools[i][index]), cfg.num_tests, cfg.seed)
        rows.append(problem.row(f"python_functions-{split}-{len(rows)}"))
    return rows


@dataclass(frozen=True)
class FunctionProblem:
    """One problem: its template and parameters, the reference solution, the example and the tests."""

    template: FunctionTemplate
    slots: dict[str, Any]
    function: str
    solution: str
    example: tuple[str, Any]
    """(call, expected value) shown in the prompt."""
    tests: tuple[tuple[str, Any], ...]
    """(call, expected value) of each test."""

    @property
    def key(self) -> str:
        return function_problem_key(self.template.name, self.slots)

    def prompt(self) -> str:
        call, value = self.example
        return (
            f"Write a Python function `{self.function}({', '.join(self.template.arg_names)})` that "
            f"{self.template.request.format(**self.slots)}. For example, `{call}` returns `{value!r}`. "
            f"{INSTRUCTION}"
        )

    def test_code(self) -> list[str]:
        """Each test as Python statements: the call, then its exact type and value asserted."""
        return [
            f"result = {call}\nassert type(result) is {type(value).__name__} and result == {value!r}, result"
            for call, value in self.tests
        ]

    def row(self, row_id: str) -> PromptRow:
        return PromptRow(
            prompt=None,
            messages=[{"role": "user", "content": self.prompt()}],
            answer=None,
            tests=[{"code": code} for code in self.test_code()],
            task="code",
            id=row_id,
            metadata={
                "source": "builtin:python_functions",
                "template": self.template.name,
                "category": self.template.category,
                "key": self.key,
                "solution": self.solution,
            },
            completion=f"```python\n{self.solution.strip()}\n```",
        )


def make_problem(spec: FunctionTemplate, slots: dict[str, Any], num_tests: int, seed: int) -> FunctionProblem:
    """One problem of `spec` with its tests drawn and checked against the reference solution (see the module
    docstring); ValueError, naming the template and parameters, when that check fails."""
    where = f"builtin:python_functions template {spec.name!r} with {slots}"
    function = spec.function.format(**slots)
    solution = spec.source(slots)
    reference = _compile(solution, function, where)
    rng = random.Random(f"python_functions:{seed}:{function_problem_key(spec.name, slots)}")
    by_value: dict[str, list[tuple[str, Any]]] = {}  # repr of the expected value -> (call, value) pairs
    calls: set[str] = set()
    for _ in range(_CANDIDATE_DRAWS):
        args = [ARG_KINDS[kind](rng, slots) for kind in spec.arg_kinds]
        call = f"{function}({', '.join(repr(a) for a in args)})"  # written before the call can change args
        if call in calls:
            continue
        calls.add(call)
        value = reference(*copy.deepcopy(args))
        by_value.setdefault(repr(value), []).append((call, value))
    # One draw per expected value in turn, so the tests cover as many different values as the draws allow.
    chosen: list[tuple[str, Any]] = []
    groups = list(by_value.values())
    while len(chosen) < num_tests + 1 and any(groups):
        for group in groups:
            if group and len(chosen) < num_tests + 1:
                chosen.append(group.pop(0))
    if len(chosen) < num_tests + 1:
        raise ValueError(f"{where}: only {len(chosen)} distinct inputs in {_CANDIDATE_DRAWS} draws, "
                         f"{num_tests + 1} needed; widen its argument kinds")  # fmt: skip
    example, tests = chosen[-1], tuple(chosen[:-1])
    if len({repr(v) for _, v in tests}) < 2:
        raise ValueError(f"{where}: every test expects {tests[0][1]!r}, so a constant function would pass; "
                         f"widen its argument kinds")  # fmt: skip
    problem = FunctionProblem(spec, slots, function, solution, example, tests)
    for i, code in enumerate(problem.test_code()):
        try:
            exec(compile(solution + "\n" + code, f"<{spec.name} test {i}>", "exec"), {})  # our own code only
        except Exception as e:
            raise ValueError(
                f"{where}: test {i} fails on the reference solution ({type(e).__name__}: {e}); the test was\n"
                f"{code}\nfix the template's solution or its argument kinds"
            ) from e
    return problem


def _compile(solution: str, function: str, where: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    try:
        exec(compile(solution, f"<{where}>", "exec"), namespace)  # trustbatch's own reference, never a model's
    except Exception as e:
        raise ValueError(f"{where}: the reference solution does not run ({type(e).__name__}: {e}):\n{solution}") from e
    if not callable(namespace.get(function)):
        raise ValueError(f"{where}: the reference solution does not define {function}():\n{solution}")
    return namespace[function]
