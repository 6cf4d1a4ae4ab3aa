"""The whole synchronous loop for a few steps: real tiny model, real math-verify, real SQLite MLflow store."""

import json

import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from app.config import load_config
from app.loop import run

from .conftest import REPO, TINY_DATA

pytestmark = pytest.mark.slow


def small_config(tmp_path, model_dir, *extra):
    return load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            *TINY_DATA,
            f"run.dir={tmp_path / 'run'}",
            "run.steps=3",
            f"model.path={model_dir}",
            "eval.samples_per_prompt=2",
            "eval.every=2",
            "rollout.prompts_per_step=8",
            "rollout.group_size=4",
            "trainer.micro_batch_size=8",
            "optim.lr=1e-3",
            *extra,
        ],
    )


def test_loop_trains_tracks_and_checkpoints(tmp_path, tiny_model_dir):
    cfg = small_config(tmp_path, tiny_model_dir)
    summary = run(cfg)
    run_dir = tmp_path / "run"

    on_disk = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "initial_accuracy",
        "final_accuracy",
        "eval_samples",
        "initial_greedy_accuracy",
        "final_greedy_accuracy",
        "steps",
        "samples_per_s",
        "wall_s",
        "mlflow_run_id",
    ):
        assert key in on_disk, key
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["steps"] == 3 and on_disk["eval_samples"] == 24 * 2
    assert 0.0 <= on_disk["final_accuracy"] <= 1.0
    assert (run_dir / "training.png").stat().st_size > 1000
    assert load_config(run_dir / "config.yaml") == cfg

    # MLflow: params, a metric per step, the eval steps, the config and the final model as artifacts.
    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    mlflow_run = client.get_run(summary["mlflow_run_id"])
    assert mlflow_run.data.params["optim.lr"] == "0.001"
    assert mlflow_run.data.params["objective.name"] == "ess"
    steps = [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "loss/ess")]
    assert sorted(steps) == [1, 2, 3]
    eval_steps = [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "eval/accuracy")]
    assert sorted(eval_steps) == [0, 2, 3]
    for key in (
        "reward/mean",
        "loss/kl_behaviour",
        "throughput/samples_per_s",
        "timing/train",
        "rollout/policy_lag/max",
    ):
        assert key in mlflow_run.data.metrics, key
    artifacts = {a.path for a in client.list_artifacts(mlflow_run.info.run_id)}
    assert {"config.yaml", "model", "training.png", "summary.json"} <= artifacts

    # The final checkpoint is a plain HF directory whose weights moved away from the start.
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    final = AutoModelForCausalLM.from_pretrained(summary["checkpoint_dir"])
    moved = [not torch.equal(a, b) for a, b in zip(start.parameters(), final.parameters(), strict=True)]
    assert any(moved)


def test_loop_is_reproducible_with_fixed_seeds(tmp_path, tiny_model_dir):
    a = run(small_config(tmp_path / "a", tiny_model_dir, "run.steps=2", "eval.greedy=false"))
    b = run(small_config(tmp_path / "b", tiny_model_dir, "run.steps=2", "eval.greedy=false"))
    assert a["final_accuracy"] == b["final_accuracy"]
    wa = AutoModelForCausalLM.from_pretrained(a["checkpoint_dir"]).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(b["checkpoint_dir"]).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_loop_trains_on_a_user_jsonl_file_with_prompts_and_chat_messages(tmp_path, tiny_model_dir):
    rows = []
    for i, (a, b) in enumerate([(a, b) for a in range(1, 7) for b in range(1, 4)]):
        if i % 2:
            rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
        else:  # chat rows go through the tokenizer's chat template
            rows.append(
                {"messages": [{"role": "user", "content": f"{a}*{b}="}], "answer": a * b, "task": "math"}
            )
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        f"data.train={data}",
        f"data.eval={data}",
        "run.steps=2",
        "eval.num_prompts=10",
        "eval.greedy=false",
    )
    summary = run(cfg)
    assert summary["steps"] == 2 and summary["eval_prompts"] == 10
    assert summary["eval_samples"] == 10 * 2
    assert (tmp_path / "run" / "checkpoints" / "final" / "config.json").is_file()


def test_loop_through_the_cpu_rollout_server_over_sglangs_http_api(tmp_path, tiny_model_dir):
    """rollout.engine=local: the run starts `trustbatch rollout-server`, generates through the SGLang client
    and pushes every new policy version with /update_weights_from_disk."""
    cfg = small_config(tmp_path, tiny_model_dir, "rollout.engine=local", "run.steps=2", "eval.greedy=false")
    summary = run(cfg)
    assert summary["steps"] == 2
    run_dir = tmp_path / "run"
    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    history = client.get_metric_history(summary["mlflow_run_id"], "timing/weight_sync")
    assert sorted(m.step for m in history) == [1, 2]
    # Step 2 was generated by policy version 1: the server really loaded the weights pushed after step 1.
    lags = client.get_metric_history(summary["mlflow_run_id"], "rollout/policy_lag/max")
    assert [m.value for m in sorted(lags, key=lambda m: m.step)] == [0.0, 0.0]
    assert (run_dir / "weights" / "rank0" / "model.safetensors").is_file()
    assert (run_dir / "rollout-server-rank0.log").is_file()
