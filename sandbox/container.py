"""The docker backend: a per-process pool of warm, locked-down containers; one execution is one `docker exec`.

Each container: no network, read-only root filesystem, a small tmpfs /tmp (nosuid, nodev, noexec), all
capabilities dropped, no-new-privileges, uid 65534, cgroup memory (no swap), pids and CPU limits, optionally the
gVisor runtime. PID 1 is a tiny non-dumpable reaper. An execution runs `_supervisor.py`, which kills anything a
previous run left, runs the program with rlimits and a wall-clock alarm, kills what it left, empties /tmp and
reports a nonce-tagged status. Whenever that report does not arrive intact (the program killed the supervisor,
flooded its output, or the supervisor hung), the container is removed (`docker rm -f`, which also kills every
process in it, synchronously) and a fresh one is started in the background. A container that vanished (removed
from outside, or found stopped when the run starts) is replaced and the execution retried once.

Ownership: each backend labels its containers with a random owner id and holds a lease on it, an exclusive
`flock` on `<lease dir>/<owner>.lock`. The kernel drops the lock when the process dies, however it dies and in
whatever PID namespace it runs, so a backend's start-up sweep removes exactly the containers whose owner's lock
it can take. An owner whose lease file it cannot see (another host, mount namespace or uid) is left alone.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import math
import os
import re
import secrets
import selectors
import socket
import stat
import threading
import time
import uuid
import weakref
from pathlib import Path

from sandbox.base import ExecutionResult, Limits, SandboxConfig, SandboxError, SandboxUnavailable
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


OWNER_LABEL = f"{LABEL}.owner"
LEASE_DIR_ENV = "TRUSTBATCH_SANDBOX_LEASE_DIR"
LEASE_NAME = re.compile(r"[0-9a-f]{32}\.lock")
# close waits this long for containers still being started (a start is two API calls of up to 30 s)
CLOSE_WAIT_S = 40.0


def lease_dir() -> Path:
    """Where owners' lease files live: $TRUSTBATCH_SANDBOX_LEASE_DIR, else /run/trustbatch-sandbox-leases for root
    and /tmp/trustbatch-sandbox-leases-<uid> for other users. Processes that share the Docker engine clean up
    after each other only if they see the same directory (the same files, not copies) on a local filesystem."""
    if os.environ.get(LEASE_DIR_ENV):
        return Path(os.environ[LEASE_DIR_ENV])
    uid = os.geteuid()
    return Path("/run/trustbatch-sandbox-leases" if uid == 0 else f"/tmp/trustbatch-sandbox-leases-{uid}")


def _private_dir(path: Path) -> Path:
    """Create `path` (0700) if needed and check that no other user can add, replace or remove files in it: one who
    could would make a live owner look dead."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise SandboxUnavailable(
            f"cannot create the sandbox lease directory {path} ({e}); set {LEASE_DIR_ENV} to a writable directory"
        ) from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SandboxUnavailable(
            f"the sandbox lease directory {path} is not a directory owned by uid {os.geteuid()} and writable only "
            f"by it (mode {stat.filemode(st.st_mode)}, uid {st.st_uid}); remove it, or set {LEASE_DIR_ENV} to one"
        )
    return path


def _lock_nowait(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # held by a live owner (EWOULDBLOCK), or locks do not work here: either way, not dead


def _same_file(fd: int, path: Path) -> bool:
    try:
        st, fst = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


class Lease:
    """This process's claim on an owner id: an exclusive flock on `<dir>/<owner>.lock`, held while the owner lives.

    flock locks belong to the open file description, so the kernel releases this one when the last descriptor of
    it closes: at the latest when the process dies, whatever its PID namespace. A forked child closes its copy
    (see _after_fork), so it neither keeps a dead parent's lease alive nor releases a live one."""

    def __init__(self, directory: Path):
        self.owner = uuid.uuid4().hex
        self.path = directory / f"{self.owner}.lock"
        self.fd: int | None = None
        self.take()

    def take(self) -> None:
        """Hold the lock (again, after a release: the owner id stays the same)."""
        if self.fd is not None:
            return
        while True:  # a sweeper may take the fresh, not yet locked file for a dead owner's and unlink it
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)
        # for people reading the directory; liveness is the lock alone
        os.write(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode())
        self.fd = fd

    def release(self, unlink: bool) -> None:
        """Drop the lease; with `unlink`, also its file (only once no container carries this owner id: a container
        of an owner without a file is one nobody will ever sweep)."""
        if self.fd is None:
            return
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(self.fd)
        self.fd = None

    def forget(self) -> None:
        """In a forked child: close the inherited descriptor without touching the parent's lock or file."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def dead_leases(directory: Path, except_owner: str) -> dict[str, int]:
    """{owner: fd holding its lock} for every lease file in `directory` whose lock could be taken: its owner is
    dead (or let go of it). The caller holds those locks, so no other sweeper acts on them at the same time."""
    dead = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return dead
    for name in names:
        owner = name[: -len(".lock")]
        if not LEASE_NAME.fullmatch(name) or owner == except_owner:
            continue
        try:
            fd = os.open(directory / name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile
        if _lock_nowait(fd) and _same_file(fd, directory / name):
            dead[owner] = fd
        else:
            os.close(fd)
    return dead


_live_backends: weakref.WeakSet = weakref.WeakSet()


def _after_fork() -> None:
    for backend in list(_live_backends):
        backend._inherited()


os.register_at_fork(after_in_child=_after_fork)


class ContainerPool:
    """Up to `size` warm containers of one shape (memory, tmpfs, pids), created on demand."""

    def __init__(self, backend: DockerBackend, shape: tuple[int, int, int], closed: bool = False):
        self.backend, self.shape = backend, shape
        self.idle: list = []
        self.total = 0  # idle + in use + being started
        self.starting = 0
        self.closed = closed
        self.cond = threading.Condition()

    def _start(self):
        memory_mb, tmpfs_mb, max_processes = self.shape
        cfg = self.backend.cfg
        self.backend.hold_lease()
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
            labels={LABEL: "1", OWNER_LABEL: self.backend.owner},
        )
        return container

    def _started(self) -> None:
        with self.cond:
            self.starting -= 1
            self.cond.notify_all()

    def acquire(self, timeout: float):
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.idle and self.total >= self.backend.cfg.pool_size:
                if self.closed or not self.cond.wait(max(0.0, deadline - time.monotonic())):
                    raise SandboxError(f"all {self.total} sandbox containers stayed busy for {timeout:.0f} s")
            if self.idle:
                return self.idle.pop()
            self.total += 1
            self.starting += 1
        try:
            return self._start()
        except Exception as e:
            with self.cond:
                self.total -= 1
                self.cond.notify_all()
            raise SandboxError(f"could not start a sandbox container: {e}") from e
        finally:
            self._started()

    def release(self, container) -> None:
        with self.cond:
            if not self.closed:
                self.idle.append(container)
                self.cond.notify_all()
                return
        self._drop(container)

    def discard(self, container, replace: bool = True) -> None:
        """Remove the container now (killing whatever runs in it); with `replace`, warm another in the background."""
        self._drop(container)
        if replace:
            threading.Thread(target=self._prewarm, daemon=True).start()

    def _drop(self, container) -> None:
        _remove(container)
        with self.cond:
            self.total -= 1
            self.cond.notify_all()

    def _prewarm(self) -> None:
        with self.cond:
            if self.closed or self.total >= self.backend.cfg.pool_size:
                return
            self.total += 1
            self.starting += 1
        try:
            container = self._start()
        except Exception:
            with self.cond:
                self.total -= 1
                self.cond.notify_all()
            return
        finally:
            self._started()
        self.release(container)  # removes it if the pool closed meanwhile

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Remove the idle containers and those still being started (once they are); containers in use are removed
        when their run releases them."""
        with self.cond:
            self.closed = True
            idle, self.idle = self.idle, []
            self.cond.notify_all()
        for container in idle:
            self._drop(container)
        deadline = time.monotonic() + wait_s
        with self.cond:
            while self.starting and self.cond.wait(max(0.0, deadline - time.monotonic())):
                pass

    def remaining(self) -> int:
        with self.cond:
            return self.total


def _remove(container) -> bool:
    """docker rm -f; True unless the engine failed (a container that is already gone counts as removed)."""
    try:
        container.remove(force=True)
        return True
    except Exception as e:
        # not removed: the sweep after this owner's death (or its own close at exit) tries again
        return getattr(e, "status_code", None) == 404


class _Vanished(Exception):
    """The run's container was removed or stopped from outside before or during the execution."""


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
        self.errors = docker.errors
        self.pools: dict[tuple[int, int, int], ContainerPool] = {}
        self.lock = threading.Lock()
        self.closed = False
        self.lease_dir = _private_dir(lease_dir())
        try:
            self.lease = Lease(self.lease_dir)
        except OSError as e:
            raise SandboxUnavailable(
                f"cannot lock a lease file in {self.lease_dir} ({e}); set {LEASE_DIR_ENV} to a directory on a "
                "local filesystem"
            ) from e
        self.owner = self.lease.owner
        self.inherited = False
        _live_backends.add(self)
        atexit.register(self._close_at_exit)
        self._remove_stale()

    def _remove_stale(self) -> None:
        """Remove sandbox containers whose owner is dead: its lease file is here and its lock could be taken (the
        owner was killed before its atexit ran). Owners without a lease file here are left alone: they live on
        another host, in another mount namespace or as another uid, or predate leases."""
        dead = dead_leases(self.lease_dir, except_owner=self.owner)
        if not dead:
            return
        try:
            kept = set()
            for owner in dead:
                try:  # sparse: listed without an inspect of each, which races with a removal in flight
                    stale = self.client.containers.list(
                        all=True, sparse=True, filters={"label": f"{OWNER_LABEL}={owner}"}
                    )
                except Exception:
                    kept.add(owner)  # keep its file: the next sweep tries again
                    continue
                if not all([_remove(container) for container in stale]):
                    kept.add(owner)
            for owner, fd in dead.items():
                path = self.lease_dir / f"{owner}.lock"
                if owner not in kept and _same_file(fd, path):
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
        finally:
            for fd in dead.values():
                os.close(fd)

    def _inherited(self) -> None:
        """In a forked child: the containers, the lease and atexit's close belong to the parent."""
        self.inherited = True
        self.lease.forget()

    def close(self) -> None:
        """Remove this backend's containers: idle ones now, those being started once started, those in use when
        their run ends. The lease (and its file) goes once none is left; else at exit."""
        self._close(exiting=False)

    def _close_at_exit(self) -> None:
        self._close(exiting=True)

    def _close(self, exiting: bool) -> None:
        if self.inherited:
            return
        with self.lock:
            self.closed = True
            pools = list(self.pools.values())
        deadline = time.monotonic() + CLOSE_WAIT_S
        for pool in pools:
            pool.close(wait_s=max(0.0, deadline - time.monotonic()))
        # A start takes the lease again under this lock, so none slips in between the sweep and the release.
        with self.lock:
            if self.lease.fd is None or (not exiting and any(pool.remaining() for pool in pools)):
                return  # still in use: the last release removes the container, atexit the lease
            # Nothing of ours should exist now, unless a start the engine finished after its API call timed out, or
            # (at exit) a run in a daemon thread: remove by label, and keep the lease file unless that worked.
            try:
                leftovers = self.client.containers.list(  # sparse: no inspect that races with a removal
                    all=True, sparse=True, filters={"label": f"{OWNER_LABEL}={self.owner}"}
                )
                gone = all([_remove(container) for container in leftovers])
            except Exception:
                gone = False
            self.lease.release(unlink=gone)

    def hold_lease(self) -> None:
        """Before a container with this owner id is created: the lease must be held (a closed backend let it go)."""
        if self.inherited:  # taking it would wait forever on the parent's lock
            raise SandboxError(
                "this docker sandbox backend belongs to the parent process; call execute() anew"
            )
        with self.lock:
            self.lease.take()

    def _pool(self, limits: Limits) -> ContainerPool:
        shape = (limits.memory_mb, limits.tmpfs_mb, limits.max_processes)
        with self.lock:
            if shape not in self.pools:  # after close: a pool that removes its containers after each run
                self.pools[shape] = ContainerPool(self, shape, closed=self.closed)
            return self.pools[shape]

    def run(self, code: str, stdin: str, limits: Limits) -> ExecutionResult:
        pool = self._pool(limits)
        for attempt in (1, 2):
            container = pool.acquire(timeout=60 + 10 * limits.wall_s)
            try:
                return self._run_in(pool, container, code, stdin, limits)
            except _Vanished as e:
                # Removed or stopped from outside (not by the program: it cannot reach the engine). Replace it
                # and run again on the replacement: nothing of the first attempt carries over.
                pool.discard(container, replace=False)
                if pool.closed:  # at exit, the backend removed every container of its own
                    raise SandboxError(f"the docker sandbox closed during the run ({e})") from None
                if attempt == 2:
                    raise SandboxError(
                        f"two sandbox containers in a row vanished under a run ({e}); is something outside this "
                        "process removing trustbatch.sandbox containers?"
                    ) from None
        raise AssertionError("unreachable")

    def _gone(self, e: Exception) -> bool:
        """The exec failed because the container is gone (404) or not running/paused/restarting (409)."""
        return isinstance(e, self.errors.APIError) and e.status_code in (404, 409)

    def _removed_from_outside(self, container) -> bool:
        """Remove the container (a run without a status report loses it anyway) and say whether someone else had
        removed it or was doing so: the engine answers 404, or 409 'removal already in progress' (docker rm marks
        the container before killing it, so by the time its kill ended our exec, the mark is there)."""
        try:
            container.remove(force=True)
        except self.errors.APIError as e:
            return e.status_code in (404, 409)
        except Exception:
            return False
        return False

    def _run_in(
        self, pool: ContainerPool, container, code: str, stdin: str, limits: Limits
    ) -> ExecutionResult:
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
            if self._gone(e):  # e.g. docker rm -f from outside, or its PID 1 was OOM-killed in the last run
                raise _Vanished(f"docker exec: {e}") from e
            pool.discard(container)
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
        if status is None and self._removed_from_outside(container):
            raise _Vanished("the container was removed during the run")
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
