"""Ctrl-C to a training run that launched a real SGLang server (CPU): the run says it is stopping, stops, and takes
its SGLang server (a process group of three: server, scheduler, detokenizer) with it."""

from __future__ import annotations

import signal

import pytest

from tests.integration.conftest import REPO, TINY_DATA, tiny_model_dir  # noqa: F401 - the session's tiny model
from tests.integration.test_stopping import interrupt, metrics_lines, processes_mentioning, start, wait_until
from tests.sglang.conftest import SGLANG_PYTHON, sglang_env_missing

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_ctrl_c_stops_training_and_its_launched_sglang_server(tmp_path, tiny_model_dir):  # noqa: F811
    if sglang_env_missing():
        pytest.fail(f"CI must run the real-SGLang tests: {sglang_env_missing()}")
    log = tmp_path / "train.log"

    def run_servers() -> list[str]:  # this run's; the session's own SGLang server may serve other tests meanwhile
        return [c for c in processes_mentioning("sglang.launch_server") if str(tiny_model_dir) in c or str(tmp_path) in c]

    process = start(["train", str(REPO / "configs" / "quickstart.yaml"), *TINY_DATA, f"run.dir={tmp_path / 'run'}",
                     f"model.path={tiny_model_dir}", "run.steps=100000", "rollout.prompts_per_step=8",
                     "rollout.group_size=4", "trainer.micro_batch_size=8", "eval.every=0", "eval.greedy=false",
                     "checkpoint.every=0", "rollout.engine=sglang", "rollout.sglang.launch.num_servers=1",
                     f"rollout.sglang.launch.python={SGLANG_PYTHON}", "rollout.sglang.launch.cpu=true",
                     "rollout.sglang.launch.startup_timeout_s=300"], log)  # fmt: skip
    wait_until(lambda: metrics_lines(tmp_path / "run") >= 2, "two steps", process, log, timeout_s=600)
    assert run_servers(), "the run's SGLang server is running"
    interrupt(process, signal.SIGINT)
    assert process.returncode == 130 and "trustbatch train: SIGINT: stopping" in log.read_text()
    assert processes_mentioning(str(tmp_path)) == [] and run_servers() == []
