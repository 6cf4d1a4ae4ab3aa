"""Prompt datasets: JSONL / Parquet files with a validated row schema, and built-in synthetic tasks.

Row schema (one JSON object per JSONL line, or one Parquet row; `null` / a missing Parquet value = absent):
- exactly one of `prompt` (a non-empty string) or `messages` (a non-empty list of `{role, content}` with role in
  system | user | assistant and string content; other keys of a message are kept as they are);
- at least one of `answer` (a string; a JSON number is accepted and kept as its text) or `tests` (a non-empty
  list, passed to the code verifier unchanged);
- `task` (optional): a non-empty string routing the row to a verifier. Default: "code" when `tests` is given,
  else "math";
- `id` (optional): a string or integer; default "<file name>:<row number>";
- `metadata` (optional): an object; every other key of the row is added to it, so nothing is lost.
Every string of a row (keys included) must be valid Unicode text: a JSON escape of half a surrogate pair
(`"\\ud800"`) is rejected, since no tokenizer, log or MLflow store can take it.
A bad row raises `DatasetError` naming the file, the 1-based row number (the line number for JSONL), the field
and the fix; all bad rows of a file are reported together (the first 20 in the message).

GSM8K files (`data.format=gsm8k`): rows `{"question": str, "answer": str}` as the GSM8K release writes them, the
answer a worked solution ending in `#### <number>`. Each becomes a chat row (the word-problem system message below
and the question as the user turn) whose `answer` is that final number (thousands separators removed); the
solution text is kept in `metadata.solution`, other keys in `metadata`. A row without a final `#### <number>` is
an error like any other bad row.

Prompt length is checked once the tokenizer is known (`limit_prompt_lengths`, called by the run at start-up
with the token ids the rollout engines get): a prompt that leaves fewer than `rollout.max_new_tokens` positions
in the model's context stops the run there (`data.on_long_prompt=error`) or is dropped and counted (`drop`).

Built-in tasks are sources named `builtin:<task>` in `DataConfig`; `BUILTIN_TASKS` maps each name to its
generator and its config section:
- `arithmetic`: integer expressions such as `7+5*3-4=` (plain prompts);
- `word_problems`: GSM8K-style multi-step word problems (shopping, travel, sharing, savings, recipes, ages,
  inventory...; 2-4 operations, integer answers, irrelevant distractor sentences) as chat rows: a system message
  asks for brief step-by-step reasoning and the final answer in `\\boxed{}`, which the `math` verifier judges.
Each assigns a problem to train or test by a hash of its canonical content (never by the seed), so the splits
never share one.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from app.sampling import describe

ROLES = ("system", "user", "assistant")
FILE_EXTENSIONS = (".jsonl", ".parquet")
BUILTIN_PREFIX = "builtin:"
_KNOWN_KEYS = ("prompt", "messages", "answer", "tests", "task", "id", "metadata")
_MAX_REPORTED_ERRORS = 20


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; the message names the file, the row, the field and the fix."""


@dataclass
class PromptRow:
    """One validated prompt: exactly one of prompt/messages, at least one of answer/tests."""

    prompt: str | None
    messages: list[dict] | None
    answer: str | None
    tests: list | None
    task: str
    id: str
    metadata: dict = field(default_factory=dict)
    origin: str = field(default="", compare=False)
    """Where the row came from, for messages: "<file>: line <n>" (JSONL), "<file>: row <n>" (Parquet)."""


# ---------------------------------------------------------------------------------------------- row schema


def _row_problems(row: Any) -> list[tuple[str, str]]:
    """(field, problem-and-fix) pairs for a raw row; empty when the row is valid."""
    if not isinstance(row, dict):
        return [("row", f"is a {type(row).__name__}, not an object; write one JSON object per line")]
    problems = []
    prompt, messages = row.get("prompt"), row.get("messages")
    if prompt is not None and messages is not None:
        problems.append(("prompt/messages", "both are given; keep exactly one of them"))
    elif prompt is None and messages is None:
        problems.append(("prompt/messages", 'neither is given; add "prompt": "..." or "messages": [...]'))
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        problems.append(("prompt", f"must be a non-empty string, got {describe(prompt)}"))
    if messages is not None:
        problems += _message_problems(messages)
    answer, tests = row.get("answer"), row.get("tests")
    if answer is None and tests is None:
        problems.append(
            ("answer/tests", 'neither is given; add "answer": "..." (math) or "tests": [...] (code)')
        )
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        problems.append(("answer", f"must be a string (or a number), got {describe(answer)}"))
    if tests is not None and (not isinstance(tests, list) or not tests):
        problems.append(("tests", f"must be a non-empty list of test cases, got {describe(tests)}"))
    task = row.get("task")
    if task is not None and (not isinstance(task, str) or not task.strip()):
        problems.append(("task", f'must be a non-empty string such as "math" or "code", got {describe(task)}'))
    row_id = row.get("id")
    if row_id is not None and (isinstance(row_id, bool) or not isinstance(row_id, (str, int))):
        problems.append(("id", f"must be a string or an integer, got {describe(row_id)}"))
    problems += _surrogate_problems(row)
    metadata = row.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            problems.append(("metadata", f"must be an object, got {describe(metadata)}"))
        else:
            clashes = sorted(k for k in row if k not in _KNOWN_KEYS and k in metadata)
            if clashes:
                problems.append(
                    ("metadata", f"keys {clashes} appear both in the row and in metadata; keep one")
                )
    return problems


def _surrogate_problems(row: dict) -> list[tuple[str, str]]:
    """A lone surrogate anywhere in the row: it is no Unicode character, so UTF-8 encoding (tokenizers, logs,
    MLflow) fails on it the first time the row is sampled."""
    found: list[tuple[str, str]] = []

    def walk(value: Any, where: str) -> None:
        if isinstance(value, str):
            if value.isascii():
                return
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                found.append(
                    (
                        where,
                        f"holds a lone surrogate {value[err.start]!r} at character {err.start}, half of a UTF-16 "
                        "pair and not a character; write the character itself (or a complete \\uXXXX\\uXXXX "
                        "pair), or remove it",
                    )
                )
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k, f"{where} (a key)")
                walk(v, f"{where}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")

    for key, value in row.items():
        walk(key, "row (a key)")
        walk(value, str(key))
    return found


def _message_problems(messages: Any) -> list[tuple[str, str]]:
    if not isinstance(messages, list) or not messages:
        return [
            ("messages", f'must be a non-empty list of {{"role", "content"}} objects, got {describe(messages)}')
        ]
    problems = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            problems.append(
                (where, f'must be an object {{"role": ..., "content": ...}}, got {describe(message)}')
            )
            continue
        if message.get("role") not in ROLES:
            problems.append(
                (f"{where}.role", f"must be one of {list(ROLES)}, got {describe(message.get('role'))}")
            )
        if not isinstance(message.get("content"), str):
            problems.append((f"{where}.content", f"must be a string, got {describe(message.get('content'))}"))
    return problems


def _to_row(raw: dict, default_id: str, origin: str = "") -> PromptRow:
    """Build a PromptRow from a raw row that `_row_problems` accepted."""
    answer, tests = raw.get("answer"), raw.get("tests")
    metadata = dict(raw.get("metadata") or {})
    metadata.update({k: v for k, v in raw.items() if k not in _KNOWN_KEYS})
    messages = raw.get("messages")
    return PromptRow(
        prompt=raw.get("prompt"),
        messages=[dict(m) for m in messages] if messages is not None else None,
        answer=None if answer is None else str(answer),
        tests=tests,
        task=raw.get("task") or ("code" if tests is not None else "math"),
        id=str(raw["id"]) if raw.get("id") is not None else default_id,
        metadata=metadata,
        origin=origin,
    )


# ---------------------------------------------------------------------------------------------- files


FORMATS = ("rows", "gsm8k")


def load_prompts(path: str | Path, format: str = "rows") -> list[PromptRow]:
    """Read and validate every row of a .jsonl or .parquet file; raise DatasetError listing all bad rows.

    ``format``: "rows" (the row schema of this module) or "gsm8k" (question / answer rows, see the module doc)."""
    if format not in FORMATS:
        raise ValueError(f"data.format={format!r}: choose one of {list(FORMATS)}")
    path = Path(path)
    if path.suffix not in FILE_EXTENSIONS:
        raise DatasetError(
            f"{path}: unsupported file extension {path.suffix!r}; use one of {list(FILE_EXTENSIONS)} "
            f"(or a built-in source such as 'builtin:arithmetic')"
        )
    if not path.is_file():
        raise DatasetError(
            f"{path}: no such file; check the path (relative paths are from the current directory)"
        )
    raw_rows = _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
    if not raw_rows:
        raise DatasetError(f"{path}: the file has no rows; add at least one prompt row")
    unit = "line" if path.suffix == ".jsonl" else "row"
    rows, errors = [], []
    for number, raw in raw_rows:
        if format == "gsm8k":
            raw, problems = _gsm8k_row(raw)
        else:
            problems = []
        problems = problems or _row_problems(raw)
        if problems:
            errors += [f"{path}: {unit} {number}: field '{name}' {why}" for name, why in problems]
        else:
            rows.append(_to_row(raw, default_id=f"{path.name}:{number}", origin=f"{path}: {unit} {number}"))
    if errors:
        shown = errors[:_MAX_REPORTED_ERRORS]
        more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        raise DatasetError(f"{path}: {len(errors)} invalid field(s):\n  " + "\n  ".join(shown) + more)
    return rows


_GSM8K_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*\Z")


def _gsm8k_row(raw: Any) -> tuple[Any, list[tuple[str, str]]]:
    """A GSM8K row -> (a row of this module's schema, problems); the problems name GSM8K's own fields."""
    if not isinstance(raw, dict):
        return raw, [("(row)", f'must be a JSON object {{"question": ..., "answer": ...}}, got {describe(raw)}')]
    question, solution = raw.get("question"), raw.get("answer")
    problems = []
    if not isinstance(question, str) or not question.strip():
        problems.append(("question", f"must be a non-empty string (data.format=gsm8k), got {describe(question)}"))
    final = _GSM8K_FINAL.search(solution.strip()) if isinstance(solution, str) else None
    if final is None:
        problems.append((
            "answer",
            f"must be a GSM8K solution ending in '#### <number>' (data.format=gsm8k), got {describe(solution)}",
        ))  # fmt: skip
    if problems:
        return raw, problems
    metadata = dict(raw.get("metadata") or {}) if isinstance(raw.get("metadata"), dict) else {}
    metadata.update({k: v for k, v in raw.items() if k not in ("question", "answer", "metadata", "id")})
    metadata["solution"] = solution
    row = {
        "messages": [
            {"role": "system", "content": WORD_PROBLEM_INSTRUCTION},
            {"role": "user", "content": question.strip()},
        ],
        "answer": final.group(1).replace(",", ""),
        "task": "math",
        "metadata": metadata,
    }
    if raw.get("id") is not None:
        row["id"] = raw["id"]
    return row, []


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed value) for every non-blank line."""
    rows = []
    with path.open(encoding="utf-8") as file:
        try:
            for number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((number, json.loads(line)))
                except json.JSONDecodeError as err:
                    raise DatasetError(
                        f"{path}: line {number}: invalid JSON ({err.msg} at column {err.colno}); each line must "
                        f"be one complete JSON object"
                    ) from None
        except UnicodeDecodeError as err:
            raise DatasetError(f"{path}: not valid UTF-8 ({err.reason}); save the file as UTF-8") from None
    return rows


def _read_parquet(path: Path) -> list[tuple[int, Any]]:
    """(1-based row number, row dict) for every row; null cells are dropped so they read as absent."""
    import pyarrow.parquet as pq  # imported here: only Parquet users pay for pyarrow

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError subclasses for unreadable files
        raise DatasetError(
            f"{path}: cannot read as Parquet ({err}); check that the file is a Parquet table"
        ) from err
    return [
        (number, {k: v for k, v in row.items() if v is not None})
        for number, row in enumerate(table.to_pylist(), start=1)
    ]


# ---------------------------------------------------------------------------------------------- arithmetic

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

    def __post_init__(self) -> None:
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


def split_of(expr: str) -> Literal["train", "test"]:
    """The split an expression belongs to: a stable hash of its text (SHA-256), 1 in TEST_FRACTION is test."""
    digest = hashlib.sha256(expr.encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_FRACTION == 0 else "train"


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
            )
        )
    return rows


def sft_text(row: PromptRow) -> str:
    """Completion text for warm-start supervised fine-tuning: the answer alone (the caller appends EOS)."""
    if row.answer is None:
        raise ValueError(
            f"row {row.id!r} has no answer, so it has no supervised completion; use rows with answers"
        )
    return row.answer


# ---------------------------------------------------------------------------------------------- word problems

WORD_PROBLEM_INSTRUCTION = (
    "Solve the math word problem. Reason briefly, step by step, then write the final answer as a single "
    "number in \\boxed{}, for example \\boxed{12}."
)
"""The system message of every builtin:word_problems row."""

_NAMES = (
    "Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gabe", "Hana", "Ivan", "Jade",
    "Kofi", "Lena", "Mateo", "Nina", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara",
)  # fmt: skip

Numbers = dict[str, int]


@dataclass(frozen=True)
class WordProblemTemplate:
    """A family of word problems: the numbers that decide the answer, how they are worded, irrelevant facts.

    A problem's canonical content is the template name and its `numbers` (those the text states and the answer
    depends on); the train/test split is a hash of it. Numbers that play the same role (two purchases, two legs
    of a trip) are generated in increasing order and worded in either order, so a problem and its mirror image
    are one problem.
    """

    name: str
    ops: int
    """Arithmetic operations from the stated numbers to the answer."""
    ranges: dict[str, range]
    """Free parameters; every combination that `valid` accepts is one problem."""
    numbers: Callable[[Numbers], Numbers]
    """Parameters -> the numbers the problem states (derived ones, such as a total, keep answers integral)."""
    solve: Callable[[Numbers], int]
    """The stated numbers -> the answer, computed as a reader would."""
    render: Callable[[random.Random, Numbers], tuple[list[str], str, dict[str, str]]]
    """(rng, stated numbers) -> (story sentences, question, words for the distractors' blanks)."""
    distractors: tuple[str, ...]
    """Facts irrelevant to the answer, each with one number `{n}` and blanks from the rendered words."""
    valid: Callable[[Numbers], bool] = lambda p: True
    """Which parameter combinations make a sensible problem (a positive answer, exact divisions)."""


def _pick(rng: random.Random, options: tuple, k: int = 1) -> Any:
    return options[rng.randrange(len(options))] if k == 1 else tuple(rng.sample(options, k))


def _either_order(rng: random.Random, first: Any, second: Any) -> tuple[Any, Any]:
    return (first, second) if rng.random() < 0.5 else (second, first)


def _hours(t: int) -> str:
    return f"{t} hour" if t == 1 else f"{t} hours"


def _years(t: int) -> str:
    return f"{t} year" if t == 1 else f"{t} years"


def _same(p: Numbers) -> Numbers:
    return dict(p)


_GOODS = (
    "notebooks", "pens", "apples", "sandwiches", "candles", "toy cars", "bags of rice", "T-shirts",
)  # fmt: skip
_SHOPPING_DISTRACTORS = (
    "The shop is {n} minutes from {name}'s home.",
    "{name} has {n} cousins.",
    "The store opened {n} years ago.",
    "There are {n} people waiting at the checkout.",
)


def _render_unit_price(rng: random.Random, p: Numbers):
    name = _pick(rng, _NAMES)
    packs = _pick(rng, ("packs of stickers", "boxes of tea", "bottles of juice", "rolls of tape"))
    story = [f"At a market, {p['n']} {packs} cost ${p['total']} in total."]
    return story, f"At the same price, how many dollars does {name} pay for {p['m']} {packs}?", {"name": name}


def _render_shopping(rng: random.Random, p: Numbers, change: bool = False):
    name = _pick(rng, _NAMES)
    first, second = _pick(rng, _GOODS, 2)
    (a, x), (b, y) = _either_order(rng, (p["a"], p["p"]), (p["b"], p["q"]))
    story = [f"{name} buys {a} {first} for ${x} each and {b} {second} for ${y} each."]
    if not change:
        return story, f"How many dollars does {name} spend in total?", {"name": name}
    story.append(f"{name} pays with ${p['paid']}.")
    return story, f"How many dollars of change does {name} get back?", {"name": name}


_TRAVEL_DISTRACTORS = (
    "The {vehicle} carries {n} passengers.",
    "The driver has {n} songs on a playlist.",
    "The {vehicle} has {n} seats by the windows.",
    "The ticket office has {n} posters on its walls.",
)


def _render_travel(rng: random.Random, p: Numbers):
    vehicle = _pick(rng, ("train", "bus", "truck", "ferry"))
    (v, t1), (w, t2) = _either_order(rng, (p["v"], p["t1"]), (p["w"], p["t2"]))
    story = [
        f"A {vehicle} travels at {v} km per hour for {_hours(t1)}, then at {w} km per hour for {_hours(t2)}."
    ]
    return story, f"How many kilometres does the {vehicle} travel in all?", {"vehicle": vehicle}


def _render_travel_remaining(rng: random.Random, p: Numbers):
    name = _pick(rng, _NAMES)
    (v, t1), (w, t2) = _either_order(rng, (p["v"], p["t1"]), (p["w"], p["t2"]))
    story = [
        f"{name} is driving to a city {p['distance']} km away.",
        f"{name} drives at {v} km per hour for {_hours(t1)}, then at {w} km per hour for {_hours(t2)}.",
    ]
    return story, f"How many kilometres does {name} still have to drive?", {"vehicle": "car"}


_SHARING_DISTRACTORS = (
    "{name} owns {n} recipe cards.",
    "{name} has lived on the same street for {n} years.",
    "Each tray is {n} centimetres wide.",
    "{name}'s kitchen has {n} drawers.",
)


def _render_sharing(rng: random.Random, p: Numbers):
    name = _pick(rng, _NAMES)
    food = _pick(rng, ("muffins", "cookies", "buns", "brownies"))
    story = [
        f"{name} bakes {p['trays']} trays of {food} with {p['per_tray']} {food} on each tray.",
        f"{name} keeps {p['kept']} {food} and shares the rest equally among {p['friends']} friends.",
    ]
    return story, f"How many {food} does each friend get?", {"name": name}


_SAVINGS_DISTRACTORS = (
    "{name}'s best friend is {n} years old.",
    "{name} walks {n} minutes to school.",
    "The piggy bank weighs {n}0 grams.",
    "{name} reads {n} pages every evening.",
)


def _render_savings(rng: random.Random, p: Numbers):
    name = _pick(rng, _NAMES)
    item = _pick(rng, ("book", "kite", "board game", "scarf"))
    story = [
        f"{name} has ${p['start']} in a piggy bank.",
        f"Every week {name} saves ${p['weekly']} more.",
        f"After {p['weeks']} weeks, {name} spends ${p['spent']} on a {item}.",
    ]
    return story, f"How many dollars does {name} have left?", {"name": name}


def _render_savings_goal(rng: random.Random, p: Numbers):
    name = _pick(rng, _NAMES)
    item = _pick(rng, ("bicycle", "guitar", "tent", "telescope"))
    story = [
        f"{name} wants a {item} that costs ${p['price']}.",
        f"{name} already has ${p['start']} and gets ${p['gift']} as a birthday gift.",
        f"{name} saves ${p['weekly']} every week.",
    ]
    return story, f"How many weeks of saving does {name} need to have exactly enough?", {"name": name}


_RECIPE_DISTRACTORS = (
    "The dish bakes for {n} minutes.",
    "{name} bought {n} eggs last week.",
    "The recipe book has {n} pages.",
    "{name}'s kitchen has {n} spoons.",
)


def _render_recipe(rng: random.Random, p: Numbers):
    name = _pick(rng, _NAMES)
    ingredient = _pick(rng, ("flour", "sugar", "butter", "rice"))
    story = [
        f"A recipe for {p['serves']} people uses {p['grams']} grams of {ingredient}.",
        f"{name} wants to make it for {p['guests']} people and already has {p['has']} grams of {ingredient}.",
    ]
    return story, f"How many more grams of {ingredient} does {name} need?", {"name": name}


_AGES_DISTRACTORS = (
    "{name} has {n} marbles.",
    "{other} lives {n} km away.",
    "The family dog weighs {n} kg.",
    "{other} has {n} houseplants.",
)


def _render_ages(rng: random.Random, p: Numbers):
    child, cousin, neighbour = _pick(rng, _NAMES, 3)
    story = [
        f"{child} is {p['age']} years old.",
        f"{child}'s cousin {cousin} is {_years(p['older'])} older.",
        f"Their neighbour {neighbour} is {p['times']} times as old as {cousin}.",
    ]
    return story, f"How old will {neighbour} be in {_years(p['later'])}?", {"name": child, "other": neighbour}


_INVENTORY_DISTRACTORS = (
    "The shop has {n} employees.",
    "The shop is open {n} hours on Sundays.",
    "Each box of {goods} is {n} cm long.",
    "The delivery truck drove {n} km.",
)


def _render_inventory(rng: random.Random, p: Numbers):
    goods = _pick(rng, ("pencils", "lemons", "batteries", "soaps"))
    first, second = _either_order(rng, p["sold1"], p["sold2"])
    story = [
        f"A shop has {p['boxes']} boxes of {goods} with {p['per_box']} {goods} in each box.",
        f"It sells {first} {goods} on Monday and {second} {goods} on Tuesday.",
        f"Then a delivery brings {p['delivered']} more {goods}.",
    ]
    return story, f"How many {goods} does the shop have now?", {"goods": goods}


_WORK_DISTRACTORS = (
    "The {machine} has {n} buttons.",
    "The factory has {n} windows.",
    "The {machine} weighs {n}0 kg.",
    "The workers take a break of {n} minutes.",
)


def _render_work_rate(rng: random.Random, p: Numbers):
    machine, product = _pick(rng, (("machine", "toys"), ("printer", "posters"), ("bakery oven", "loaves")))
    story = [
        f"A {machine} makes {p['rate']} {product} per hour.",
        f"It runs for {_hours(p['hours'])} each day.",
    ]
    return story, f"How many {product} does the {machine} make in {p['days']} days?", {"machine": machine}


def _cost(p: Numbers) -> int:
    return p["a"] * p["p"] + p["b"] * p["q"]


def _driven(p: Numbers) -> int:
    return p["v"] * p["t1"] + p["w"] * p["t2"]


WORD_PROBLEM_TEMPLATES: dict[str, WordProblemTemplate] = {
    t.name: t
    for t in (
        WordProblemTemplate(
            "unit_price", 2, {"n": range(2, 11), "unit": range(2, 26), "m": range(2, 16)},
            numbers=lambda p: {"n": p["n"], "total": p["n"] * p["unit"], "m": p["m"]},
            solve=lambda s: s["total"] // s["n"] * s["m"],
            render=_render_unit_price, distractors=_SHOPPING_DISTRACTORS, valid=lambda p: p["m"] != p["n"],
        ),
        WordProblemTemplate(
            "work_rate", 2, {"rate": range(3, 61), "hours": range(2, 11), "days": range(2, 8)},
            numbers=_same, solve=lambda s: s["rate"] * s["hours"] * s["days"],
            render=_render_work_rate, distractors=_WORK_DISTRACTORS,
        ),
        WordProblemTemplate(
            "shopping", 3, {"a": range(2, 10), "p": range(2, 16), "b": range(2, 10), "q": range(2, 16)},
            numbers=_same, solve=_cost, render=_render_shopping, distractors=_SHOPPING_DISTRACTORS,
            valid=lambda p: (p["a"], p["p"]) < (p["b"], p["q"]),
        ),
        WordProblemTemplate(
            "shopping_change", 4,
            {"a": range(2, 7), "p": range(2, 13), "b": range(2, 7), "q": range(2, 13), "paid": range(20, 101, 10)},
            numbers=_same, solve=lambda s: s["paid"] - _cost(s),
            render=lambda rng, p: _render_shopping(rng, p, change=True), distractors=_SHOPPING_DISTRACTORS,
            valid=lambda p: (p["a"], p["p"]) < (p["b"], p["q"]) and _cost(p) < p["paid"],
        ),
        WordProblemTemplate(
            "travel", 3, {"v": range(30, 91, 5), "t1": range(1, 7), "w": range(30, 91, 5), "t2": range(1, 7)},
            numbers=_same, solve=_driven, render=_render_travel, distractors=_TRAVEL_DISTRACTORS,
            valid=lambda p: p["v"] < p["w"],
        ),
        WordProblemTemplate(
            "travel_remaining", 4,
            {
                "v": range(40, 81, 10), "t1": range(1, 6), "w": range(40, 81, 10), "t2": range(1, 6),
                "left": range(15, 196, 15),
            },
            numbers=lambda p: {"distance": _driven(p) + p["left"], **{k: p[k] for k in ("v", "t1", "w", "t2")}},
            solve=lambda s: s["distance"] - _driven(s),
            render=_render_travel_remaining, distractors=_TRAVEL_DISTRACTORS, valid=lambda p: p["v"] < p["w"],
        ),
        WordProblemTemplate(
            "sharing", 3,
            {"trays": range(2, 10), "per_tray": range(4, 16), "kept": range(1, 21), "friends": range(2, 10)},
            numbers=_same, solve=lambda s: (s["trays"] * s["per_tray"] - s["kept"]) // s["friends"],
            render=_render_sharing, distractors=_SHARING_DISTRACTORS,
            valid=lambda p: (
                p["trays"] * p["per_tray"] > p["kept"] and (p["trays"] * p["per_tray"] - p["kept"]) % p["friends"] == 0
            ),
        ),
        WordProblemTemplate(
            "savings", 3,
            {"start": range(10, 101, 10), "weekly": range(3, 21), "weeks": range(2, 13), "spent": range(10, 81, 10)},
            numbers=_same, solve=lambda s: s["start"] + s["weekly"] * s["weeks"] - s["spent"],
            render=_render_savings, distractors=_SAVINGS_DISTRACTORS,
            valid=lambda p: p["start"] + p["weekly"] * p["weeks"] > p["spent"],
        ),
        WordProblemTemplate(
            "savings_goal", 3,
            {"start": range(5, 51, 5), "gift": range(5, 41, 5), "weekly": range(2, 16), "weeks": range(2, 13)},
            numbers=lambda p: {
                "price": p["start"] + p["gift"] + p["weekly"] * p["weeks"],
                **{k: p[k] for k in ("start", "gift", "weekly")},
            },
            solve=lambda s: (s["price"] - s["start"] - s["gift"]) // s["weekly"],
            render=_render_savings_goal, distractors=_SAVINGS_DISTRACTORS,
        ),
        WordProblemTemplate(
            "recipe", 3,
            {"serves": range(2, 7), "per_person": range(10, 61, 5), "guests": range(2, 13), "has": range(10, 201, 10)},
            numbers=lambda p: {
                "serves": p["serves"], "grams": p["serves"] * p["per_person"], "guests": p["guests"], "has": p["has"],
            },
            solve=lambda s: s["grams"] // s["serves"] * s["guests"] - s["has"],
            render=_render_recipe, distractors=_RECIPE_DISTRACTORS,
            valid=lambda p: p["guests"] != p["serves"] and p["per_person"] * p["guests"] > p["has"],
        ),
        WordProblemTemplate(
            "ages", 3, {"age": range(3, 17), "older": range(1, 10), "times": range(2, 6), "later": range(1, 21)},
            numbers=_same, solve=lambda s: s["times"] * (s["age"] + s["older"]) + s["later"],
            render=_render_ages, distractors=_AGES_DISTRACTORS,
            valid=lambda p: 20 <= p["times"] * (p["age"] + p["older"]) <= 80,
        ),
        WordProblemTemplate(
            "inventory", 4,
            {
                "boxes": range(3, 13), "per_box": range(6, 25, 2), "sold1": range(4, 37, 4), "sold2": range(4, 37, 4),
                "delivered": range(10, 51, 10),
            },
            numbers=_same, solve=lambda s: s["boxes"] * s["per_box"] - s["sold1"] - s["sold2"] + s["delivered"],
            render=_render_inventory, distractors=_INVENTORY_DISTRACTORS,
            valid=lambda p: p["sold1"] < p["sold2"] and p["boxes"] * p["per_box"] > p["sold1"] + p["sold2"],
        ),
    )
}  # fmt: skip
"""Every builtin:word_problems template by name."""

_MAX_DISTRACTORS = min(len(t.distractors) for t in WORD_PROBLEM_TEMPLATES.values())


@dataclass
class WordProblemsConfig:
    """Built-in task: multi-step arithmetic word problems in chat form (GSM8K style), answered in \\boxed{}."""

    templates: list[str] = field(default_factory=list)
    """Templates to draw from; empty = all: unit_price, work_rate (2 operations), shopping, travel, sharing,
    savings, savings_goal, recipe, ages (3), shopping_change, travel_remaining, inventory (4)."""
    min_ops: int = 2
    """Only templates with at least this many operations (2-4)."""
    max_ops: int = 4
    """Only templates with at most this many operations (2-4)."""
    min_distractors: int = 1
    """Fewest irrelevant sentences (each with a number) in a problem."""
    max_distractors: int = 2
    """Most irrelevant sentences in a problem (at most 4); each problem draws its count in [min, max]."""
    seed: int = 0
    """Seed of the generator (which problems, their wording and distractors); the train/test assignment is a hash
    of each problem's template and numbers, so the splits never share a problem whatever the seed."""

    def __post_init__(self) -> None:
        known = list(WORD_PROBLEM_TEMPLATES)
        bad = [t for t in self.templates if t not in WORD_PROBLEM_TEMPLATES]
        if bad or len(set(self.templates)) != len(self.templates):
            raise ValueError(
                f"data.word_problems.templates={list(self.templates)!r} must list distinct template names from "
                f"{known} (empty = all)" + (f"; unknown: {bad}" if bad else "")
            )
        for key in ("min_ops", "max_ops"):
            if not 2 <= getattr(self, key) <= 4:
                raise ValueError(
                    f"data.word_problems.{key}={getattr(self, key)} must be between 2 and 4 (the templates "
                    f"have 2 to 4 operations)"
                )
        if self.max_ops < self.min_ops:
            raise ValueError(
                f"data.word_problems.max_ops={self.max_ops} is below data.word_problems.min_ops={self.min_ops}; "
                f"set max_ops >= min_ops"
            )
        if self.min_distractors < 0:
            raise ValueError(f"data.word_problems.min_distractors={self.min_distractors} must be >= 0")
        if not self.min_distractors <= self.max_distractors <= _MAX_DISTRACTORS:
            raise ValueError(
                f"data.word_problems.max_distractors={self.max_distractors} must be between "
                f"data.word_problems.min_distractors={self.min_distractors} and {_MAX_DISTRACTORS}"
            )
        if not self.chosen():
            raise ValueError(
                f"no template of data.word_problems.templates={list(self.templates) or known} has "
                f"data.word_problems.min_ops={self.min_ops} to max_ops={self.max_ops} operations: widen the "
                f"range or add templates"
            )

    def chosen(self) -> list[WordProblemTemplate]:
        """The templates this config draws from, in WORD_PROBLEM_TEMPLATES order."""
        names = self.templates or list(WORD_PROBLEM_TEMPLATES)
        return [
            t
            for t in WORD_PROBLEM_TEMPLATES.values()
            if t.name in names and self.min_ops <= t.ops <= self.max_ops
        ]


def word_problem_key(template: str, numbers: Numbers) -> str:
    """A problem's canonical content, e.g. `shopping:a=2,p=3,b=4,q=5`: what the train/test split hashes."""
    return f"{template}:" + ",".join(f"{k}={v}" for k, v in numbers.items())


@functools.cache
def _word_problem_pool(
    template: str, split: Literal["train", "test"]
) -> tuple[tuple[tuple[str, int], ...], ...]:
    """The stated numbers of every problem of `template` in `split`, in enumeration order (seed-independent)."""
    spec = WORD_PROBLEM_TEMPLATES[template]
    pool = []
    for values in itertools.product(*spec.ranges.values()):
        params = dict(zip(spec.ranges, values, strict=True))
        if spec.valid(params):
            numbers = spec.numbers(params)
            if split_of(word_problem_key(template, numbers)) == split:
                pool.append(tuple(numbers.items()))
    return tuple(pool)


def word_problem_prompts(cfg: WordProblemsConfig, split: Literal["train", "test"], n: int) -> list[PromptRow]:
    """`n` distinct word problems of `split` as chat rows, deterministic from `cfg.seed`.

    Each row is a system message (WORD_PROBLEM_INSTRUCTION) and a user message with the problem; the answer is
    the integer as a string, the task `math`. Each problem draws its template uniformly among those with
    problems left, then one of that template's problems not yet drawn. A longer request extends a shorter one
    (the first n rows never depend on n). Raises ValueError when the split has fewer than n problems.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} must be 'train' or 'test'")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    templates = cfg.chosen()
    pools = [_word_problem_pool(t.name, split) for t in templates]
    if n > sum(len(pool) for pool in pools):
        both = sum(len(_word_problem_pool(t.name, s)) for t in templates for s in ("train", "test"))
        raise ValueError(
            f"{n} word problems requested but the {split} split has only {sum(len(p) for p in pools)} distinct "
            f"problems ({both} in both splits) of templates {[t.name for t in templates]} with "
            f"{cfg.min_ops} to {cfg.max_ops} operations; add data.word_problems.templates (empty = all) or widen "
            f"data.word_problems.min_ops / max_ops, or lower data.num_train / data.num_eval"
        )
    rng = random.Random(f"word_problems:{cfg.seed}:{split}")
    taken = [0] * len(pools)
    moved: list[dict[int, int]] = [{} for _ in pools]  # a lazy Fisher-Yates shuffle of each pool
    open_templates = [i for i, pool in enumerate(pools) if pool]
    rows: list[PromptRow] = []
    while len(rows) < n:
        i = rng.choice(open_templates)
        k, size = taken[i], len(pools[i])
        j = rng.randrange(k, size)
        index = moved[i].get(j, j)
        moved[i][j] = moved[i].get(k, k)
        taken[i] = k + 1
        if taken[i] == size:
            open_templates.remove(i)
        row_id = f"word_problems-{split}-{len(rows)}"
        rows.append(_word_problem_row(templates[i], dict(pools[i][index]), cfg, rng, row_id))
    return rows


def _word_problem_row(
    spec: WordProblemTemplate, numbers: Numbers, cfg: WordProblemsConfig, rng: random.Random, row_id: str
) -> PromptRow:
    story, question, words = spec.render(rng, numbers)
    count = rng.randint(cfg.min_distractors, cfg.max_distractors)
    for sentence in rng.sample(spec.distractors, count):  # after the first sentence, before the question
        story.insert(rng.randint(1, len(story)), sentence.format(n=rng.randint(2, 40), **words))
    return PromptRow(
        prompt=None,
        messages=[
            {"role": "system", "content": WORD_PROBLEM_INSTRUCTION},
            {"role": "user", "content": " ".join([*story, question])},
        ],
        answer=str(spec.solve(numbers)),
        tests=None,
        task="math",
        id=row_id,
        metadata={
            "source": "builtin:word_problems",
            "template": spec.name,
            "num_ops": spec.ops,
            "distractors": count,
            "numbers": numbers,
        },
    )


# ---------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class BuiltinTask:
    """A built-in synthetic task: its generator and the DataConfig field holding its config."""

    generate: Callable[[Any, Literal["train", "test"], int], list[PromptRow]]
    config_field: str


# A new built-in task: a config dataclass + a generator (cfg, split, n) -> rows, a DataConfig field, one entry here.
BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "arithmetic": BuiltinTask(generate=arithmetic_prompts, config_field="arithmetic"),
    "word_problems": BuiltinTask(generate=word_problem_prompts, config_field="word_problems"),
}


@dataclass
class DataConfig:
    """Where training and evaluation prompts come from."""

    train: str = "builtin:arithmetic"
    """Training prompts: a .jsonl / .parquet path or builtin:<task> (tasks: arithmetic, word_problems)."""
    eval: str = "builtin:arithmetic"
    """Evaluation prompts: a .jsonl / .parquet path or builtin:<task>; builtin tasks use their test split."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """Settings of the builtin:arithmetic task."""
    word_problems: WordProblemsConfig = field(default_factory=WordProblemsConfig)
    """Settings of the builtin:word_problems task."""
    num_train: int = 20000
    """How many prompts a builtin train source generates (files are used whole)."""
    num_eval: int = 500
    """How many prompts a builtin eval source generates (files are used whole)."""
    format: Literal["rows", "gsm8k"] = "rows"
    """Schema of data.train / data.eval files: rows (this module's row schema) or gsm8k (GSM8K's
    {"question", "answer": "... #### 42"} rows, posed as chat word problems with a \\boxed{} instruction)."""
    on_long_prompt: Literal["error", "drop"] = "error"
    """A prompt whose tokens (as the rollout engines get them: the chat template applied to `messages` rows)
    leave fewer than rollout.max_new_tokens positions in the model's context (max_position_embeddings).
    error: stop at start-up, naming the file and rows; drop: skip such rows of data.train and data.eval, logged
    with their count (MLflow metrics data/dropped_long_prompts/train and .../eval)."""

    def __post_init__(self) -> None:
        for key in ("train", "eval"):
            source = getattr(self, key)
            if source.startswith(BUILTIN_PREFIX):
                name = source[len(BUILTIN_PREFIX) :]
                if name not in BUILTIN_TASKS:
                    raise ValueError(
                        f"data.{key}={source!r}: unknown built-in task {name!r}; choose one of "
                        f"{[BUILTIN_PREFIX + t for t in BUILTIN_TASKS]} or give a .jsonl / .parquet path"
                    )
            elif Path(source).suffix not in FILE_EXTENSIONS:
                raise ValueError(
                    f"data.{key}={source!r} is neither builtin:<task> nor a path ending in "
                    f"{' / '.join(FILE_EXTENSIONS)}; e.g. data.{key}=builtin:arithmetic or data.{key}=prompts.jsonl"
                )
        if self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r}: choose one of {list(FORMATS)}")
        for key in ("num_train", "num_eval"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key}={getattr(self, key)} must be >= 1")


def load_split(cfg: DataConfig, split: Literal["train", "eval"]) -> list[PromptRow]:
    """Prompts of the train or eval source: a whole file, or a builtin task's train / test split."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be 'train' or 'eval'")
    source = cfg.train if split == "train" else cfg.eval
    if not source.startswith(BUILTIN_PREFIX):
        return load_prompts(source, cfg.format)
    task = BUILTIN_TASKS[source[len(BUILTIN_PREFIX) :]]
    task_cfg = getattr(cfg, task.config_field)
    if split == "train":
        return task.generate(task_cfg, "train", cfg.num_train)
    return task.generate(task_cfg, "test", cfg.num_eval)


def limit_prompt_lengths(
    rows: list[PromptRow],
    ids: list[list[int]],
    *,
    max_prompt_tokens: int,
    on_long_prompt: Literal["error", "drop"],
    source_key: str,
    source: str,
    why: str,
) -> tuple[list[PromptRow], list[list[int]], int]:
    """Keep the rows whose prompt has at most `max_prompt_tokens` tokens; `(rows, ids, dropped)`.

    `ids[i]` are the token ids of `rows[i]` as the rollout engines get them. With `on_long_prompt="error"` any
    longer prompt raises DatasetError naming each such row (the first 20), `why` (where the limit comes from) and
    the fixes; with `"drop"` they are left out and counted (the caller decides whether none left is an error).
    """
    long = [i for i, prompt in enumerate(ids) if len(prompt) > max_prompt_tokens]
    if not long:
        return rows, ids, 0
    if on_long_prompt == "error":
        shown = [
            f"{rows[i].origin or f'row id {rows[i].id!r}'}: prompt has {len(ids[i])} tokens"
            for i in long[:_MAX_REPORTED_ERRORS]
        ]
        more = f"\n  ... and {len(long) - len(shown)} more" if len(long) > len(shown) else ""
        raise DatasetError(
            f"{source_key}={source!r}: {len(long)} prompt(s) longer than {max_prompt_tokens} tokens ({why}):\n  "
            + "\n  ".join(shown)
            + more
            + "\nshorten or remove these rows, set data.on_long_prompt=drop to skip them, or lower rollout.max_new_tokens"
        )
    keep = sorted(set(range(len(rows))) - set(long))
    return [rows[i] for i in keep], [ids[i] for i in keep], len(long)
