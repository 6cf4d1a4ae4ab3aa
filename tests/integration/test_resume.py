"""A training process killed with SIGKILL resumes from its last complete checkpoint and finishes the plan.

The interrupted run is a real `trustbatch train` subprocess, killed from outside while it trains. The resumed
run must: continue the same MLflow run; finish the planned steps; never have loaded a partial checkpoint; and,
single process with fixed seeds and the synchronous loop, take its first step exactly as the uninterrupted
run took that step (the optimizer, schedule, RNG, data position and rollout weights all come back).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from app.cli import app
from app.config import load_config
from app.training.loop import run
from tests.helpers import remove_unless_failed
from trainer.checkpoint import COMPLETE_MARKER, checkpoint_problem, list_checkpoints

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


# ---------------------------------------------------------------------------------------------- damaged checkpoints

SHORT = ["run.steps=4", "checkpoint.every=2", "eval.every=0", "eval.greedy=false", "rollout.max_lag=0"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir, request):
    """A real 4-step run with complete checkpoints at steps 2 and 4, to be copied and damaged."""
    base = tmp_path_factory.mktemp("damaged")
    request.addfinalizer(lambda: remove_unless_failed(request, base))
    summary = run(small_config(base, tiny_model_dir, *SHORT, "tracking.log_model=false"))
    assert [step for step, _ in list_checkpoints(base / "run" / "checkpoints")] == [2, 4]
    return base / "run", summary


def copy_of(finished_run, name: str):
    """A copy beside the original (same parent: the same default MLflow store holds its run)."""
    source, _ = finished_run
    target = source.parent / name
    shutil.copytree(source, target)
    return target


def distcp_files(checkpoint):
    files = sorted((checkpoint / "trainer").glob("*.distcp"))
    assert files, list((checkpoint / "trainer").iterdir())
    return files


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "state-json-garbled": (lambda c: (c / "state.json").write_text('{"step": 4, "sched'), "state.json is not valid JSON"),
    "state-json-deleted": (lambda c: (c / "state.json").unlink(), "state.json is missing"),
    "state-json-no-step": (lambda c: (c / "state.json").write_text("{}"), "lacks the step number"),
    "trainer-shard-deleted": (lambda c: distcp_files(c)[0].unlink(), ".distcp is missing"),
    "trainer-shard-truncated": (lambda c: truncate(distcp_files(c)[0]), "is truncated"),
    "trainer-metadata-deleted": (lambda c: (c / "trainer" / ".metadata").unlink(), "trainer/.metadata cannot be read"),
    "rng-deleted": (lambda c: (c / "rng.pt").unlink(), "rng.pt is missing"),
    "weights-deleted": (
        lambda c: [f.unlink() for f in (c / "model").glob("*.safetensors")],
        "model/ lacks config.json or its *.safetensors",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_checkpoint_problem_names_each_kind_of_damage(finished_run, damage):
    run_dir = copy_of(finished_run, f"kind-{damage}")
    checkpoint = list_checkpoints(run_dir / "checkpoints")[-1][1]
    assert checkpoint_problem(checkpoint) is None
    apply, fragment = DAMAGE[damage]
    apply(checkpoint)
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and fragment in problem, problem


@pytest.mark.parametrize("damage", ["state-json-garbled", "trainer-shard-deleted"])
def test_resume_from_a_damaged_last_checkpoint_uses_the_previous_one(finished_run, tiny_model_dir, damage, caplog):
    run_dir = copy_of(finished_run, f"resume-{damage}")
    last = run_dir / "checkpoints" / "step-000004"
    DAMAGE[damage][0](last)

    with caplog.at_level("WARNING", logger="trustbatch"):
        resumed = run(small_config(run_dir.parent, tiny_model_dir, *SHORT, f"resume={run_dir}"))

    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(str(last) in w and DAMAGE[damage][1] in w and "step-000002" in w for w in warnings), warnings
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 4
    assert resumed["mlflow_run_id"] == finished_run[1]["mlflow_run_id"]
    # The damaged one was set aside (kept, never listed again); step 4 was trained again and is whole.
    assert (run_dir / "checkpoints" / "step-000004.damaged").is_dir()
    assert [step for step, _ in list_checkpoints(run_dir / "checkpoints")] == [2, 4]
    assert checkpoint_problem(last) is None


def test_resume_with_every_checkpoint_damaged_stops_with_exit_2_naming_them(finished_run, tiny_model_dir):
    run_dir = copy_of(finished_run, "all-damaged")
    first, second = (path for _, path in list_checkpoints(run_dir / "checkpoints"))
    (first / "state.json").write_text("not json")
    distcp_files(second)[0].unlink()
    overrides = small_overrides(run_dir.parent, tiny_model_dir, *SHORT, f"resume={run_dir}")
    result = CliRunner().invoke(app, ["train", str(REPO / "configs" / "quickstart.yaml"), *overrides])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.exception, result.output)
    output = result.output
    assert f"resume={run_dir}: no checkpoint under {run_dir / 'checkpoints'} can be resumed from" in output
    assert f"{first}: state.json is not valid JSON" in output and f"{second}: trainer/" in output
    assert "without resume" in output and "Traceback" not in output
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
