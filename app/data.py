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

Prompt length is checked once the tokenizer is known (`limit_prompt_lengths`, called by the run at start-up
with the token ids the rollout engines get): a prompt that leaves fewer than `rollout.max_new_tokens` positions
in the model's context stops the run there (`data.on_long_prompt=error`) or is dropped and counted (`drop`).

Built-in tasks are sources named `builtin:<task>` in `DataConfig`; `BUILTIN_TASKS` maps each name to its
generator and its config section. The only one so far is `arithmetic`: integer expressions such as `7+5*3-4=`.
"""

from __future__ import annotations

import hashlib
import json
import random
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


def load_prompts(path: str | Path) -> list[PromptRow]:
    """Read and validate every row of a .jsonl or .parquet file; raise DatasetError listing all bad rows."""
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
        problems = _row_problems(raw)
        if problems:
            errors += [f"{path}: {unit} {number}: field '{name}' {why}" for name, why in problems]
        else:
            rows.append(_to_row(raw, default_id=f"{path.name}:{number}", origin=f"{path}: {unit} {number}"))
    if errors:
        shown = errors[:_MAX_REPORTED_ERRORS]
        more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        raise DatasetError(f"{path}: {len(errors)} invalid field(s):\n  " + "\n  ".join(shown) + more)
    return rows


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


# ---------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class BuiltinTask:
    """A built-in synthetic task: its generator and the DataConfig field holding its config."""

    generate: Callable[[Any, Literal["train", "test"], int], list[PromptRow]]
    config_field: str


# A new built-in task: a config dataclass + a generator (cfg, split, n) -> rows, a DataConfig field, one entry here.
BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "arithmetic": BuiltinTask(generate=arithmetic_prompts, config_field="arithmetic"),
}


@dataclass
class DataConfig:
    """Where training and evaluation prompts come from."""

    train: str = "builtin:arithmetic"
    """Training prompts: a .jsonl / .parquet path or builtin:<task> (tasks: arithmetic)."""
    eval: str = "builtin:arithmetic"
    """Evaluation prompts: a .jsonl / .parquet path or builtin:<task>; builtin tasks use their test split."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """Settings of the builtin:arithmetic task."""
    num_train: int = 20000
    """How many prompts a builtin train source generates (files are used whole)."""
    num_eval: int = 500
    """How many prompts a builtin eval source generates (files are used whole)."""
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
        for key in ("num_train", "num_eval"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key}={getattr(self, key)} must be >= 1")


def load_split(cfg: DataConfig, split: Literal["train", "eval"]) -> list[PromptRow]:
    """Prompts of the train or eval source: a whole file, or a builtin task's train / test split."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be 'train' or 'eval'")
    source = cfg.train if split == "train" else cfg.eval
    if not source.startswith(BUILTIN_PREFIX):
        return load_prompts(source)
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
