"""What the sandbox backends and sandbox/executor.py share: the limits, the result, the config, the errors and the
`Backend` protocol.

This module imports no backend (only sandbox/image.py, for the default image name): the backends (container.py,
bwrap.py, process.py) import their types from here, and executor.py, the one module that picks a backend, imports
them in turn. `from sandbox import ...` and `from sandbox.executor import ...` give the same objects.

A sandbox that cannot be set up at all raises `SandboxUnavailable` (a configuration problem, with the fix in the
message); an engine that fails in the middle of a run raises `SandboxError`. What the code itself did is data in
the `ExecutionResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, Protocol

from sandbox.image import DEFAULT_IMAGE

BACKENDS = ("auto", "docker", "bwrap", "none")


class SandboxUnavailable(RuntimeError):
    """The requested backend cannot run on this machine; the message says how to fix that."""


class SandboxError(RuntimeError):
    """The sandbox machinery itself failed during a run (e.g. the Docker engine went away). Not the code's fault."""


@dataclass(frozen=True)
class Limits:
    """Per-execution limits. Every limit holds for the whole process tree the code starts."""

    wall_s: float = 10.0
    """Wall-clock limit; the whole sandboxed process tree is killed when it passes."""
    cpu_s: float = 10.0
    """CPU-time limit per process (RLIMIT_CPU, rounded up to whole seconds)."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS); on docker also the container's cgroup memory (plus tmpfs_mb)."""
    max_processes: int = 32
    """Processes and threads the code may have at once (RLIMIT_NPROC per sandbox uid; docker: pids cgroup)."""
    max_output_bytes: int = 1 << 20
    """Cap on stdout and on stderr, each; past it the run is stopped and marked output_truncated."""
    max_file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE)."""
    max_open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    tmpfs_mb: int = 64
    """Size of the private, writable /tmp (the only writable place)."""

    def __post_init__(self):
        minimum = {
            "wall_s": 0.01,
            "cpu_s": 0.01,
            "memory_mb": 32,
            "max_processes": 1,
            "max_output_bytes": 1,
            "max_file_mb": 0,
            "max_open_files": 8,
            "tmpfs_mb": 1,
        }
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(
                    f"sandbox limits.{f.name}={value!r} is not a number; give a number >= {minimum[f.name]}"
                )
            if value < minimum[f.name]:
                raise ValueError(
                    f"sandbox limits.{f.name}={value!r} is below the minimum {minimum[f.name]}; raise it"
                )


@dataclass(frozen=True)
class ExecutionResult:
    """What the sandboxed program did. Decoded as UTF-8 with errors="replace", so any bytes are safe."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The program's exit status; -N when it died of signal N; None when the sandbox killed it at wall_s."""
    timed_out: bool
    """The wall-clock limit passed, or the CPU-time limit killed it (then exit_code is -SIGXCPU or -SIGKILL)."""
    memory_exceeded: bool
    """The program hit its memory limit (a MemoryError, or the container's OOM killer)."""
    output_truncated: bool
    """stdout or stderr passed max_output_bytes; the program was stopped there."""
    wall_s: float
    """Seconds from the start of the run (once a sandbox slot or container was free) to its result."""
    backend: str


@dataclass
class SandboxConfig:
    """The `sandbox:` config section."""

    backend: Literal["auto", "docker", "bwrap", "none"] = "auto"
    """Which isolation to use: auto (docker if an engine and the image answer, else bwrap), docker, bwrap, none."""
    allow_unsandboxed: bool = False
    """Must be true for backend=none, which runs model-written code with no isolation (trusted code only)."""
    docker_image: str = DEFAULT_IMAGE
    """Image holding python3 (build it with .ci/setup-sandbox.sh or `python3 sandbox/image.py --import TAG`)."""
    docker_runtime: str | None = None
    """OCI runtime for the sandbox containers, e.g. runsc (gVisor); None is Docker's default (runc)."""
    docker_cpus: float = 1.0
    """CPUs each sandbox container may use (cgroup CPU quota)."""
    pool_size: int = 4
    """Most warm containers kept per process (created on demand, one per concurrent execution)."""
    bwrap_python: str = "/usr/bin/python3"
    """Interpreter bound into the bwrap sandbox; must live under /usr (a system python, not pyenv or a venv)."""
    bwrap_uid_base: int = 61000
    """bwrap runs as uid bwrap_uid_base + slot (64 slots), so concurrent runs never share an RLIMIT_NPROC count."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"sandbox.backend={self.backend!r} is not one of {list(BACKENDS)}")
        if self.backend == "none" and not self.allow_unsandboxed:
            raise ValueError(
                "sandbox.backend='none' runs model-written code on the host with no isolation; "
                "set sandbox.allow_unsandboxed=true to accept that, or use backend auto, docker or bwrap"
            )
        if self.pool_size < 1:
            raise ValueError(f"sandbox.pool_size={self.pool_size} must be >= 1")
        if not self.docker_cpus > 0:
            raise ValueError(f"sandbox.docker_cpus={self.docker_cpus} must be > 0")
        if not self.docker_image:
            raise ValueError("sandbox.docker_image is empty; the default is " + DEFAULT_IMAGE)
        if self.docker_runtime == "":
            self.docker_runtime = None
        if not self.bwrap_python.startswith("/usr/"):
            raise ValueError(
                f"sandbox.bwrap_python={self.bwrap_python!r} is not under /usr; the bwrap sandbox exposes only /usr, "
                "so use a system python (apt-get install python3 gives /usr/bin/python3)"
            )
        if not 1000 <= self.bwrap_uid_base <= 2**31 - 100:
            raise ValueError(
                f"sandbox.bwrap_uid_base={self.bwrap_uid_base} must be an unused uid range >= 1000"
            )


class Backend(Protocol):
    """What executor.py needs of a backend: its name, a run, and closing what it holds."""

    name: str

    def run(self, code: str, stdin: str, limits: Limits) -> ExecutionResult: ...

    def close(self) -> None: ...
