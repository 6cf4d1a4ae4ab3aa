"""Start rollout servers the run owns: `trustbatch rollout-server` (the CPU server) as a child process.

`rollout.engine=local` starts one per rank on a free loopback port and talks to it through the same SGLang
client as real SGLang servers (`rollout.engine=sglang`, which connects to `rollout.sglang.urls`). The child
dies with the run: it is terminated in `stop()`, and also when the parent exits (PR_SET_PDEATHSIG).
`start()` may be called again after the child died or was killed: it comes back on the same port, serving
the given `model_dir` labelled `weight_version` (the supervisor in app/rollout/fleet.py passes the newest
published weights). app/rollout/sglang_server.py has the same interface for real SGLang servers.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalServerProcess:
    """One `trustbatch rollout-server` child process serving `model_dir` on 127.0.0.1."""

    def __init__(
        self, model_dir: Path, *, max_batch_size: int, log_path: Path, port: int = 0, weight_version: str = "0"
    ):
        self.model_dir, self.max_batch_size, self.log_path = Path(model_dir), max_batch_size, Path(log_path)
        self.weight_version = str(weight_version)
        """SGLang weight-version label of the weights at `model_dir`; a restart may point both elsewhere."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, *, model_dir: Path | None = None, weight_version: int | str | None = None) -> str:
        """Start the server (again, on the same port); ``model_dir``/``weight_version`` replace the current
        ones (a restart from newer weights). Returns the URL at once; wait for GET /health before using it."""
        if model_dir is not None:
            self.model_dir = Path(model_dir)
        if weight_version is not None:
            self.weight_version = str(weight_version)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)  # the server is not part of the trainer's process group
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "app.cli",
                    "rollout-server",
                    "--model",
                    str(self.model_dir),
                    "--port",
                    str(self.port),
                    "--max-batch-size",
                    str(self.max_batch_size),
                    "--weight-version",
                    str(self.weight_version),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,
            )
        return self.url

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def kill(self) -> None:
        """SIGKILL (a hung server may ignore SIGTERM) and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
