"""Run untrusted (model-written) Python with no network, no host files and bounded CPU, memory, processes,
output and disk. `execute(code)` is the whole API; the threat model per backend is in sandbox/README.md.

    from sandbox import execute, Limits
    result = execute("print(input()[::-1])", stdin="abc", limits=Limits(wall_s=2))
    result.stdout == "cba\\n"

Dependencies: stdlib, plus the docker SDK for the docker backend (imported only when that backend is used).
"""

from sandbox.executor import (
    ExecutionResult,
    Limits,
    SandboxConfig,
    SandboxError,
    SandboxUnavailable,
    available_backends,
    close,
    configure,
    execute,
)

__all__ = [
    "ExecutionResult",
    "Limits",
    "SandboxConfig",
    "SandboxError",
    "SandboxUnavailable",
    "available_backends",
    "close",
    "configure",
    "execute",
]
