"""Prompt datasets: files with a validated row schema, and built-in synthetic tasks.

- rows.py: the row schema (`PromptRow`, `DatasetError`, row validation) and the .jsonl / .parquet / GSM8K loader
  (`load_prompts`);
- prepare.py: preparing prompts for a model, once per command (`ModelText`: tokenizer and context; `prepare_prompts`:
  tokenize and length-check; `stop_token_ids`);
- sources.py: `DataConfig`, the registry of built-in tasks (`BUILTIN_TASKS`) and `load_split`;
- tasks/: the built-in tasks, `builtin:arithmetic`, `builtin:word_problems` and `builtin:python_functions` (the
  last two with their templates as tables).
"""

from app.data.prepare import limit_prompt_lengths
from app.data.rows import (
    FILE_EXTENSIONS,
    FORMATS,
    ROLES,
    WORD_PROBLEM_INSTRUCTION,
    DatasetError,
    PromptRow,
    load_prompts,
)
from app.data.sources import BUILTIN_PREFIX, BUILTIN_TASKS, BuiltinTask, DataConfig, load_split
from app.data.tasks import (
    TEST_FRACTION,
    WORD_PROBLEM_TEMPLATES,
    ArithmeticConfig,
    Numbers,
    PythonFunctionsConfig,
    WordProblemsConfig,
    WordProblemTemplate,
    arithmetic_prompts,
    evaluate_expression,
    python_function_prompts,
    split_of,
    word_problem_key,
    word_problem_prompts,
    worked_solution,
)

__all__ = [
    "BUILTIN_PREFIX",
    "BUILTIN_TASKS",
    "FILE_EXTENSIONS",
    "FORMATS",
    "ROLES",
    "TEST_FRACTION",
    "WORD_PROBLEM_INSTRUCTION",
    "WORD_PROBLEM_TEMPLATES",
    "ArithmeticConfig",
    "BuiltinTask",
    "DataConfig",
    "DatasetError",
    "Numbers",
    "PromptRow",
    "PythonFunctionsConfig",
    "WordProblemTemplate",
    "WordProblemsConfig",
    "arithmetic_prompts",
    "evaluate_expression",
    "limit_prompt_lengths",
    "load_prompts",
    "load_split",
    "python_function_prompts",
    "worked_solution",
    "split_of",
    "word_problem_key",
    "word_problem_prompts",
]
