"""`execute(code)`: run untrusted Python in a sandbox and return what it did, never raising for what the code did.

Backends (threat model per backend in sandbox/README.md):
- `docker`: a pool of warm, locked-down containers (no network, read-only root, cgroup memory/pids/CPU limits);
  one execution costs one `docker exec`. Optional gVisor (`docker_runtime: runsc`).
- `bwrap`: bubblewrap namespaces around the host's /usr/bin/python3, as an unprivileged uid, with rlimits.
- `none`: a plain subprocess with rlimits. No isolation at all; refused unless `allow_unsandboxed: true`.
- `auto`: docker when an engine answers and the image exists, else bwrap, else a clear error. Never `none`.

What the untrusted code does (crash, hang, flood, fork bomb) is data in the `ExecutionResult`. A sandbox that
cannot be set up at all raises `SandboxUnavailable` (a configuration problem, with the fix in the message); an
engine that fails in the middle of a run raises `SandboxError`, which the reward runner turns into Score.error.

The shared types (`Limits`, `ExecutionResult`, `SandboxConfig`, the errors, the `Backend` protocol) live in
sandbox/base.py, which imports no backend; they are imported here, so `from sandbox.executor import ...` still
gives them. This module picks and builds the backend (importing each one only when it is first used) and runs it.
"""

from __future__ import annotations

import os
import threading

from sandbox.base import (
    BACKENDS,
    Backend,
    ExecutionResult,
    Limits,
    SandboxConfig,
    SandboxError,
    SandboxUnavailable,
)

_lock = threading.Lock()
_config = SandboxConfig()
_backends: dict[tuple[int, str], Backend] = {}  # (pid, name): pools and docker clients never cross a fork
_unavailable: dict[tuple[int, str], str] = {}


def configure(cfg: SandboxConfig) -> None:
    """Set the process-wide sandbox config (call once at start-up); closes backends built for the old one."""
    global _config
    with _lock:
        _config = cfg
        backends = list(_backends.values())
        _backends.clear()
        _unavailable.clear()
    for backend in backends:
        backend.close()


def _build(name: str, cfg: SandboxConfig) -> Backend:
    if name == "docker":
        from sandbox.container import DockerBackend

        return DockerBackend(cfg)
    if name == "bwrap":
        from sandbox.bwrap import BwrapBackend

        return BwrapBackend(cfg)
    if name == "none":
        if not cfg.allow_unsandboxed:
            raise SandboxUnavailable(
                "backend 'none' runs the code on the host with no isolation; it needs "
                "sandbox.allow_unsandboxed=true (only for trusted code). Use backend auto, docker or bwrap."
            )
        from sandbox.process import UnsandboxedBackend

        return UnsandboxedBackend(cfg)
    raise ValueError(f"sandbox backend={name!r} is not one of {list(BACKENDS)}")


def _probe(name: str, cfg: SandboxConfig) -> Backend | str:
    """The live backend `name` for this process, or why it cannot run (both cached per process)."""
    key = (os.getpid(), name)
    with _lock:
        if key in _backends:
            return _backends[key]
        if key in _unavailable:
            return _unavailable[key]
        try:
            _backends[key] = _build(name, cfg)
            return _backends[key]
        except SandboxUnavailable as e:
            _unavailable[key] = str(e)
            return str(e)


def get_backend(name: str = "auto") -> Backend:
    """The live backend for `name` in this process, built (and probed) on first use."""
    if name not in BACKENDS:
        raise ValueError(f"sandbox backend={name!r} is not one of {list(BACKENDS)}")
    cfg = _config
    if name == "auto":
        name = cfg.backend
    reasons = []
    for candidate in ["docker", "bwrap"] if name == "auto" else [name]:
        backend = _probe(candidate, cfg)
        if not isinstance(backend, str):
            return backend
        reasons.append(f"{candidate}: {backend}")
    if name == "none":
        raise SandboxUnavailable(reasons[0])
    raise SandboxUnavailable(
        "no sandbox backend can run here.\n  " + "\n  ".join(reasons) + "\n"
        "Fix: install bubblewrap (apt-get install bubblewrap) or start Docker and build the image "
        "(sudo bash .ci/setup-sandbox.sh does both)."
    )


def available_backends() -> dict[str, str | None]:
    """{'docker': None or why it cannot run, 'bwrap': ...} for this machine (probes each once per process)."""
    out: dict[str, str | None] = {}
    for name in ("docker", "bwrap"):
        backend = _probe(name, _config)
        out[name] = backend if isinstance(backend, str) else None
    return out


def execute(
    code: str,
    *,
    stdin: str = "",
    limits: Limits = Limits(),  # noqa: B008 - Limits is frozen: one shared default is safe
    backend: str = "auto",
) -> ExecutionResult:
    """Run `code` with python3 in the sandbox, feed it `stdin`, and return what it did within `limits`.

    backend="auto" uses the configured `sandbox.backend` (itself auto by default: docker, else bwrap).
    Raises SandboxUnavailable when no allowed backend can run here, SandboxError when the engine fails mid-run.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be str, got {type(code).__name__}")
    if not isinstance(stdin, str):
        raise TypeError(f"stdin must be str, got {type(stdin).__name__}")
    return get_backend(backend).run(code, stdin, limits)


def close() -> None:
    """Remove this process's warm containers (also done at exit)."""
    configure(_config)


__all__ = [
    "BACKENDS",
    "ExecutionResult",
    "Limits",
    "SandboxConfig",
    "SandboxError",
    "SandboxUnavailable",
    "available_backends",
    "close",
    "configure",
    "execute",
    "get_backend",
]
