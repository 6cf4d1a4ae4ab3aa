"""Ctrl-C and SIGTERM, as a terminal sends them (to the command's whole process group), to real `trustbatch`
processes: train, sft, eval and serve say at once that they are stopping, stop, leave no server, reward worker or
sandbox container behind, mark their MLflow run KILLED and exit 128 + the signal; training resumes from its last
complete checkpoint (or from the step it finished under checkpoint.on_stop); a second signal stops at once.

The timings are printed (`-s` shows them), never asserted: the waits below are hang detectors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from .conftest import REPO, TINY_DATA
from .model_refs import free_port

pytestmark = pytest.mark.slow

HANG_S = 120.0
"""How long a stop may take before the test calls it a hang (a stop takes seconds; see bench/README.md)."""


def start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "app.cli", *args], cwd=REPO, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)  # fmt: skip


def wait_until(predicate, what: str, process: subprocess.Popen, log: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if process.poll() is not None:
            pytest.fail(f"the process exited ({process.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {what} after {timeout_s} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def interrupt(process: subprocess.Popen, sig: int = signal.SIGINT, *, twice: bool = False) -> float:
    """Send ``sig`` to the process group (what a terminal's Ctrl-C does); return the seconds until it exited."""
    t0 = time.monotonic()
    os.killpg(process.pid, sig)
    if twice:
        time.sleep(0.3)
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the process did not stop within {HANG_S} s of {signal.Signals(sig).name}")
    took = time.monotonic() - t0
    print(f"stopped in {took:.2f} s")  # noqa: T201 - the measurement the closing note reports
    return took


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text`` (a run's directory, a model path)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(cmdline)
    return found


def metrics_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def run_status(tracking_uri: str, name: str) -> list[str]:
    client = MlflowClient(tracking_uri=tracking_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return [r.info.status for r in runs if r.info.run_name == name]


def train_args(tmp_path: Path, model_dir: Path, *extra: str) -> list[str]:
    return ["train", str(REPO / "configs" / "quickstart.yaml"), *TINY_DATA, f"run.dir={tmp_path / 'run'}",
            f"model.path={model_dir}", "run.steps=100000", "rollout.prompts_per_step=8", "rollout.group_size=4",
            "trainer.micro_batch_size=8", "checkpoint.every=3", "eval.every=0", "run.name=stopme", *extra]  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_training_cleanly_and_resume_continues_from_the_last_checkpoint(tmp_path, tiny_model_dir, sig):
    log = tmp_path / "train.log"
    process = start(train_args(tmp_path, tiny_model_dir), log)
    run_dir = tmp_path / "run"
    wait_until(lambda: metrics_lines(run_dir) >= 5, "five steps", process, log)
    servers = processes_mentioning(f"rollout-server --model {tiny_model_dir}")
    assert servers, "the run's rollout server is running"
    interrupt(process, sig)
    text = log.read_text()
    name = signal.Signals(sig).name
    assert process.returncode == 128 + sig
    assert f"trustbatch train: {name}: stopping; leaving step" in text and "resume= continues from" in text
    assert "stopped during step" in text and f"resume={run_dir}" in text
    assert processes_mentioning(str(tiny_model_dir)) == [], "a server or worker outlived the run"
    assert run_status(f"sqlite:///{tmp_path / 'mlflow.db'}", "stopme") == ["KILLED"]
    done = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert done, "a complete checkpoint to resume from"

    # The next resume= continues from the last complete checkpoint, in the same MLflow run.
    log2 = tmp_path / "resume.log"
    process = start([*train_args(tmp_path, tiny_model_dir), f"resume={run_dir}"], log2)
    wait_until(lambda: "resuming" in log2.read_text() and metrics_lines(run_dir) > 0, "the resume", process, log2)
    wait_until(lambda: json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
               > int(done[-1].split("-")[1]), "a step after the checkpoint", process, log2)  # fmt: skip
    interrupt(process)
    assert f"from {run_dir / 'checkpoints' / done[-1]}" in log2.read_text()
    assert run_status(f"sqlite:///{tmp_path / 'mlflow.db'}", "stopme") == ["KILLED"]


def test_checkpoint_on_stop_finishes_the_step_and_checkpoints_it(tmp_path, tiny_model_dir):
    log = tmp_path / "train.log"
    process = start(train_args(tmp_path, tiny_model_dir, "checkpoint.on_stop=true", "checkpoint.every=0"), log)
    run_dir = tmp_path / "run"
    wait_until(lambda: metrics_lines(run_dir) >= 4, "four steps", process, log)
    interrupt(process)
    text = log.read_text()
    assert process.returncode == 130 and "and checkpointing it (checkpoint.on_stop)" in text
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert f"stopped after step {last}, checkpointed" in text
    assert (run_dir / "checkpoints" / f"step-{last:06d}" / "COMPLETE").is_file()
    assert processes_mentioning(str(tiny_model_dir)) == []


def test_a_second_signal_stops_at_once_and_kills_the_servers(tmp_path, tiny_model_dir):
    log = tmp_path / "train.log"
    process = start(train_args(tmp_path, tiny_model_dir, "checkpoint.on_stop=true"), log)
    wait_until(lambda: metrics_lines(tmp_path / "run") >= 3, "three steps", process, log)
    interrupt(process, twice=True)
    text = log.read_text()
    assert process.returncode == 130 and "SIGINT again: stopping now" in text
    deadline = time.monotonic() + 30  # the killed server's group is reaped by the kernel
    while processes_mentioning(str(tiny_model_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(tiny_model_dir)) == []


def test_a_signal_stops_sft_and_marks_its_run_killed(tmp_path, tiny_model_dir):
    log = tmp_path / "sft.log"
    args = ["sft", str(REPO / "configs" / "quickstart.yaml"), *TINY_DATA, f"run.dir={tmp_path / 'run'}",
            f"model.path={tiny_model_dir}", "sft.steps=100000", "sft.batch_size=16", "trainer.micro_batch_size=16",
            "checkpoint.every=5", "run.name=sftstop", "data.arithmetic.solutions=worked"]  # fmt: skip
    process = start(args, log)
    wait_until(lambda: (tmp_path / "run" / "checkpoints" / "step-000005" / "COMPLETE").exists(), "a checkpoint",
               process, log)  # fmt: skip
    interrupt(process)
    text = log.read_text()
    assert process.returncode == 130 and "trustbatch sft: SIGINT: stopping" in text and "stopped during a step" in text
    assert run_status(f"sqlite:///{tmp_path / 'mlflow.db'}", "sftstop") == ["KILLED"]


def test_a_signal_stops_an_evaluation_and_its_server(tmp_path, tiny_model_dir):
    log = tmp_path / "eval.log"
    process = start(["eval", str(tiny_model_dir), "--engine", "local", "--num-prompts", "2000", "--samples", "16",
                     "--data", "builtin:arithmetic", "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"], log)  # fmt: skip
    wait_until(lambda: processes_mentioning(f"rollout-server --model {tiny_model_dir}") and "eval:" in log.read_text(),
               "sampling", process, log)  # fmt: skip
    interrupt(process)
    assert process.returncode == 130 and "trustbatch eval: SIGINT: stopping" in log.read_text()
    assert processes_mentioning(f"rollout-server --model {tiny_model_dir}") == []


def test_a_signal_stops_serve(tmp_path, tiny_model_dir):
    log = tmp_path / "serve.log"
    port = free_port()
    process = start(["serve", str(tiny_model_dir), "--port", str(port), "--tracking-uri",
                     f"sqlite:///{tmp_path / 'mlflow.db'}"], log)  # fmt: skip

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, "the server", process, log)
    interrupt(process)
    assert process.returncode == 0
    assert "trustbatch serve: SIGINT: stopping; finishing the requests in flight" in log.read_text()
    assert not up()


def test_a_signal_stops_a_tool_run_and_leaves_no_sandbox_container(tmp_path, tool_model_dir):
    """The python tool in docker (bwrap when no engine answers): the pool's warm containers go with the run."""
    from sandbox import available_backends

    backend = "docker" if available_backends()["docker"] is None else "bwrap"
    before = orphaned_containers() if backend == "docker" else set()
    log = tmp_path / "train.log"
    process = start(["train", str(REPO / "configs" / "quickstart.yaml"), *TINY_DATA, "data.arithmetic.solutions=tool",
                     f"run.dir={tmp_path / 'run'}", f"model.path={tool_model_dir}", "run.steps=100000",
                     "rollout.prompts_per_step=8", "rollout.group_size=4", "trainer.micro_batch_size=32",
                     "rollout.max_new_tokens=24", "rollout.max_total_tokens=64", "eval.every=0", "checkpoint.every=0",
                     f"tools=[{{name: python, tasks: [math], params: {{backend: {backend}}}}}]",
                     f"sandbox.backend={backend}"], log)  # fmt: skip
    wait_until(lambda: metrics_lines(tmp_path / "run") >= 2, "two steps", process, log)
    interrupt(process)
    assert process.returncode == 130
    assert processes_mentioning(str(tool_model_dir)) == []
    if backend == "docker":
        assert orphaned_containers() - before == set(), "the run's sandbox containers outlived it"


def orphaned_containers() -> set[str]:
    """Sandbox containers whose owner is gone: no live process holds the lease of the owner they are labelled with
    (other test workers' warm containers have live owners)."""
    import docker

    from sandbox.container import LABEL, OWNER_LABEL, lease_dir
    from sandbox.container import dead_leases as dead_owner_locks

    directory = lease_dir()
    dead = dead_owner_locks(directory, except_owner="")
    for fd in dead.values():
        os.close(fd)
    live = {p.name[: -len(".lock")] for p in directory.glob("*.lock")} - set(dead)
    containers = docker.from_env().containers.list(all=True, filters={"label": LABEL})
    return {c.id for c in containers if c.labels.get(OWNER_LABEL) not in live}
