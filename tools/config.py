"""The ``tools`` config section: which tools the model may call, on which tasks, with what parameters.

YAML shape::

    tools:
      - {name: python, tasks: [math]}                                   # the built-in sandboxed Python tool
      - {name: my_pkg.tools:make_tool, tasks: [search], params: {top_k: 3}, label: search}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class ToolSpec:
    """One tool in ``tools``."""

    name: str = MISSING
    """A registered tool (``python``) or ``package.module:factory`` (a factory returning ``ToolCall -> ToolResult``)."""
    tasks: list[str] = field(default_factory=lambda: ["math"])
    """Rows of these tasks (a row's ``task``) may call this tool; rows of other tasks are answered in one turn."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword parameters of the factory (for ``python``: the fields of PythonToolConfig)."""
    label: str | None = None
    """The name the model calls it by (a Hermes call's ``name``, metrics' ``tools/<label>/...``); defaults to the
    registered name, or the factory's name for a dotted path. A fenced ```python block calls the tool labelled
    ``python``."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("tools[].name must be a registered tool (python) or 'package.module:factory'")
        if not self.tasks or not all(isinstance(t, str) and t for t in self.tasks):
            raise ValueError(f"tools[].tasks={self.tasks!r} must list at least one task name (a row's `task`)")
        if self.label is not None and (not self.label or not self.label.replace("_", "").isalnum()):
            raise ValueError(f"tools[].label={self.label!r} must be letters, digits and underscores")

    @property
    def call_name(self) -> str:
        if self.label:
            return self.label
        return self.name.rpartition(":")[2] if ":" in self.name else self.name
