"""Tools the model calls mid-answer: the protocol, the registry, the built-in ``python`` tool, the async pool.

A tool is a callable ``ToolCall -> ToolResult`` made by a factory; the ``tools`` config section names them, with
their params and the tasks whose rows may call them. The episode driver (app/rollout/episodes.py) parses calls out
of the model's text, runs them in a `ToolPool` (concurrency cap, wall timeout, cancellation) and appends what
they return as tokens the model did not sample. docs/tools.md has the formats, budgets, statuses and metrics.
"""

from tools import python as _python  # noqa: F401 - registers the built-in python tool
from tools.config import ToolSpec
from tools.pool import ToolPool
from tools.registry import REGISTRY, build_tools, check_specs, register
from tools.types import Tool, ToolCall, ToolFactory, ToolResult

__all__ = [
    "REGISTRY",
    "Tool",
    "ToolCall",
    "ToolFactory",
    "ToolPool",
    "ToolResult",
    "ToolSpec",
    "build_tools",
    "check_specs",
    "register",
]
