"""Where prompts come from: `DataConfig` (data.train / data.eval: a file or `builtin:<task>`), the registry of
built-in tasks (`BUILTIN_TASKS`) and `load_split`.

Built-in tasks are sources named `builtin:<task>` in `DataConfig`; `BUILTIN_TASKS` maps each name to its
generator and its config section (the tasks themselves are in app/data/tasks/). Each assigns a problem to train
or test by a hash of its canonical content (never by the seed), so the splits never share one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from app.data.rows import (
    FILE_EXTENSIONS,
    FORMATS,
    DatasetError,
    PromptRow,
    Purpose,
    file_extension,
    load_prompts,
)
from app.data.tasks import (
    ArithmeticConfig,
    PythonFunctionsConfig,
    WordProblemsConfig,
    arithmetic_prompts,
    python_function_prompts,
    word_problem_prompts,
)

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class BuiltinTask:
    """A built-in synthetic task: its generator and the DataConfig field holding its config."""

    generate: Callable[[Any, Literal["train", "test"], int], list[PromptRow]]
    config_field: str


# A new built-in task: a config dataclass + a generator (cfg, split, n) -> rows, a DataConfig field, one entry here.
BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "arithmetic": BuiltinTask(generate=arithmetic_prompts, config_field="arithmetic"),
    "word_problems": BuiltinTask(generate=word_problem_prompts, config_field="word_problems"),
    "python_functions": BuiltinTask(generate=python_function_prompts, config_field="python_functions"),
}


@dataclass
class DataConfig:
    """Where training and evaluation prompts come from."""

    train: str = "builtin:arithmetic"
    """Training prompts: a .jsonl / .jsonl.gz / .parquet path or builtin:<task> (tasks: arithmetic, word_problems,
    python_functions)."""
    eval: str = "builtin:arithmetic"
    """Evaluation prompts: a .jsonl / .jsonl.gz / .parquet path or builtin:<task>; builtin tasks use their test split."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """Settings of the builtin:arithmetic task."""
    word_problems: WordProblemsConfig = field(default_factory=WordProblemsConfig)
    """Settings of the builtin:word_problems task."""
    python_functions: PythonFunctionsConfig = field(default_factory=PythonFunctionsConfig)
    """Settings of the builtin:python_functions task (code: rows with assert tests for the `code` verifier)."""
    num_train: int = 20000
    """How many prompts a builtin train source generates (files are used whole)."""
    num_eval: int = 500
    """How many prompts a builtin eval source generates (files are used whole)."""
    format: Literal["rows", "gsm8k", "humaneval"] = "rows"
    """Schema of data.train / data.eval files: rows (the row schema of app/data/rows.py), gsm8k (GSM8K's
    {"question", "answer": "... #### 42"} rows, posed as chat word problems with a \\boxed{} instruction) or
    humaneval (HumanEval's {"task_id", "prompt", "entry_point", "test"} rows, .jsonl or .jsonl.gz: the function
    asked for in a chat request, graded by the code verifier with the problem's check())."""
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
            elif file_extension(source) is None:
                raise ValueError(
                    f"data.{key}={source!r} is neither builtin:<task> nor a path ending in "
                    f"{' / '.join(FILE_EXTENSIONS)}; e.g. data.{key}=builtin:arithmetic or data.{key}=prompts.jsonl"
                )
        if self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r}: choose one of {list(FORMATS)}")
        for key in ("num_train", "num_eval"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key}={getattr(self, key)} must be >= 1")


def load_split(cfg: DataConfig, split: Literal["train", "eval"], purpose: Purpose = "rl") -> list[PromptRow]:
    """Prompts of the train or eval source: a whole file, or a builtin task's train / test split. ``purpose``:
    "rl" rows need an answer or tests, "sft" rows a completion (built-in rows have both)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be 'train' or 'eval'")
    source = cfg.train if split == "train" else cfg.eval
    if not source.startswith(BUILTIN_PREFIX):
        return load_prompts(source, cfg.format, purpose)
    task = BUILTIN_TASKS[source[len(BUILTIN_PREFIX) :]]
    task_cfg = getattr(cfg, task.config_field)
    try:  # too many prompts asked of a split, a template that fails its own check: a dataset error, not a crash
        if split == "train":
            return task.generate(task_cfg, "train", cfg.num_train)
        return task.generate(task_cfg, "test", cfg.num_eval)
    except DatasetError:
        raise
    except ValueError as e:
        raise DatasetError(f"data.{split}={source}: {e}") from e
