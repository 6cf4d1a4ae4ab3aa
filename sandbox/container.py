"""The docker backend: a per-process pool of warm, locked-down containers; one execution is one `docker exec`.

Each container: no network, read-only root filesystem, a small tmpfs /tmp (nosuid, nodev, noexec), all
capabilities dropped, no-new-privileges, uid 65534, cgroup memory (no swap), pids and CPU limits, optionally the
gVisor runtime. PID 1 is a tiny non-dumpable reaper. An execution runs `_supervisor.py`, which kills anything a
previous run left, runs the program with rlimits and a wall-clock alarm, kills what it left, empties /tmp and
reports a nonce-tagged status. Whenever that report does not arrive intact (the program killed the supervisor,
flooded its output, or the supervisor hung), the container is removed (`docker rm -f`, which also kills every
process in it, synchronously) and a fresh one is started in the background.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import secrets
import selectors
import socket
import threading
import time
from pathlib import Path

from sandbox.executor import ExecutionResult, Limits, SandboxConfig, SandboxError, SandboxUnavailable
from sandbox.process import CappedBuffer, killed_by_cpu_limit, memory_error_in

SUPERVISOR = (Path(__file__).parent / "_supervisor.py").read_text()
LABEL = "trustbatch.sandbox"
# PID 1: reap orphans (so zombies never eat the pids limit), never exit, and be non-dumpable so the program
# (same uid) cannot ptrace it into a process that survives kill(-1).
REAPER = (
    "import ctypes, os, signal\n"
    "ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})\n"
    "while True:\n"
    "    try:\n"
    "        while os.waitpid(-1, os.WNOHANG)[0] > 0: pass\n"
    "    except ChildProcessError: pass\n"
    "    signal.sigtimedwait({signal.SIGCHLD}, 5)\n"
)
HOST_GRACE_S = 2.0  # past wall_s + this, the host stops waiting for the supervisor and removes the container
TRAILER_MAX = 1024


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class ContainerPool:
    """Up to `size` warm containers of one shape (memory, tmpfs, pids), created on demand."""

    def __init__(self, backend: DockerBackend, shape: tuple[int, int, int]):
        self.backend, self.shape = backend, shape
        self.idle: list = []
        self.total = 0
        self.closed = False
        self.cond = threading.Condition()

    def _start(self):
        memory_mb, tmpfs_mb, max_processes = self.shape
        cfg = self.backend.cfg
        limit = f"{memory_mb + tmpfs_mb + 64}m"  # program + its /tmp pages + supervisor and reaper
        container = self.backend.client.containers.run(
            cfg.docker_image,
            ["python3", "-I", "-S", "-c", REAPER],
            detach=True,
            network_mode="none",
            read_only=True,
            tmpfs={"/tmp": f"size={tmpfs_mb}m,mode=1777,nosuid,nodev,noexec"},
            shm_size=f"{tmpfs_mb}m",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            user="65534:65534",
            mem_limit=limit,
            memswap_limit=limit,
            pids_limit=max_processes + 3,  # + reaper, supervisor, and runc's helper while an exec starts
            nano_cpus=int(cfg.docker_cpus * 1e9),
            runtime=cfg.docker_runtime,
            environment={"PATH": "/usr/bin", "LANG": "C.UTF-8", "HOME": "/tmp"},
            working_dir="/tmp",
            hostname="sandbox",
            labels={LABEL: "1", f"{LABEL}.owner": _owner()},
        )
        return container

    def acquire(self, timeout: float):
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.idle and self.total >= self.backend.cfg.pool_size:
                if self.closed or not self.cond.wait(max(0.0, deadline - time.monotonic())):
                    raise SandboxError(f"all {self.total} sandbox containers stayed busy for {timeout:.0f} s")
            if self.idle:
                return self.idle.pop()
            self.total += 1
        try:
            return self._start()
        except Exception as e:
            with self.cond:
                self.total -= 1
                self.cond.notify()
            raise SandboxError(f"could not start a sandbox container: {e}") from e

    def release(self, container) -> None:
        with self.cond:
            if self.closed:
                _remove(container)
                return
            self.idle.append(container)
            self.cond.notify()

    def discard(self, container) -> None:
        """Remove the container now (killing whatever runs in it), then warm a replacement in the background."""
        _remove(container)
        with self.cond:
            self.total -= 1
            self.cond.notify()
        threading.Thread(target=self._prewarm, daemon=True).start()

    def _prewarm(self) -> None:
        with self.cond:
            if self.closed or self.total >= self.backend.cfg.pool_size:
                return
            self.total += 1
        try:
            self.release(self._start())
        except Exception:
            with self.cond:
                self.total -= 1
                self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            idle, self.idle = self.idle, []
            self.cond.notify_all()
        for container in idle:
            _remove(container)


def _remove(container) -> None:
    try:
        container.remove(force=True)
    except Exception:
        pass  # already gone; anything left is reaped by the next pool's stale-container sweep


class DockerBackend:
    name = "docker"

    def __init__(self, cfg: SandboxConfig):
        try:
            import docker
        except ImportError as e:
            raise SandboxUnavailable("the docker Python SDK is not installed (pip install docker)") from e
        self.cfg = cfg
        try:
            self.client = docker.from_env(timeout=30)
            self.client.ping()
        except Exception as e:
            raise SandboxUnavailable(
                f"no Docker engine answers ({type(e).__name__}: {str(e)[:200]}); start one "
                "(sudo dockerd &, or sudo bash .ci/setup-sandbox.sh)"
            ) from e
        try:
            self.client.images.get(cfg.docker_image)
        except docker.errors.ImageNotFound as e:
            raise SandboxUnavailable(
                f"the sandbox image {cfg.docker_image!r} is missing; build it with "
                f"`python3 sandbox/image.py --import {cfg.docker_image}` (no registry needed) or "
                f"`docker build -t {cfg.docker_image} sandbox/`"
            ) from e
        if cfg.docker_runtime:
            runtimes = self.client.info().get("Runtimes", {})
            if cfg.docker_runtime not in runtimes:
                raise SandboxUnavailable(
                    f"sandbox.docker_runtime={cfg.docker_runtime!r} is not registered with dockerd (has {sorted(runtimes)}); "
                    "for gVisor: apt-get install runsc, add it to /etc/docker/daemon.json "
                    '("runtimes": {"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none"]}}), restart dockerd'
                )
        self.pools: dict[tuple[int, int, int], ContainerPool] = {}
        self.lock = threading.Lock()
        self._remove_stale()
        atexit.register(self.close)

    def _remove_stale(self) -> None:
        """Remove sandbox containers whose owning process on this host is gone (it was killed before atexit)."""
        host = socket.gethostname()
        for container in self.client.containers.list(all=True, filters={"label": LABEL}):
            owner_host, _, pid = container.labels.get(f"{LABEL}.owner", "").rpartition(":")
            if owner_host == host and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                _remove(container)

    def close(self) -> None:
        with self.lock:
            pools, self.pools = list(self.pools.values()), {}
        for pool in pools:
            pool.close()

    def _pool(self, limits: Limits) -> ContainerPool:
        shape = (limits.memory_mb, limits.tmpfs_mb, limits.max_processes)
        with self.lock:
            if shape not in self.pools:
                self.pools[shape] = ContainerPool(self, shape)
            return self.pools[shape]

    def run(self, code: str, stdin: str, limits: Limits) -> ExecutionResult:
        code_bytes = code.encode("utf-8", errors="surrogatepass")
        nonce = secrets.token_hex(16).encode()
        spec = {
            "code_len": len(code_bytes),
            "wall_s": limits.wall_s,
            "max_output_bytes": limits.max_output_bytes,
            "rlimits": {
                "RLIMIT_CPU": math.ceil(limits.cpu_s),
                "RLIMIT_AS": limits.memory_mb << 20,
                "RLIMIT_FSIZE": limits.max_file_mb << 20,
                "RLIMIT_NOFILE": limits.max_open_files,
                "RLIMIT_CORE": 0,
            },
        }
        payload = nonce + code_bytes + stdin.encode("utf-8", errors="surrogatepass")
        pool = self._pool(limits)
        container = pool.acquire(timeout=60 + 10 * limits.wall_s)
        # The wall limit (and the host's grace past it) is the program's: waiting for a container, or starting
        # one, does not count.
        start = time.monotonic()
        try:
            exec_id = self.client.api.exec_create(
                container.id,
                ["python3", "-I", "-S", "-c", SUPERVISOR, json.dumps(spec)],
                stdin=True,
                stdout=True,
                stderr=True,
                user="65534:65534",
                workdir="/tmp",
            )["Id"]
            sock = self.client.api.exec_start(exec_id, socket=True)
        except Exception as e:
            pool.discard(container)  # most likely the container died (e.g. OOM-killed reaper); start afresh
            raise SandboxError(f"docker exec failed: {e}") from e
        raw = getattr(sock, "_sock", sock)
        out = CappedBuffer(limits.max_output_bytes + TRAILER_MAX)
        err = CappedBuffer(limits.max_output_bytes + TRAILER_MAX)  # the supervisor caps; this is a backstop
        eof, truncated = _pump(raw, payload, out, err, start + limits.wall_s + HOST_GRACE_S)
        if not eof:
            _kill_and_drain(container, raw)
        try:
            raw.close()
        except OSError:
            pass
        stdout = out.data()
        status = None
        marker = stdout.rfind(b"\0" + nonce)
        if eof and not truncated and marker >= 0 and stdout.endswith(b"\n"):
            try:
                status = json.loads(stdout[marker + 1 + len(nonce) : -1])
            except ValueError:
                status = None
            stdout = stdout[:marker]
        stderr = err.data()
        if len(stdout) > limits.max_output_bytes or len(stderr) > limits.max_output_bytes:
            stdout, stderr, truncated = (
                stdout[: limits.max_output_bytes],
                stderr[: limits.max_output_bytes],
                True,
            )
        if status is not None and status.get("clean") and status.get("clean_before"):
            pool.release(container)
        else:
            pool.discard(container)  # synchronous: every process the run started is dead when we return
        stderr_text = stderr.decode("utf-8", errors="replace")
        if status is None:
            # The supervisor never reported: the host timed out, the output was flooded, or the program killed
            # its supervisor (then the exec's own exit status is all we know).
            exit_code = None
            if eof and not truncated:
                try:
                    code_or_none = self.client.api.exec_inspect(exec_id).get("ExitCode")
                except Exception:
                    code_or_none = None
                if code_or_none is not None:
                    exit_code = -(code_or_none - 128) if code_or_none > 128 else code_or_none
            timed_out = not eof and not truncated
            memory = memory_error_in(stderr_text)
        else:
            exit_code = status["exit_code"]
            timed_out = status["timed_out"] or killed_by_cpu_limit(exit_code, status["cpu_s"], limits)
            truncated = truncated or status["truncated"]
            memory = status["oom_kills"] > 0 or memory_error_in(stderr_text)
        return ExecutionResult(
            stdout=stdout.decode("utf-8", errors="replace"),
            stderr=stderr_text,
            exit_code=exit_code,
            timed_out=timed_out,
            memory_exceeded=memory,
            output_truncated=truncated,
            wall_s=time.monotonic() - start,
            backend=self.name if not self.cfg.docker_runtime else f"{self.name}+{self.cfg.docker_runtime}",
        )


def _kill_and_drain(container, raw: socket.socket, timeout: float = 3.0) -> None:
    """Kill every process in the container, reading the exec's stream to its end meanwhile: removing a container
    whose exec is blocked writing to a stream nobody reads makes dockerd wait 10 + 3 s."""
    try:
        container.kill()
    except Exception:
        return
    deadline = time.monotonic() + timeout
    raw.setblocking(False)
    with selectors.DefaultSelector() as selector:
        selector.register(raw, selectors.EVENT_READ)
        while (remaining := deadline - time.monotonic()) > 0:
            if selector.select(remaining):
                try:
                    if not raw.recv(1 << 16):
                        return
                except BlockingIOError:
                    continue
                except OSError:
                    return


_HEADER = re.compile(rb"[\x00-\x02]\x00\x00\x00", re.S)


def _pump(
    raw: socket.socket, payload: bytes, out: CappedBuffer, err: CappedBuffer, deadline: float
) -> tuple[bool, bool]:
    """Write `payload` to the exec's stdin (then half-close) while demultiplexing its output, until EOF, the
    deadline or an overflow. Returns (reached EOF, output overflowed)."""
    raw.setblocking(False)
    selector = selectors.DefaultSelector()
    view = memoryview(payload)
    events = selectors.EVENT_READ | (selectors.EVENT_WRITE if payload else 0)
    selector.register(raw, events)
    if not payload:
        raw.shutdown(socket.SHUT_WR)
    buf = bytearray()
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False, False
            for _, mask in selector.select(remaining):
                if mask & selectors.EVENT_WRITE and view:
                    try:
                        view = view[raw.send(view[: 1 << 16]) :]
                    except BlockingIOError:
                        pass
                    except OSError:
                        view = view[len(view) :]
                    if not view:
                        try:
                            raw.shutdown(socket.SHUT_WR)
                        except OSError:
                            pass
                        selector.modify(raw, selectors.EVENT_READ)
                if mask & selectors.EVENT_READ:
                    try:
                        chunk = raw.recv(1 << 16)
                    except BlockingIOError:
                        continue
                    except OSError:
                        chunk = b""
                    if not chunk:
                        return True, False
                    buf += chunk
                    while len(buf) >= 8:
                        if not _HEADER.match(buf, 0, 4):
                            raise SandboxError(
                                f"unexpected bytes in the docker exec stream: {bytes(buf[:8])!r}"
                            )
                        size = int.from_bytes(buf[4:8], "big")
                        if len(buf) < 8 + size:
                            break
                        target = err if buf[0] == 2 else out
                        overflow = target.add(bytes(buf[8 : 8 + size]))
                        del buf[: 8 + size]
                        if overflow:
                            return False, True
    finally:
        selector.close()
