"""The built-in synthetic tasks, one module each (arithmetic.py, word_problems.py with its template table in
word_problem_templates.py); app/data/sources.py registers them as `builtin:<task>` sources."""

from app.data.tasks.arithmetic import (
    TEST_FRACTION,
    ArithmeticConfig,
    arithmetic_prompts,
    evaluate_expression,
    sft_text,
    split_of,
)
from app.data.tasks.word_problem_templates import WORD_PROBLEM_TEMPLATES, Draw, Numbers, WordProblemTemplate
from app.data.tasks.word_problems import WordProblemsConfig, word_problem_key, word_problem_prompts

__all__ = [
    "TEST_FRACTION",
    "WORD_PROBLEM_TEMPLATES",
    "ArithmeticConfig",
    "Draw",
    "Numbers",
    "WordProblemTemplate",
    "WordProblemsConfig",
    "arithmetic_prompts",
    "evaluate_expression",
    "sft_text",
    "split_of",
    "word_problem_key",
    "word_problem_prompts",
]
