"""Test builders for model references: a real MLflow registry (SQLite) holding tiny checkpoints, a real
server, the `trustbatch` command.

The registry is laid out the way training registers checkpoints (app/tracking.py `register_checkpoint`): a run
whose artifacts hold HF directories under checkpoints/step-NNNNNN, one registered model version per
checkpoint with the tags step, policy_version, eval_accuracy, run_id, and the alias `best` (MLflow refuses an
alias named `latest`: `models:/NAME@latest` means the newest version).
Creating a SQLite store runs MLflow's migrations (seconds), so one store serves every test module of a session.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from .conftest import REPO

MODEL_NAME = "tiny-arithmetic"
CHECKPOINTS = ((1, 0.5), (2, 0.25))
"""(step, eval accuracy) of the registered versions: version 1 is `best`, version 2 the latest."""


@dataclass(frozen=True)
class Registry:
    uri: str
    name: str
    run_id: str
    artifact_root: Path
    """The store's own artifact folder: resolving a reference must never write into it."""
    versions: dict[str, str]
    """alias -> version number."""


_REGISTRIES: dict[Path, Registry] = {}


def make_registry(root: Path, model_dir: Path) -> Registry:
    """A SQLite MLflow store at ``root`` whose registered model holds ``model_dir`` as two checkpoints (cached)."""
    if root in _REGISTRIES:
        return _REGISTRIES[root]
    from mlflow import MlflowClient

    root.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    artifact_root = root / "mlartifacts"
    experiment = client.create_experiment("trustbatch", artifact_location=artifact_root.as_uri())
    run = client.create_run(experiment, run_name="tiny-run")
    run_id = run.info.run_id
    client.create_registered_model(MODEL_NAME)
    versions = {}
    for step, accuracy in CHECKPOINTS:
        path = f"checkpoints/step-{step:06d}"
        client.log_artifacts(run_id, str(model_dir), path)
        mv = client.create_model_version(
            MODEL_NAME,
            source=f"{run.info.artifact_uri}/{path}",
            run_id=run_id,
            tags={
                "step": str(step),
                "policy_version": str(step),
                "eval_accuracy": f"{accuracy:.6f}",
                "run_id": run_id,
            },
        )
        versions[str(step)] = str(mv.version)
    client.set_registered_model_alias(MODEL_NAME, "best", versions["1"])
    client.set_terminated(run_id)
    registry = Registry(
        uri, MODEL_NAME, run_id, artifact_root, {"best": versions["1"], "latest": versions["2"]}
    )
    _REGISTRIES[root] = registry
    return registry


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under ``folder``: equal snapshots mean nothing was written there."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThreadServer:
    """A real uvicorn server for ``app`` on a free loopback port, in a daemon thread."""

    def __init__(self, app) -> None:
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def close(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(timeout=10)


def trustbatch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``trustbatch ARGS`` as a user would (from the repository, one torch thread); output captured."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
