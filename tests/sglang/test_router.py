"""sglang-router 0.3.2 in front of two real SGLang 0.5.23 CPU servers (`rollout.sglang.router`).

One fleet for the module: two servers of a tiny model warm-started on the arithmetic task's tool transcripts (launched
by trustbatch's launcher) and the router over them (round robin, health checks every 2 s). In order:
- generation through the router carries logprobs that match the trainer's and each completion's weight_version;
- a weight update from disk, and one over gloo, reach both workers (each worker's /model_info version and its
  probe log-probabilities), because the client sends them to the workers the router lists: the router itself
  answers 404 to the weight-update routes (checked here too, so an sglang-router that starts forwarding them
  shows up);
- tool episodes through the router: the training loop with the python tool (bubblewrap), each turn's `/generate`
  with input ids landing on either worker, the tool outputs appended as tokens, the trainer's log-probabilities
  matching the engine's on every model token, turn by turn;
- the training loop through the router, with one worker SIGKILLed after the first step, finishes its steps:
  generation goes on through the router, and each later version goes to the worker that is left, from disk
  and over gloo (the group re-forms without the dead worker); the worker is restarted between the two.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from app.config import load_config
from app.rollout.base import SamplingParams, WeightSource
from app.rollout.joint import reference_logprobs
from app.rollout.probe import gap
from app.rollout.sglang import SGLangClient, SGLangClientConfig, WeightSyncConfig
from app.rollout.sglang_server import SGLangLaunchConfig, SGLangServerProcess
from app.rollout.weight_sync import DistributedWeightSync
from app.training.loop import run
from tests.integration.conftest import tool_model_dir  # noqa: F401 - the session's tool model
from tests.integration.test_loop import small_overrides
from tests.integration.test_tool_rollouts import tool_config
from tests.sglang.conftest import REPO, SGLANG_PYTHON, load_model, sglang_env_missing, worst_logprob_gap

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
READY_S = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Fleet:
    def __init__(self, servers, router: subprocess.Popen, url: str, log: Path) -> None:
        self.servers, self.router, self.url, self.log = servers, router, url, log

    @property
    def worker_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def version(self, url: str) -> str:
        return httpx.get(f"{url}/model_info", timeout=30).json()["weight_version"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tool_model_dir):  # noqa: F811
    if sglang_env_missing():
        pytest.fail(f"CI must run the real-SGLang tests: {sglang_env_missing()}")
    logs = tmp_path_factory.mktemp("router")
    launch = SGLangLaunchConfig(num_servers=2, python=str(SGLANG_PYTHON), cpu=True, dtype="float32", random_seed=0,
                                startup_timeout_s=READY_S)  # fmt: skip
    # The router starts first (it registers workers as they come up, retrying every few seconds), so its own
    # start-up overlaps theirs.
    servers = [SGLangServerProcess(tool_model_dir, launch, index=i, log_path=logs / f"sglang-{i}.log") for i in (0, 1)]
    port, log = _free_port(), logs / "router.log"
    router = subprocess.Popen(
        [str(SGLANG_PYTHON), "-m", "sglang_router.launch_router", "--worker-urls", *[s.url for s in servers],
         "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(_free_port()), "--policy", "round_robin", "--health-check-interval-secs", "2",
         "--log-level", "warn"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(READY_S)
        deadline = time.monotonic() + READY_S
        while True:  # /readiness: 200 once both workers are registered and healthy (/health is 200 before)
            assert router.poll() is None, f"the router exited ({router.returncode}):\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/readiness", timeout=5).json().get("healthy_workers") == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, f"the router was not ready in {READY_S} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield Fleet(servers, router, url, log)
    finally:
        os.killpg(router.pid, signal.SIGKILL)
        router.wait()
        for server in servers:
            server.stop()


def _client(fleet: Fleet) -> SGLangClient:
    return SGLangClient(SGLangClientConfig(router=fleet.url, timeout_s=120.0, health_timeout_s=60.0))


def test_generation_through_the_router_carries_logprobs_and_versions(fleet, tool_model_dir):  # noqa: F811
    async def main():
        async with _client(fleet) as client:
            await client.wait_healthy()
            assert sorted(client.urls) == sorted(fleet.worker_urls)  # read from GET /workers
            params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=3)
            return [c for _ in range(4) for c in await client.generate([[5, 6, 7], [8, 9]], params)]

    completions = asyncio.run(main())
    assert len(completions) == 16 and all(c.policy_version == 0 for c in completions)
    assert all(len(c.output_logprobs) == len(c.output_ids) > 0 for c in completions)
    assert worst_logprob_gap(completions, load_model(tool_model_dir)) < 1e-3


def test_updates_from_disk_and_over_gloo_reach_both_workers(fleet, tool_model_dir, tmp_path):  # noqa: F811
    model = load_model(tool_model_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    moved = tmp_path / "moved"
    shutil.copytree(tool_model_dir, moved)
    model.save_pretrained(moved)  # the moved weights over the copy's
    # The router itself has no route for it: the reason the client goes to the workers.
    direct = httpx.post(f"{fleet.url}/update_weights_from_disk", json={"model_path": str(moved)}, timeout=30)
    assert direct.status_code == 404 and {fleet.version(u) for u in fleet.worker_urls} == {"0"}

    probe = [5, 6, 7, 8, 9, 10]
    reference = {"moved": reference_logprobs(model, probe), "start": reference_logprobs(load_model(tool_model_dir), probe)}

    async def main():
        async with _client(fleet) as client:
            await client.wait_healthy()
            await client.update_weights(WeightSource(path=moved), 3)
            after_disk = await client.score(probe)
            sync = await DistributedWeightSync.connect(client, WeightSyncConfig(method="distributed", backend="gloo"))
            try:
                start = {k: v.clone() for k, v in load_model(tool_model_dir).state_dict().items()}
                await sync.push(start, 4)
            finally:
                await sync.close()
            after_gloo = await client.score(probe)
            through_router = await client.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, n=2, seed=1))
            return after_disk, after_gloo, through_router

    after_disk, after_gloo, through_router = asyncio.run(main())
    assert sorted(r.server for r in after_disk) == sorted(fleet.worker_urls)
    assert all(r.weight_version == "3" and gap(r.logprobs, reference["moved"]) < 1e-4 for r in after_disk)
    assert all(r.weight_version == "4" and gap(r.logprobs, reference["start"]) < 1e-4 for r in after_gloo)
    assert gap(reference["moved"], reference["start"]) > 1e-2  # the two versions are told apart
    assert {fleet.version(u) for u in fleet.worker_urls} == {"4"}
    assert all(c.policy_version == 4 for c in through_router)


def test_tool_episodes_through_the_router_keep_the_engines_tokens(fleet, tool_model_dir, tmp_path):  # noqa: F811
    asyncio.run(_reset(fleet, tool_model_dir))
    cfg = tool_config(
        tmp_path, tool_model_dir, "run.steps=2", "rollout.max_lag=0", "eval.greedy=false", "eval.samples_per_prompt=1",
        "rollout.engine=sglang", f"rollout.sglang.router={fleet.url}", "rollout.sglang.health_timeout_s=60",
        "rollout.sglang.weight_sync.method=disk",
    )  # fmt: skip
    summary = run(cfg)
    assert summary["steps"] == 2 and summary["dropped_groups"] == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["tools/calls_per_trajectory"] > 0.5 and row["rollout/turns/mean"] > 1.5
        # SGLang sampled every model token, on whichever worker the router chose for the turn; the trainer scores
        # them within float32 kernel differences, turn by turn.
        assert row["loss/logprob_gap_turn/0"] < 1e-3 and row["loss/logprob_gap_turn/1"] < 1e-3
        assert row["rollout/policy_lag/max"] == 0 and row["weights/probe_gap"] < 1e-3
    sampled = [json.loads(line) for line in (tmp_path / "run" / "eval" / "step-000002-sampled.jsonl").read_text().splitlines()]
    assert any(s["tool_calls"] and "```output" in s["transcript"] for s in sampled)
    assert {fleet.version(u) for u in fleet.worker_urls} == {"2"}  # both workers took every version


@pytest.mark.parametrize("method", ["disk", "distributed"])
def test_training_through_the_router_survives_a_worker_killed_behind_it(
    fleet, tool_model_dir, tmp_path, caplog, method  # noqa: F811
):
    """distributed: the group of both workers ends when one dies, and a new one forms with the one left."""
    victim = fleet.servers[1]
    if victim.exited() is not None:  # killed by the previous case: back on the same URL, the router takes it again
        victim.start()
        victim.wait_ready(READY_S)
        deadline = time.monotonic() + READY_S
        while httpx.get(f"{fleet.url}/readiness", timeout=5).json().get("healthy_workers") != 2:
            assert time.monotonic() < deadline, "the router did not take the restarted worker back"
            time.sleep(0.5)
    # Earlier tests left other versions on the workers; the run starts from the model at version 0.
    asyncio.run(_reset(fleet, tool_model_dir))
    cfg = load_config(REPO / "configs" / "quickstart.yaml", small_overrides(
        tmp_path, tool_model_dir, "run.steps=4", "eval.every=0", "eval.greedy=false", "eval.num_prompts=8",
        "checkpoint.every=0", "rollout.max_lag=1", "rollout.engine=sglang", f"rollout.sglang.router={fleet.url}",
        "rollout.sglang.health_timeout_s=60", f"rollout.sglang.weight_sync.method={method}",
        "rollout.sglang.weight_sync.backend=gloo",
    ))  # fmt: skip
    metrics = tmp_path / "run" / "metrics.jsonl"

    def kill_after_the_first_step():
        while not (metrics.is_file() and metrics.read_text().strip()):
            time.sleep(0.1)
        victim.kill()

    killer = threading.Thread(target=kill_after_the_first_step, daemon=True)
    killer.start()
    with caplog.at_level(logging.WARNING):
        summary = run(cfg)
    killer.join(timeout=5)
    assert victim.exited() is not None  # it really died mid-run
    assert summary["steps"] == 4 and summary["dropped_groups"] == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(row["weights/probe_gap"] < 1e-3 for row in rows)  # the worker left held every version
    assert max(row["rollout/policy_lag/max"] for row in rows) <= 1
    assert f"worker {victim.url} behind the router {fleet.url} does not answer GET /health: it gets no weights" in caplog.text


async def _reset(fleet: Fleet, model_dir: Path) -> None:
    async with _client(fleet) as client:
        await client.wait_healthy()
        await client.update_weights(WeightSource(path=model_dir), 0)

