"""Rollout servers that die or hang mid-run: the run heals itself, or stops cleanly with its checkpoints intact.

Real processes throughout: the CPU rollout server (`trustbatch rollout-server`) is killed with SIGKILL or
frozen with SIGSTOP from a watcher thread while `app.training.loop.run` trains in the test's own thread.
"""

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from app.rollout.fleet import FleetDownError
from app.rollout.process import LocalServerProcess
from app.rollout.sglang import SGLangClientConfig, connect
from app.training.loop import run
from trainer.checkpoint import COMPLETE_MARKER, list_checkpoints

from .test_loop import small_config

pytestmark = pytest.mark.slow


def rollout_server_children() -> list[int]:
    """PIDs of `trustbatch rollout-server` processes that are children of this test process."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if ppid == os.getpid() and b"rollout-server" in cmdline:
            pids.append(int(entry.name))
    return pids


class Saboteur(threading.Thread):
    """Once `trigger` exists, send `sig` to the run's rollout server (once); records what it did.

    With `freeze_s`, the server is first frozen (SIGSTOP) for that long, so that the run's next request is sent
    and left in flight, and then gets `sig`: a kill then always loses a request, whatever the timing."""

    def __init__(self, trigger: Path, sig: int, pid_of=rollout_server_children, freeze_s: float = 0.0):
        super().__init__(daemon=True)
        self.trigger, self.sig, self.pid_of, self.freeze_s = trigger, sig, pid_of, freeze_s
        self.hit: int | None = None
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            if self.trigger.exists():
                pids = self.pid_of()
                if pids:
                    if self.freeze_s:
                        os.kill(pids[0], signal.SIGSTOP)
                        time.sleep(self.freeze_s)
                    os.kill(pids[0], self.sig)
                    self.hit = pids[0]
                    return
            time.sleep(0.01)


async def wait_healthy(url: str) -> None:
    client = await connect(SGLangClientConfig(urls=[url], health_timeout_s=120))
    await client.close()


FAILURE_CONFIG = [
    "run.steps=8",
    "eval.every=0",
    "eval.greedy=false",
    "rollout.sglang.max_retries=0",  # every lost request surfaces to the fleet, which resubmits it
    "rollout.supervision.watchdog_interval_s=0.2",
]


def test_a_killed_rollout_server_is_restarted_and_the_run_finishes(tmp_path, tiny_model_dir):
    cfg = small_config(tmp_path, tiny_model_dir, *FAILURE_CONFIG)
    # Frozen for 1 s first, so a request is in flight when it dies (a kill between two requests loses none).
    saboteur = Saboteur(tmp_path / "run" / "weights" / "v2", signal.SIGKILL, freeze_s=1.0)
    saboteur.start()
    try:
        summary = run(cfg)
    finally:
        saboteur.stop_event.set()
    assert saboteur.hit is not None, "the server was never killed"
    assert summary["steps"] == 8
    assert summary["server_restarts"] == 1
    assert summary["resubmits"] >= 1  # requests lost with the server were sent again
    # The restarted server served the newest weights, labelled with their version: the lag bound held.
    assert summary["mean_policy_lag"] <= 1.0 and summary["dropped_groups"] == 0


def test_a_hung_rollout_server_is_killed_and_restarted(tmp_path, tiny_model_dir):
    cfg = small_config(tmp_path, tiny_model_dir, *FAILURE_CONFIG, "rollout.supervision.hang_timeout_s=2")
    saboteur = Saboteur(tmp_path / "run" / "weights" / "v2", signal.SIGSTOP)
    saboteur.start()
    try:
        summary = run(cfg)
    finally:
        saboteur.stop_event.set()
    assert saboteur.hit is not None
    assert summary["steps"] == 8 and summary["server_restarts"] == 1
    assert summary["resubmits"] >= 1
    with pytest.raises(ProcessLookupError):  # the frozen process was killed, not left behind
        os.kill(saboteur.hit, 0)


def test_a_server_given_by_url_that_stays_down_stops_the_run_with_checkpoints_intact(tmp_path, tiny_model_dir):
    server = LocalServerProcess(tiny_model_dir, max_batch_size=256, log_path=tmp_path / "server.log")
    url = server.start()
    asyncio.run(wait_healthy(url))
    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        *FAILURE_CONFIG,
        "rollout.engine=sglang",
        f"rollout.sglang.urls=[{url}]",
        "rollout.sglang.health_timeout_s=3",  # how long the run waits for it to come back
        "checkpoint.every=1",
    )
    saboteur = Saboteur(
        tmp_path / "run" / "checkpoints" / "step-000002" / COMPLETE_MARKER,
        signal.SIGKILL,
        pid_of=lambda: [server.process.pid],
    )
    try:
        saboteur.start()
        with pytest.raises(FleetDownError) as info:
            run(cfg)
    finally:
        saboteur.stop_event.set()
        server.stop()
    message = str(info.value)
    assert url in message and "given by URL" in message and "resume" in message
    checkpoints = list_checkpoints(tmp_path / "run" / "checkpoints")
    steps = [step for step, _ in checkpoints]
    # checkpoint.keep_last=2; the run stopped well before its 8 steps, at most a few steps after the kill.
    assert steps and steps[-1] < 8 and len(steps) <= 2
    for _, path in checkpoints:  # every complete checkpoint loads
        assert AutoModelForCausalLM.from_pretrained(path / "model").num_parameters() > 0
