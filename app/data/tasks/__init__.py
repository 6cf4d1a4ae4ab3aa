"""The built-in synthetic tasks, one module each (arithmetic.py, python_functions.py with its template table in python_function_templates.py, word_problems.py with its template table in
word_problem_templates.py); app/data/sources.py registers them as `builtin:<task>` sources."""

from app.data.tasks.arithmetic import (
    TEST_FRACTION,
    ArithmeticConfig,
    arithmetic_prompts,
    evaluate_expression,
    split_of,
    worked_solution,
)
from app.data.tasks.python_function_templates import FUNCTION_TEMPLATES, FunctionTemplate
from app.data.tasks.python_functions import (
    FunctionProblem,
    PythonFunctionsConfig,
    function_problem_key,
    make_problem,
    python_function_prompts,
)
from app.data.tasks.word_problem_templates import WORD_PROBLEM_TEMPLATES, Draw, Numbers, WordProblemTemplate
from app.data.tasks.word_problems import WordProblemsConfig, word_problem_key, word_problem_prompts

__all__ = [
    "FUNCTION_TEMPLATES",
    "FunctionProblem",
    "FunctionTemplate",
    "PythonFunctionsConfig",
    "function_problem_key",
    "make_problem",
    "python_function_prompts",
    "TEST_FRACTION",
    "WORD_PROBLEM_TEMPLATES",
    "ArithmeticConfig",
    "Draw",
    "Numbers",
    "WordProblemTemplate",
    "WordProblemsConfig",
    "arithmetic_prompts",
    "evaluate_expression",
    "worked_solution",
    "split_of",
    "word_problem_key",
    "word_problem_prompts",
]
