"""Prompt rows: the row schema (`PromptRow`, `DatasetError`, row validation) and the .jsonl / .parquet loader.

Row schema (one JSON object per JSONL line, or one Parquet row; `null` / a missing Parquet value = absent):
- exactly one of `prompt` (a non-empty string) or `messages` (a non-empty list of `{role, content}` with role in
  system | user | assistant and string content; other keys of a message are kept as they are);
- at least one of `answer` (a string; a JSON number is accepted and kept as its text) or `tests` (a non-empty
  list, passed to the code verifier unchanged);
- `task` (optional): a non-empty string routing the row to a verifier. Default: "code" when `tests` is given,
  else "math";
- `id` (optional): a string or integer; default "<file name>:<row number>";
- `metadata` (optional): an object; every other key of the row is added to it, so nothing is lost;
- `completion` (optional): a string, the reply to learn for supervised fine-tuning (`trustbatch sft`). A chat
  whose last message is the assistant's gives it that way instead: the last message becomes `completion`, and
  the messages before it the prompt. RL and evaluation ignore it. For `trustbatch sft` (``purpose="sft"``) a
  completion is required and `answer`/`tests` are optional (they are needed only to verify held-out samples).
Every string of a row (keys included) must be valid Unicode text: a JSON escape of half a surrogate pair
(`"\\ud800"`) is rejected, since no tokenizer, log or MLflow store can take it.
A bad row raises `DatasetError` naming the file, the 1-based row number (the line number for JSONL), the field
and the fix; all bad rows of a file are reported together (the first 20 in the message).

GSM8K files (`data.format=gsm8k`): rows `{"question": str, "answer": str}` as the GSM8K release writes them, the
answer a worked solution ending in `#### <number>`. Each becomes a chat row (the word-problem system message
below and the question as the user turn) whose `answer` is that final number (thousands separators removed); the
solution text is kept in `metadata.solution`, other keys in `metadata`. A row without a final `#### <number>` is
an error like any other bad row.

HumanEval files (`data.format=humaneval`, .jsonl or .jsonl.gz): rows `{"task_id", "prompt", "entry_point",
"test"}` as OpenAI's HumanEval release writes them (`canonical_solution` and other keys are kept in `metadata`).
Each becomes a chat row asking for the complete function (HUMANEVAL_REQUEST: the signature and docstring in a
```python block) with one code test, the problem's `test` followed by `check(<entry_point>)`, task `code`. The
test carries a `prelude`: the prompt's text before `def <entry_point>` (its imports and helper functions), which
the code verifier runs before the model's program, as HumanEval's own harness runs the prompt before the
completion. A row missing a field, or whose prompt does not define the entry point, is an error naming the file,
the line, the field and the fix.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from app.sampling import describe

ROLES = ("system", "user", "assistant")
FILE_EXTENSIONS = (".jsonl", ".jsonl.gz", ".parquet")
_KNOWN_KEYS = ("prompt", "messages", "answer", "tests", "task", "id", "metadata", "completion")
_MAX_REPORTED_ERRORS = 20

WORD_PROBLEM_INSTRUCTION = (
    "Solve the math word problem. Reason briefly, step by step, then write the final answer as a single "
    "number in \\boxed{}, for example \\boxed{12}."
)
"""The system message of every builtin:word_problems row (and of every data.format=gsm8k row)."""
WORD_PROBLEM_TOOL_INSTRUCTION = (
    "Solve the math word problem with Python. Write a short program in a ```python block that prints the answer; "
    "you will see what it prints. Then write the final answer as a single number in \\boxed{}, for example "
    "\\boxed{12}."
)
"""The system message of builtin:word_problems rows with `solutions: tool` (the python tool, fenced calls)."""
HUMANEVAL_REQUEST = (
    "Complete the following Python function.\n\n```python\n{prompt}\n```\n\n"
    "Answer with the complete function in a ```python block."
)
"""The user message of a data.format=humaneval row; {prompt} is the problem's signature and docstring."""
MBPP_REQUEST = (
    "{prompt}\nYour code should pass this test:\n\n{test}\n\nAnswer with the function in a ```python block."
)
"""The user message of a data.format=mbpp row (the task, and its first test as the customary prompt shows it)."""


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
    completion: str | None = None
    """The reply supervised fine-tuning learns (a worked solution, the assistant's turn); None if the row has
    none. Sampling never sees it."""


Purpose = Literal["rl", "sft"]


def _row_problems(row: Any, purpose: Purpose = "rl") -> list[tuple[str, str]]:
    """(field, problem-and-fix) pairs for a raw row; empty when the row is valid for ``purpose``: RL and
    evaluation need a reference (answer or tests), SFT a completion (`completion`, or a last assistant turn)."""
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
    answer, tests, completion = row.get("answer"), row.get("tests"), row.get("completion")
    if completion is not None and (not isinstance(completion, str) or not completion.strip()):
        problems.append(("completion", f"must be a non-empty string, got {describe(completion)}"))
    last_is_assistant = (
        isinstance(messages, list) and bool(messages) and isinstance(messages[-1], dict)
        and messages[-1].get("role") == "assistant"
    )  # fmt: skip
    if completion is not None and last_is_assistant:
        problems.append(("completion", "is given and the messages also end with an assistant turn; keep one"))
    if last_is_assistant and len(messages) == 1:
        problems.append(("messages", "hold only an assistant turn; add the user turn it answers"))
    if purpose == "sft" and completion is None and not last_is_assistant:
        problems.append((
            "completion",
            'is missing: an SFT row needs the reply to learn; end "messages" with an {"role": "assistant", '
            '"content": ...} turn, or add "completion": "..." to a prompt row',
        ))  # fmt: skip
    if purpose == "rl" and answer is None and tests is None:
        problems.append(
            ("answer/tests", 'neither is given; add "answer": "..." (math) or "tests": [...] (code)')
        )
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        problems.append(("answer", f"must be a string (or a number), got {describe(answer)}"))
    if tests is not None and (not isinstance(tests, list) or not tests):
        problems.append(("tests", f"must be a non-empty list of test cases, got {describe(tests)}"))
    task = row.get("task")
    if task is not None and (not isinstance(task, str) or not task.strip()):
        problems.append(
            ("task", f'must be a non-empty string such as "math" or "code", got {describe(task)}')
        )
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

    if _all_ascii(row):  # nearly every row: no surrogate can hide in ASCII text, and no paths need building
        return found
    for key, value in row.items():
        walk(key, "row (a key)")
        walk(value, str(key))
    return found


def _all_ascii(value: Any) -> bool:
    """Every string in `value` (keys included) is ASCII."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                return False
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def _message_problems(messages: Any) -> list[tuple[str, str]]:
    if not isinstance(messages, list) or not messages:
        return [
            (
                "messages",
                f'must be a non-empty list of {{"role", "content"}} objects, got {describe(messages)}',
            )
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
    messages = [dict(m) for m in raw["messages"]] if raw.get("messages") is not None else None
    completion = raw.get("completion")
    if messages and messages[-1]["role"] == "assistant":  # the reply to learn; the prompt is what precedes it
        completion = messages.pop()["content"]
    return PromptRow(
        prompt=raw.get("prompt"),
        messages=messages,
        answer=None if answer is None else str(answer),
        tests=tests,
        task=raw.get("task") or ("code" if tests is not None else "math"),
        id=str(raw["id"]) if raw.get("id") is not None else default_id,
        metadata=metadata,
        origin=origin,
        completion=completion,
    )


# ---------------------------------------------------------------------------------------------- files


FORMATS = ("rows", "gsm8k", "humaneval", "mbpp")


def file_extension(path: str | Path) -> str | None:
    """The one of FILE_EXTENSIONS that `path` ends with (".jsonl.gz" before ".jsonl"), else None."""
    name = Path(path).name
    return next((ext for ext in sorted(FILE_EXTENSIONS, key=len, reverse=True) if name.endswith(ext)), None)


def load_prompts(path: str | Path, format: str = "rows", purpose: Purpose = "rl") -> list[PromptRow]:
    """Read and validate every row of a .jsonl(.gz) or .parquet file; raise DatasetError listing all bad rows.

    ``format``: "rows" (the row schema above), "gsm8k" (question / answer rows) or "humaneval" (HumanEval
    problems), see the module doc. ``purpose``: what the rows must hold, see `_row_problems`."""
    if format not in FORMATS:
        raise ValueError(f"data.format={format!r}: choose one of {list(FORMATS)}")
    path = Path(path)
    extension = file_extension(path)
    if extension is None:
        raise DatasetError(
            f"{path}: unsupported file extension {path.suffix!r}; use one of {list(FILE_EXTENSIONS)} "
            f"(or a built-in source such as 'builtin:arithmetic')"
        )
    if not path.is_file():
        raise DatasetError(
            f"{path}: no such file; check the path (relative paths are from the current directory)"
        )
    raw_rows = _read_parquet(path) if extension == ".parquet" else _read_jsonl(path)
    if not raw_rows:
        raise DatasetError(f"{path}: the file has no rows; add at least one prompt row")
    unit = "row" if extension == ".parquet" else "line"
    rows, errors = [], []
    for number, raw in raw_rows:
        if format == "gsm8k":
            raw, problems = _gsm8k_row(raw)
        elif format == "humaneval":
            raw, problems = _humaneval_row(raw)
        elif format == "mbpp":
            raw, problems = _mbpp_row(raw)
        else:
            problems = []
        problems = problems or _row_problems(raw, purpose)
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


_GSM8K_CALCULATION = re.compile(r"<<[^<>]*>>")


def gsm8k_completion(solution: str) -> str:
    """A GSM8K solution as a reply in the answer format: calculator annotations (``<<3*4=12>>``) removed and the
    final ``#### 42`` written ``\\boxed{42}``."""
    final = _GSM8K_FINAL.search(solution.strip())
    assert final is not None, "a validated GSM8K solution ends in #### <number>"
    steps = _GSM8K_CALCULATION.sub("", solution.strip()[: final.start()]).strip()
    boxed = f"\\boxed{{{final.group(1).replace(',', '')}}}"
    return f"{steps}\n{boxed}" if steps else boxed


def _gsm8k_row(raw: Any) -> tuple[Any, list[tuple[str, str]]]:
    """A GSM8K row -> (a row of the row schema, problems); the problems name GSM8K's own fields."""
    if not isinstance(raw, dict):
        return raw, [
            ("(row)", f'must be a JSON object {{"question": ..., "answer": ...}}, got {describe(raw)}')
        ]
    question, solution = raw.get("question"), raw.get("answer")
    problems = []
    if not isinstance(question, str) or not question.strip():
        problems.append(
            ("question", f"must be a non-empty string (data.format=gsm8k), got {describe(question)}")
        )
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
        "completion": gsm8k_completion(solution),
    }
    if raw.get("id") is not None:
        row["id"] = raw["id"]
    return row, []


def _humaneval_row(raw: Any) -> tuple[Any, list[tuple[str, str]]]:
    """A HumanEval problem -> (a row of the row schema, problems); the problems name HumanEval's own fields."""
    if not isinstance(raw, dict):
        return raw, [("(row)", f'must be a JSON object {{"task_id", "prompt", "entry_point", "test"}}, got '
                               f"{describe(raw)}")]  # fmt: skip
    problems = []
    for key in ("task_id", "prompt", "entry_point", "test"):
        value = raw.get(key)
        if not isinstance(value, str) or not value.strip():
            problems.append((key, f"must be a non-empty string (data.format=humaneval), got {describe(value)}; "
                                  f"HumanEval rows hold task_id, prompt, entry_point and test"))  # fmt: skip
    if problems:
        return raw, problems
    entry, prompt, test = raw["entry_point"].strip(), raw["prompt"], raw["test"]
    if not entry.isidentifier():
        return raw, [("entry_point", f"must be a Python function name, got {describe(entry)}")]
    definition = re.search(rf"^def {re.escape(entry)}\s*\(", prompt, re.MULTILINE)
    if definition is None:
        return raw, [("prompt", f"does not define the entry point: no line 'def {entry}(' in it; the prompt is "
                                f"the function's signature and docstring")]  # fmt: skip
    check = f"{test.rstrip()}\n\n\ncheck({entry})\n"
    prelude = prompt[: definition.start()]  # imports and helper functions the problem gives
    try:
        compile(check, "<test>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as err:
        return raw, [("test", f"does not compile with check({entry}) appended ({type(err).__name__}: {err})")]
    metadata = {k: v for k, v in raw.items() if k not in ("task_id", "prompt", "test", "metadata")}
    metadata.update(raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {})
    row = {
        "id": raw["task_id"],
        "messages": [{"role": "user", "content": HUMANEVAL_REQUEST.format(prompt=prompt.strip("\n"))}],
        "tests": [{"code": check, "prelude": prelude} if prelude.strip() else {"code": check}],
        "task": "code",
        "metadata": metadata,
    }
    return row, []


def _mbpp_row(raw: Any) -> tuple[Any, list[tuple[str, str]]]:
    """An MBPP problem ({"task_id", "prompt" or "text", "test_list", "test_imports"}, the sanitized or the full
    release) -> (a row of the row schema, problems): the task and its first test in the request, every test (with
    the imports) as one code test, task `code`."""
    if not isinstance(raw, dict):
        return raw, [("(row)", f'must be an object {{"task_id", "prompt", "test_list"}}, got {describe(raw)}')]
    prompt = raw.get("prompt", raw.get("text"))
    tests, imports = raw.get("test_list"), raw.get("test_imports") or []
    problems = []
    if not isinstance(prompt, str) or not prompt.strip():
        problems.append(("prompt", f"must be a non-empty string (data.format=mbpp: MBPP's prompt or text), got {describe(prompt)}"))
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        problems.append(("test_list", f"must be a non-empty list of assert statements (data.format=mbpp), got {describe(tests)}"))
    if not isinstance(imports, list) or not all(isinstance(t, str) for t in imports):
        problems.append(("test_imports", f"must be a list of import lines, got {describe(imports)}"))
    if problems:
        return raw, problems
    code = "\n".join([*imports, *tests]) + "\n"
    try:
        compile(code, "<test>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as err:
        return raw, [("test_list", f"does not compile ({type(err).__name__}: {err})")]
    metadata = {k: v for k, v in raw.items() if k not in ("prompt", "text", "test_list", "test_imports", "metadata")}
    row = {
        "messages": [{"role": "user", "content": MBPP_REQUEST.format(prompt=prompt.strip(), test=tests[0])}],
        "tests": [{"code": code}],
        "task": "code",
        "metadata": metadata,
    }
    if raw.get("task_id") is not None:
        row["id"] = f"mbpp/{raw['task_id']}"
    return row, []


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed value) for every non-blank line (of the decompressed text, for .jsonl.gz)."""
    rows = []
    opened = gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else path.open(encoding="utf-8")
    with opened as file:
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
        except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError; a cut-off file ends in EOFError
            raise DatasetError(f"{path}: not a complete gzip file ({err}); fetch or compress it again") from None
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
