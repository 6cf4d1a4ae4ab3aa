"""What crosses the tool boundary: a call the model made, and the result it gets back as an observation.

A tool is a plain callable ``ToolCall -> ToolResult``, built once per run by a factory ``(**params) -> Tool``
(registered by name in tools/registry.py, or named by its dotted path ``package.module:factory``). It never sees
token ids, tensors, the model or the config: the episode driver (app/rollout/episodes.py) parses the model's text
into a `ToolCall`, and renders the `ToolResult` into the text the model reads next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

ToolStatus = Literal["ok", "error", "timeout"]
"""ok: the tool ran and answered; error: the call was malformed, the tool raised, or the code it ran failed
(a non-zero exit); timeout: the call passed its wall-clock limit."""


@dataclass(frozen=True)
class ToolCall:
    """One call, as parsed from the model's text."""

    name: str
    """The tool called (``python`` for a fenced code block)."""
    arguments: dict[str, Any]
    """Its arguments: ``{"code": "..."}`` for the python tool, the JSON object of a Hermes-style call."""
    raw: str = ""
    """The text of the call as the model wrote it (for logs and transcripts)."""


@dataclass(frozen=True)
class ToolResult:
    """What a call returned: the text the model reads, and how the call went."""

    output: str
    """The observation text (the python tool: stdout, then stderr, then the exit status when it is not 0)."""
    status: ToolStatus = "ok"
    detail: dict[str, Any] = field(default_factory=dict)
    """Anything worth counting or logging (exit code, wall time, truncation); never shown to the model."""


Tool = Callable[[ToolCall], ToolResult]
ToolFactory = Callable[..., Tool]
