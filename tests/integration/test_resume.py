"""A training process killed with SIGKILL resumes from its last complete checkpoint and finishes the plan.

The interrupted run is a real `trustbatch train` subprocess, killed from outside while it trains. The resumed
run must: continue the same MLflow run; finish the planned steps; never have loaded a partial checkpoint; and,
single process with fixed seeds and the synchronous loop, take its first step exactly as the uninterrupted
run took that step (the optimizer, schedule, RNG, data position and rollout weights all come back).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from app.config import load_config
from app.loop import run
from trainer.checkpoint import COMPLETE_MARKER, list_checkpoints

from .conftest import REPO
from .test_loop import small_config, small_overrides

pytestmark = pytest.mark.slow

PLAN = ["run.steps=30", "eval.every=0", "eval.greedy=false", "rollout.max_lag=0", "checkpoint.every=4"]
COMPARED = ("loss/total", "loss/policy", "train/grad_norm", "reward/mean", "train/num_tokens", "loss/ess")


def metrics_by_step(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {int(r["step"]): r for r in rows}


def test_sigkill_mid_run_then_resume_finishes_the_plan_and_matches_the_uninterrupted_run(tmp_path, tiny_model_dir):
    reference = run(small_config(tmp_path / "reference", tiny_model_dir, *PLAN))

    # The same run as a user starts it, killed once it is a few steps past a checkpoint.
    run_dir = tmp_path / "killed" / "run"
    command = [sys.executable, "-m", "app.cli", "train", str(REPO / "configs" / "quickstart.yaml")]
    command += small_overrides(tmp_path / "killed", tiny_model_dir, *PLAN)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and process.poll() is None:
            done = metrics_by_step(run_dir) if (run_dir / "metrics.jsonl").is_file() else {}
            if any(step >= 10 for step in done):
                break
            time.sleep(0.05)
        assert process.poll() is None, process.stdout.read().decode()[-3000:]
        process.send_signal(signal.SIGKILL)
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
    killed_at = max(metrics_by_step(run_dir))
    assert killed_at < 30

    # Only complete checkpoints carry a final name; each of them loads.
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    assert checkpoints, "no checkpoint was complete when the process was killed"
    for child in (run_dir / "checkpoints").iterdir():
        assert child.name.startswith(".") or (child / COMPLETE_MARKER).is_file(), child
    for _, path in checkpoints:
        AutoModelForCausalLM.from_pretrained(path / "model")
        assert load_config(path / "config.yaml").run.steps == 30
    last = checkpoints[-1][0]
    run_id = json.loads((checkpoints[-1][1] / "state.json").read_text())["mlflow_run_id"]

    # Resumed as a user would: the same config, plus resume=<run dir>.
    resumed = run(small_config(tmp_path / "killed", tiny_model_dir, *PLAN, f"resume={run_dir}"))
    assert resumed["steps"] == 30 and resumed["resumed_from_step"] == last
    assert resumed["mlflow_run_id"] == run_id

    # The first resumed step is the uninterrupted run's step, to float32 round-off.
    first = metrics_by_step(run_dir)[last + 1]
    expected = metrics_by_step(tmp_path / "reference" / "run")[last + 1]
    for key in COMPARED:
        assert first[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    # And so is where it ends.
    a = AutoModelForCausalLM.from_pretrained(resumed["checkpoint_dir"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(reference["checkpoint_dir"]).state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert resumed["final_accuracy"] == pytest.approx(reference["final_accuracy"], abs=0.05)

    # One MLflow run holds every step; the resumed steps were logged at their own step numbers.
    client = MlflowClient(tracking_uri=resumed["tracking_uri"])
    steps = {m.step for m in client.get_metric_history(run_id, "loss/total")}
    assert steps == set(range(1, 31))
    assert client.get_run(run_id).info.status == "FINISHED"


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, tiny_model_dir):
    from app.config import ConfigError

    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        run(small_config(tmp_path, tiny_model_dir, f"resume={tmp_path / 'empty'}"))
    with pytest.raises(ConfigError, match="not a directory, and not a run"):
        run(small_config(tmp_path, tiny_model_dir, "resume=0123456789abcdef"))
