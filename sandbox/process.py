"""Subprocess plumbing shared by the bwrap and none backends: rlimits via prlimit, capped reading, hard kills.

Also the `none` backend itself: a plain subprocess with rlimits and a scrubbed environment. It is not a sandbox
(the code can read and write anything the host user can, and use the network); it exists for trusted code and
machines without bubblewrap or Docker, and only runs with `sandbox.allow_unsandboxed: true`.
"""

from __future__ import annotations

import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from sandbox.base import ExecutionResult, Limits, SandboxConfig, SandboxUnavailable

ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}
_MEMORY_ERROR = re.compile(r"^MemoryError\b", re.M)


def killed_by_cpu_limit(exit_code: int | None, cpu_s: float, limits: Limits) -> bool:
    """SIGKILL or SIGXCPU after using up RLIMIT_CPU (soft = hard limit, so the kernel sends SIGKILL)."""
    return exit_code in (-signal.SIGKILL, -signal.SIGXCPU) and cpu_s >= math.ceil(limits.cpu_s) - 0.05


def process_result(
    out: CappedBuffer,
    err: CappedBuffer,
    exit_code: int,
    cpu_s: float,
    *,
    timed_out: bool,
    truncated: bool,
    start: float,
    limits: Limits,
    backend: str,
) -> ExecutionResult:
    """The ExecutionResult of a program run as a host process (the bwrap and unsandboxed backends)."""
    stderr = err.text()
    return ExecutionResult(
        stdout=out.text(),
        stderr=stderr,
        exit_code=None if timed_out else exit_code,
        timed_out=timed_out or killed_by_cpu_limit(exit_code, cpu_s, limits),
        memory_exceeded=memory_error_in(stderr),
        output_truncated=truncated,
        wall_s=time.monotonic() - start,
        backend=backend,
    )


def memory_error_in(stderr: str) -> bool:
    """A Python MemoryError traceback ended the program (RLIMIT_AS makes allocations fail with one)."""
    return bool(_MEMORY_ERROR.search(stderr[-4096:]))


class CappedBuffer:
    """Collects at most `cap` bytes; `add` says when more than that arrived (the rest is dropped)."""

    def __init__(self, cap: int):
        self.cap, self.size, self.truncated = cap, 0, False
        self.chunks: list[bytes] = []

    def add(self, chunk: bytes) -> bool:
        room = self.cap - self.size
        if len(chunk) > room:
            chunk, self.truncated = chunk[:room], True
        self.chunks.append(chunk)
        self.size += len(chunk)
        return self.truncated

    def data(self) -> bytes:
        return b"".join(self.chunks)

    def text(self) -> str:
        return self.data().decode("utf-8", errors="replace")


def prlimit_argv(limits: Limits, *, nproc: int | None, min_fsize: int = 0) -> list[str]:
    """`prlimit` options that set soft = hard for the limits (so the code cannot raise them again)."""
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        raise SandboxUnavailable("prlimit is missing (apt-get install util-linux)")
    values = {
        "cpu": math.ceil(limits.cpu_s),
        "as": limits.memory_mb << 20,
        "fsize": max(limits.max_file_mb << 20, min_fsize),
        "nofile": limits.max_open_files,
        "core": 0,
    }
    if nproc is not None:
        values["nproc"] = nproc
    return [prlimit, *(f"--{name}={value}:{value}" for name, value in values.items()), "--"]


def communicate(proc: subprocess.Popen, stdin: bytes, limits: Limits, deadline: float):
    """Feed stdin and read stdout/stderr without blocking or buffering more than the cap.

    Returns (stdout, stderr, timed_out, truncated); on a timeout or an overflow the caller kills the tree.
    """
    out, err = CappedBuffer(limits.max_output_bytes), CappedBuffer(limits.max_output_bytes)
    selector = selectors.DefaultSelector()
    targets = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    for fd in targets:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    view = memoryview(stdin)
    stdin_fd = proc.stdin.fileno()
    if view:
        os.set_blocking(stdin_fd, False)
        selector.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    timed_out = truncated = False
    try:
        while targets:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in selector.select(remaining):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        view = view[os.write(fd, view[: 1 << 16]) :]
                    except BlockingIOError:
                        continue
                    except OSError:  # the program closed stdin or exited; the rest is not wanted
                        view = view[len(view) :]
                    if not view:
                        selector.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(fd)
                    del targets[fd]
                    continue
                if targets[fd].add(chunk):
                    truncated = True
            if truncated:
                break
    finally:
        selector.close()
        if not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
    return out, err, timed_out, truncated


def wait_status(proc: subprocess.Popen) -> tuple[int, float]:
    """Reap `proc`; return (exit code as subprocess reports it, CPU seconds of it and its reaped descendants)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class UnsandboxedBackend:
    """backend=none: python3 in a fresh temp dir with rlimits and a minimal environment. No isolation."""

    name = "none"

    def __init__(self, cfg: SandboxConfig):
        self.python = cfg.bwrap_python if os.path.exists(cfg.bwrap_python) else sys.executable
        prlimit_argv(Limits(), nproc=None)  # fail early when prlimit is missing

    def close(self) -> None:
        pass

    def run(self, code: str, stdin: str, limits: Limits) -> ExecutionResult:
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="trustbatch-unsandboxed-") as tmp:
            path = os.path.join(tmp, "main.py")
            with open(path, "wb") as f:
                f.write(code.encode("utf-8", errors="surrogatepass"))
            argv = [*prlimit_argv(limits, nproc=None), self.python, "-I", "-X", "utf8", path]
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=tmp,
                env={**ENV, "HOME": tmp},
                start_new_session=True,
            )
            with proc:
                out, err, timed_out, truncated = communicate(
                    proc, stdin.encode("utf-8", errors="surrogatepass"), limits, start + limits.wall_s
                )
                kill_group(proc)  # also whatever the program left in its process group
                code_, cpu = wait_status(proc)
        return process_result(
            out,
            err,
            code_,
            cpu,
            timed_out=timed_out,
            truncated=truncated,
            start=start,
            limits=limits,
            backend=self.name,
        )
