"""Rollout servers the run owns, as child processes: `ServerProcess` and the built-in CPU server's command.

`ServerProcess` runs one server command line as a child of the trainer: the built-in CPU server
(`LocalServerProcess`: ``python -m app.cli rollout-server``, what ``rollout.engine=local`` starts, one per rank on
a free loopback port) and real SGLang (`app.rollout.sglang_server.SGLangServerProcess`:
``python -m sglang.launch_server``). The run talks to either through the same SGLang client; the supervisor in
app/rollout/fleet.py watches both through the interface here:

- ``start(model_dir=..., weight_version=...)`` starts the server, and starts it again on the same port after it
  died or was killed, optionally from newer weights with their version label (the command line is rebuilt from
  them). It returns the URL at once; ``wait_ready()`` blocks until GET /health answers 200, and reports a server
  that exits during start-up (or stays unhealthy) with the tail of what this start wrote to its log;
- ``exited()`` is the exit code once the process has ended; ``kill()`` is SIGKILL (a hung server may ignore
  SIGTERM); ``stop()`` is SIGTERM, then SIGKILL after a grace period;
- stdout and stderr go to one log file, appended across restarts, each start headed by its command line;
- the environment is the trainer's without torchrun's variables (`TRAINER_ENV`): a server is not part of the
  trainer's process group;
- the child dies with the parent (PR_SET_PDEATHSIG). That signal fires when the *thread* that started the child
  ends: call ``start()`` from a thread that lives as long as the server. A server that spawns processes of its
  own (SGLang: a scheduler and a detokenizer) is started in a process group of its own (``own_group``) and the
  whole group is signalled.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx

TRAINER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID")  # fmt: skip
"""torchrun's variables, removed from a server's environment: a server is not part of the trainer's process
group, and SGLang's tcp:// rendezvous would use the torchelastic agent store if TORCHELASTIC_USE_AGENT_STORE
leaked into it."""
LOG_TAIL_BYTES = 4000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In a child between fork and exec: have the kernel send SIGTERM when the parent (thread) ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _own_group_dying_with_parent() -> None:
    os.setsid()  # own process group: signals reach the server's own child processes too
    die_with_parent()


class ServerStartError(RuntimeError):
    """A server process could not be started, exited during start-up, or did not become healthy in time."""


class ServerProcess:
    """One server child process serving ``model_dir`` on ``port``; see the module docstring.

    Args:
        argv: the command line for (model_dir, weight_version); rebuilt at every start.
        model_dir: Hugging Face directory the server loads at start.
        port: the port the server listens on (its URL is ``http://<url_host>:<port>``).
        log_path: file that receives stdout and stderr (appended).
        weight_version: the version label of the weights in ``model_dir``.
        env: variables set in the server's environment (over the trainer's).
        env_defaults: variables set unless the trainer's environment has them.
        own_group: start the server in a process group of its own and signal the whole group.
        name: how messages name the server.
        startup_timeout_s, startup_timeout_key: ``wait_ready``'s default limit, and the config key that sets it.
        stop_timeout_s: grace period of ``stop()`` between SIGTERM and SIGKILL.
    """

    start_error: type[ServerStartError] = ServerStartError
    """What ``start`` and ``wait_ready`` raise (a subclass names the kind of server)."""

    def __init__(
        self,
        argv: Callable[[Path, str], list[str]],
        *,
        model_dir: str | Path,
        port: int,
        log_path: str | Path,
        weight_version: int | str = "0",
        url_host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        env_defaults: Mapping[str, str] | None = None,
        own_group: bool = False,
        name: str = "rollout server",
        startup_timeout_s: float = 600.0,
        startup_timeout_key: str | None = None,
        stop_timeout_s: float = 10.0,
    ) -> None:
        self.argv = argv
        self.model_dir, self.log_path = Path(model_dir), Path(log_path)
        self.weight_version = str(weight_version)
        """Version label of the weights at ``model_dir``; a restart may point both elsewhere."""
        self.port = port
        self.url = f"http://{url_host}:{port}"
        self.env, self.env_defaults = dict(env or {}), dict(env_defaults or {})
        self.own_group = own_group
        self.name = name
        self.startup_timeout_s, self.startup_timeout_key = startup_timeout_s, startup_timeout_key
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen | None = None
        self._log_offset = 0

    def command(self) -> list[str]:
        """The server's argv for the current ``model_dir`` and ``weight_version``."""
        return self.argv(self.model_dir, self.weight_version)

    def environment(self) -> dict[str, str]:
        """The trainer's environment without torchrun's variables, with ``env_defaults`` and ``env``."""
        env = {k: v for k, v in os.environ.items() if k not in TRAINER_ENV}
        for key, value in self.env_defaults.items():
            env.setdefault(key, value)
        env.update(self.env)
        return env

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self, *, model_dir: str | Path | None = None, weight_version: int | str | None = None) -> str:
        """Start the server (again, on the same port, after a crash or ``stop()``); returns its URL at once.

        ``model_dir`` / ``weight_version`` replace the current ones (a restart from newer weights). Use
        ``wait_ready()`` (or the client's ``wait_healthy``) before sending requests.
        """
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"{self.name} {self.url} is already running (pid {self.process.pid})")
        if self.process is not None and self.own_group:
            # A crashed server may leave its own children behind (holding memory): end them first.
            self._signal(signal.SIGKILL)
        if model_dir is not None:
            self.model_dir = Path(model_dir)
        if weight_version is not None:
            self.weight_version = str(weight_version)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        command = self.command()
        with open(self.log_path, "ab") as log:
            log.write(f"[trustbatch] starting: {shlex.join(command)}\n".encode())
            log.flush()
            try:
                self.process = subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self.environment(),
                    preexec_fn=_own_group_dying_with_parent if self.own_group else die_with_parent,
                )
            except FileNotFoundError as err:
                raise self.start_error(self.not_found_message(command, err)) from err
        return self.url

    def not_found_message(self, command: list[str], err: OSError) -> str:
        """The message when the server's executable does not exist."""
        return f"cannot start {self.name} {self.url}: {command[0]!r} was not found ({err})"

    def exited(self) -> int | None:
        """The exit code once the server process has ended, else None (also None before the first start)."""
        return None if self.process is None else self.process.poll()

    def wait_ready(self, timeout_s: float | None = None, *, poll_s: float = 0.5) -> None:
        """Block until GET /health answers 200; ``start_error`` if the process exits or time runs out."""
        if self.process is None:
            raise RuntimeError("start() the server before waiting for it")
        limit = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        last = "no answer yet"
        with httpx.Client(trust_env=False, timeout=5.0) as http:
            while True:
                code = self.exited()
                if code is not None:
                    raise self.start_error(
                        f"{self.name} {self.url} exited with code {code} during start-up; log "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    response = http.get(self.url + "/health")
                    if response.status_code == 200:
                        return
                    last = f"HTTP {response.status_code}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}"
                if time.monotonic() >= deadline:
                    key = f"{self.startup_timeout_key}; " if self.startup_timeout_key else ""
                    raise self.start_error(
                        f"{self.name} {self.url} not healthy after {limit:g} s ({key}last: {last}); log "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(poll_s)

    def log_tail(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        """The end of what the latest start wrote to the log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(self._log_offset, log.seek(0, os.SEEK_END) - max_bytes))
                return log.read().decode(errors="replace")
        except OSError as err:
            return f"(log unreadable: {err})"

    def kill(self) -> None:
        """SIGKILL the server (its whole group with ``own_group``) and reap it: a hung server ignores SIGTERM."""
        if self.process is not None:
            self._signal(signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM the server, SIGKILL it after ``timeout_s`` (default ``stop_timeout_s``); a no-op if it is
        not running."""
        if self.process is None or self.process.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait()
        if self.own_group:
            # The server is gone; the children of its group must not linger: end the group for good.
            self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        assert self.process is not None
        try:
            if self.own_group:
                os.killpg(self.process.pid, sig)  # the group id is the server's pid (setsid)
            elif self.process.poll() is None:
                self.process.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass


class LocalServerProcess(ServerProcess):
    """The built-in CPU rollout server (``python -m app.cli rollout-server``) serving ``model_dir`` on 127.0.0.1;
    a free port unless ``port`` is given."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch_size: int,
        log_path: str | Path,
        port: int = 0,
        weight_version: int | str = "0",
        dtype: str = "float32",
    ) -> None:
        self.max_batch_size, self.dtype = max_batch_size, dtype
        super().__init__(
            self._argv,
            model_dir=model_dir,
            port=port or free_port(),
            log_path=log_path,
            weight_version=weight_version,
            env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
            name="CPU rollout server",
            own_group=True,  # a terminal's Ctrl-C reaches the trainer alone; the trainer stops it (app/stopping.py)
        )

    def _argv(self, model_dir: Path, weight_version: str) -> list[str]:
        return [sys.executable, "-m", "app.cli", "rollout-server", "--model", str(model_dir),
                "--port", str(self.port), "--max-batch-size", str(self.max_batch_size),
                "--weight-version", weight_version, "--dtype", self.dtype]  # fmt: skip
