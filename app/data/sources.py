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

from app.data.loaders import BUILTIN_PREFIX, SOURCE_KEY, SourceSpec, load_file, load_records, spec_from, tag
from app.data.rows import FORMATS, DatasetError, PromptRow, Purpose
from app.data.tasks import (
    ArithmeticConfig,
    PythonFunctionsConfig,
    WordProblemsConfig,
    arithmetic_prompts,
    python_function_prompts,
    word_problem_prompts,
)


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

    train: Any = "builtin:arithmetic"
    """Training prompts: one source, or a list of sources with weights (a mixture: each draw picks a source in
    proportion to its weight). A source is builtin:<task> (arithmetic, word_problems, python_functions), a file
    (.jsonl, .jsonl.gz, .json, .parquet, .csv, .arrow), a directory (save_to_disk, or a dataset repository's
    files), or hub:<owner>/<name>; as a mapping it also takes weight, name, format, fields, template, answer,
    system, task, config, split, revision, max_rows and streaming (app/data/loaders.py, docs/data.md)."""
    eval: Any = "builtin:arithmetic"
    """Evaluation prompts: one source or a list of them (all of each; accuracy is reported per source); a built-in
    task gives its test split."""
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
    format: Literal["rows", "gsm8k", "humaneval", "mbpp"] = "rows"
    """Schema of the sources that set no format of their own: rows (the row schema of app/data/rows.py), gsm8k
    (GSM8K's {"question", "answer": "... #### 42"} rows, posed as chat word problems with a \\boxed{} instruction) or
    humaneval (HumanEval's {"task_id", "prompt", "entry_point", "test"} rows, .jsonl or .jsonl.gz: the function
    asked for in a chat request, graded by the code verifier with the problem's check()) or mbpp (MBPP's
    {"task_id", "prompt", "test_list", "test_imports"} rows, its asserts as the code test)."""
    on_long_prompt: Literal["error", "drop"] = "error"
    """A prompt whose tokens (as the rollout engines get them: the chat template applied to `messages` rows)
    leave fewer than rollout.max_new_tokens positions in the model's context (max_position_embeddings).
    error: stop at start-up, naming the file and rows; drop: skip such rows of data.train and data.eval, logged
    with their count (MLflow metrics data/dropped_long_prompts/train and .../eval)."""
    decontaminate: Literal["report", "drop"] = "report"
    """Training rows that share a 13-gram (normalised text) with an evaluation prompt or a benchmark of
    eval.benchmarks: report counts them at start-up (per source and evaluation set); drop also leaves them out."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r}: choose one of {list(FORMATS)}")
        for split in ("train", "eval"):
            specs = self.sources(split)
            for i, spec in enumerate(specs):
                key = f"data.{split}" if isinstance(getattr(self, split), str) else f"data.{split}[{i}]"
                if spec.kind == "builtin":
                    name = spec.source[len(BUILTIN_PREFIX) :]
                    if name not in BUILTIN_TASKS:
                        raise ValueError(
                            f"{key}={spec.source!r}: unknown built-in task {name!r}; choose one of "
                            f"{[BUILTIN_PREFIX + t for t in BUILTIN_TASKS]}, a file, a directory or hub:<owner>/<name>"
                        )
            names = [spec.label for spec in specs]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"data.{split}: sources {duplicates} share a name; give each a `name`")
            if split == "train" and sum(spec.weight for spec in specs) <= 0:
                raise ValueError("data.train: the weights sum to zero; give at least one source a weight > 0")
        for key in ("num_train", "num_eval"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key}={getattr(self, key)} must be >= 1")

    def sources(self, split: Literal["train", "eval"]) -> list[SourceSpec]:
        """The sources of ``data.<split>``, checked (a string is one source)."""
        value = getattr(self, split)
        if isinstance(value, str):
            return [spec_from(value, f"data.{split}", self.format)]
        if isinstance(value, dict):
            return [spec_from(value, f"data.{split}", self.format)]
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"data.{split}={value!r}: give a source or a non-empty list of sources")
        return [spec_from(v, f"data.{split}[{i}]", self.format) for i, v in enumerate(value)]

    def describe(self, split: Literal["train", "eval"]) -> str:
        """``data.<split>`` for messages: the source, or the sources' names."""
        specs = self.sources(split)
        return specs[0].source if len(specs) == 1 else "[" + ", ".join(s.label for s in specs) + "]"


def load_split(cfg: DataConfig, split: Literal["train", "eval"], purpose: Purpose = "rl") -> list[PromptRow]:
    """Prompts of the train or eval sources, concatenated in order, each tagged with its source's name
    (``metadata.data_source``): a whole file, a built-in task's train / test split, or a `datasets` source (app/data/
    loaders.py). ``purpose``: "rl" rows need an answer or tests, "sft" rows a completion (built-in rows have both)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be 'train' or 'eval'")
    specs = cfg.sources(split)
    rows: list[PromptRow] = []
    for i, spec in enumerate(specs):
        key = f"data.{split}" if len(specs) == 1 and isinstance(getattr(cfg, split), str) else f"data.{split}[{i}]"
        rows += load_source(cfg, spec, split, purpose, key)
    return rows


def source_sizes(rows: list[PromptRow], specs: list[SourceSpec]) -> list[list[int]]:
    """The row indices of each source, in the order of ``specs`` (what a mixture draws from)."""
    index = {spec.label: k for k, spec in enumerate(specs)}
    groups: list[list[int]] = [[] for _ in specs]
    for i, row in enumerate(rows):
        groups[index[row.metadata[SOURCE_KEY]]].append(i)
    return groups


def load_source(cfg: DataConfig, spec: SourceSpec, split: str, purpose: Purpose, key: str) -> list[PromptRow]:
    """The rows of one source (``key`` names it in errors), tagged with its name."""
    return tag(_read_source(cfg, spec, split, purpose, key), spec.label)


def _read_source(cfg: DataConfig, spec: SourceSpec, split: str, purpose: Purpose, key: str) -> list[PromptRow]:
    if spec.kind == "builtin":
        task = BUILTIN_TASKS[spec.source[len(BUILTIN_PREFIX) :]]
        task_cfg = getattr(cfg, task.config_field)
        n = spec.max_rows or (cfg.num_train if split == "train" else cfg.num_eval)
        try:  # too many prompts asked of a split, a template that fails its own check: a dataset error, not a crash
            rows = task.generate(task_cfg, "train" if split == "train" else "test", n)
        except DatasetError:
            raise
        except ValueError as e:
            raise DatasetError(f"{key}={spec.source}: {e}") from e
        if spec.system or spec.task or spec.answer != "as_is":
            raise DatasetError(f"{key}: a built-in task takes no system, task or answer option")
        return rows
    if spec.plain:
        return load_file(spec, purpose)
    return load_records(spec, "train" if split == "train" else "test", purpose, key)
