"""Tools in the loop against real SGLang 0.5.23 (CPU): the training loop with the python tool, its episodes sampled
by a launched SGLang server through `/generate` with input ids (token in, token out), tool outputs appended as
tokens the policy did not sample. The model is the tiny one warm-started on the arithmetic task's tool
transcripts; the python tool runs in bubblewrap."""

from __future__ import annotations

import json

import pytest

from app.config import load_config
from app.training.loop import run
from tests.integration.conftest import TOOL_DATA, tool_model_dir  # noqa: F401 - the session's tool model
from tests.sglang.conftest import REPO, SGLANG_PYTHON, sglang_env_missing

pytestmark = pytest.mark.sglang



@pytest.fixture(scope="module")
def tool_model(tool_model_dir):  # noqa: F811 - the session fixture, imported above
    return tool_model_dir


def test_training_with_the_python_tool_through_launched_sglang(tmp_path, tool_model):
    if sglang_env_missing():
        pytest.fail(f"CI must run the real-SGLang tests: {sglang_env_missing()}")
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        *TOOL_DATA, f"run.dir={tmp_path / 'run'}", f"model.path={tool_model}", "run.steps=2", "rollout.max_lag=0",
        "rollout.prompts_per_step=8", "rollout.group_size=4", "trainer.micro_batch_size=32",
        "rollout.max_new_tokens=24", "rollout.max_total_tokens=64", "rollout.max_turns=3",
        "tools=[{name: python, tasks: [math], params: {backend: bwrap}}]", "sandbox.backend=bwrap",
        "eval.every=0", "eval.greedy=false", "eval.samples_per_prompt=1", "checkpoint.every=0",
        "rollout.engine=sglang", "rollout.sglang.launch.num_servers=1", f"rollout.sglang.launch.python={SGLANG_PYTHON}",
        "rollout.sglang.launch.cpu=true", "rollout.sglang.launch.dtype=float32",
        "rollout.sglang.launch.startup_timeout_s=300", "rollout.sglang.weight_sync.method=disk",
    ])  # fmt: skip
    summary = run(cfg)
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["tools/calls_per_trajectory"] > 0.5 and row["rollout/turns/mean"] > 1.5
        # SGLang sampled every model token; the trainer scores them within float32 kernel differences, per turn.
        assert row["loss/logprob_gap_turn/0"] < 1e-3 and row["loss/logprob_gap_turn/1"] < 1e-3
        assert row["rollout/policy_lag/max"] == 0
    sampled = [json.loads(line) for line in (tmp_path / "run" / "eval" / "step-000002-sampled.jsonl").read_text().splitlines()]
    assert any(s["tool_calls"] and "```output" in s["transcript"] for s in sampled)
