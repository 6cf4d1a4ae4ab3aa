"""The built-in ``python`` tool: the model's code runs in the sandbox the code verifier uses, with the same limits.

Each call is one ``sandbox.execute`` (Docker or bubblewrap, whichever the run's ``sandbox`` section picks) of the
code as a fresh program: no state carries from one call to the next, so a later block must define again what it
uses (the ToRL/ReTool convention is the same). The result the model reads is stdout, then stderr, then the exit
status when it is not 0; a call past its wall-clock limit, one that ran out of memory and one whose output hit
``max_output_bytes`` say so. What the code does is data: nothing it does raises here. A sandbox that cannot run
at all is a `ToolResult` with status ``error`` and the reason, counted by the driver, never a stopped run.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbox.base import SandboxError, SandboxUnavailable
from sandbox.executor import Limits, execute
from tools.registry import config_from_params, register
from tools.types import Tool, ToolCall, ToolResult


@dataclass
class PythonToolConfig:
    """Parameters of the ``python`` tool (``tools[i].params``); the defaults are the code verifier's limits."""

    wall_s: float = 5.0
    """Wall-clock limit of one call (sandbox ``Limits.wall_s``)."""
    cpu_s: float = 5.0
    """CPU-time limit of one call."""
    memory_mb: int = 512
    """Memory limit of one call."""
    max_output_bytes: int = 65536
    """Cap on each of stdout and stderr of one call; past it the program is stopped (the model is told)."""
    backend: str = "auto"
    """Sandbox backend: auto (the run's ``sandbox.backend``), docker or bwrap."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"python tool params.{name}={getattr(self, name)!r} must be > 0")
        if self.backend not in ("auto", "docker", "bwrap"):
            raise ValueError(f"python tool params.backend={self.backend!r} must be auto, docker or bwrap")


@register("python", params=PythonToolConfig)
def python_tool(**params) -> Tool:
    cfg = config_from_params(PythonToolConfig, params, "python tool")
    limits = Limits(wall_s=cfg.wall_s, cpu_s=cfg.cpu_s, memory_mb=cfg.memory_mb, max_output_bytes=cfg.max_output_bytes)

    def run(call: ToolCall) -> ToolResult:
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return ToolResult('the python tool takes {"code": "<program>"}', "error", {"reason": "bad arguments"})
        try:
            result = execute(code, limits=limits, backend=cfg.backend)
        except (SandboxUnavailable, SandboxError) as exc:
            return ToolResult(f"the sandbox could not run the code ({exc})", "error", {"reason": "sandbox"})
        parts = [result.stdout]
        if result.stderr:
            parts.append(result.stderr)
        if result.timed_out:
            parts.append(f"(stopped: the time limit of {cfg.wall_s:g} s passed)")
        elif result.memory_exceeded:
            parts.append(f"(stopped: the memory limit of {cfg.memory_mb} MB was reached)")
        elif result.output_truncated:
            parts.append(f"(stopped: the output passed {cfg.max_output_bytes} bytes)")
        elif result.exit_code not in (0, None):
            parts.append(f"(exit status {result.exit_code})")
        status = "timeout" if result.timed_out else ("ok" if result.exit_code == 0 else "error")
        detail = {"exit_code": result.exit_code, "wall_s": result.wall_s, "backend": result.backend,
                  "output_truncated": result.output_truncated, "memory_exceeded": result.memory_exceeded}
        return ToolResult("\n".join(p.rstrip("\n") for p in parts if p), status, detail)

    return run
