"""The whole synchronous loop for a few steps: real tiny model, real math-verify, real SQLite MLflow store."""

import json
import logging
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from app.config import load_config
from app.training.lag import PATIENCE
from app.training.loop import run
from app.training.records import summary_lines

from .conftest import REPO, TINY_DATA

pytestmark = pytest.mark.slow


def small_overrides(tmp_path, model_dir, *extra) -> list[str]:
    """quickstart.yaml shrunk to seconds: the tiny task, 8 prompts x 4 samples a step, a high learning rate."""
    return [
        *TINY_DATA,
        f"run.dir={tmp_path / 'run'}",
        "run.steps=3",
        f"model.path={model_dir}",
        "eval.samples_per_prompt=2",
        "eval.every=2",
        "checkpoint.every=2",
        "rollout.prompts_per_step=8",
        "rollout.group_size=4",
        "trainer.micro_batch_size=8",
        "optim.lr=1e-3",
        *extra,
    ]


def small_config(tmp_path, model_dir, *extra):
    return load_config(REPO / "configs" / "quickstart.yaml", small_overrides(tmp_path, model_dir, *extra))


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
        "greedy_accuracy_gain",
        "greedy_accuracy_gain_se",
        "initial_truncated_rate",
        "final_truncated_rate",
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
    # Every evaluation's completions, to read: 24 prompts x 2 samples and one greedy each, at steps 0, 2 and 3.
    written = sorted(p.name for p in (run_dir / "eval").iterdir())
    assert written == [f"step-{s:06d}-{n}.jsonl" for s in (0, 2, 3) for n in ("greedy", "sampled")]
    sampled = [json.loads(line) for line in (run_dir / "eval" / "step-000003-sampled.jsonl").read_text().splitlines()]
    assert len(sampled) == 24 * 2 and {"prompt", "text", "reward", "correct", "breakdown"} <= set(sampled[0])
    assert sum(s["correct"] for s in sampled) == round(on_disk["final_accuracy"] * 48)
    truncated = sum(s["finish_reason"] == "length" for s in sampled) / len(sampled)
    assert on_disk["final_truncated_rate"] == pytest.approx(truncated)
    lines = summary_lines(on_disk)
    assert any(line.startswith("held-out greedy accuracy: ") and "  (gain " in line for line in lines), lines
    assert any(line.startswith("held-out completions cut at max_new_tokens, sampled: ") for line in lines)

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
    assert {"config.yaml", "checkpoints", "training.png", "summary.json"} <= artifacts

    # Every checkpoint (checkpoint.every=2: steps 2 and 3) is a model version with its tags; `best` points at
    # the version with the highest held-out accuracy, and `models:/NAME/latest` at the newest.
    versions = sorted(client.search_model_versions("name='quickstart'"), key=lambda v: int(v.version))
    assert [v.tags["step"] for v in versions] == ["2", "3"]
    assert all(v.tags["run_id"] == summary["mlflow_run_id"] for v in versions)
    accuracies = [float(v.tags["eval_accuracy"]) for v in versions]
    best = client.get_model_version_by_alias("quickstart", "best")
    assert float(best.tags["eval_accuracy"]) == max(accuracies)
    assert best.version == versions[accuracies.index(max(accuracies))].version
    local = tmp_path / "downloaded"
    from mlflow.artifacts import download_artifacts

    source = client.get_model_version_download_uri("quickstart", versions[-1].version)
    model_dir = Path(download_artifacts(artifact_uri=source, dst_path=str(local)))
    assert model_dir.name == "step-000003"
    assert AutoModelForCausalLM.from_pretrained(model_dir).num_parameters() > 0

    # The final checkpoint is a plain HF directory whose weights moved away from the start.
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    final = AutoModelForCausalLM.from_pretrained(summary["checkpoint_dir"])
    moved = [not torch.equal(a, b) for a, b in zip(start.parameters(), final.parameters(), strict=True)]
    assert any(moved)


def final_weights(summary):
    return AutoModelForCausalLM.from_pretrained(summary["checkpoint_dir"]).state_dict()


@pytest.mark.parametrize(
    "mode",
    [
        ["rollout.max_lag=0"],  # synchronous, through the CPU rollout server
        ["rollout.max_lag=2", "rollout.exact_lag=true", "run.steps=4"],  # asynchronous, lag forced to exactly 2
    ],
    ids=["sync", "exact-lag-2"],
)
def test_loop_is_reproducible_with_fixed_seeds(tmp_path, tiny_model_dir, mode):
    a = run(small_config(tmp_path / "a", tiny_model_dir, "run.steps=2", "eval.greedy=false", *mode))
    b = run(small_config(tmp_path / "b", tiny_model_dir, "run.steps=2", "eval.greedy=false", *mode))
    assert a["final_accuracy"] == b["final_accuracy"]
    wa, wb = final_weights(a), final_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sync_loop_gives_the_same_weights_through_the_http_server_and_in_process(tmp_path, tiny_model_dir):
    """max_lag=0 over SGLang's HTTP API (the CPU rollout server) trains exactly like the in-process engine:
    same samples, same behaviour logprobs, same weights after the last step."""
    common = ["run.steps=2", "eval.greedy=false", "rollout.max_lag=0"]
    http = run(small_config(tmp_path / "http", tiny_model_dir, *common, "rollout.engine=local"))
    embedded = run(small_config(tmp_path / "embedded", tiny_model_dir, *common, "rollout.engine=embedded"))
    assert http["final_accuracy"] == embedded["final_accuracy"]
    wa, wb = final_weights(http), final_weights(embedded)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_broadcast_into_the_cpu_rollout_server_trains_exactly_like_updates_from_disk(tmp_path, tiny_model_dir):
    """weight_sync.method=distributed with the built-in server (every version broadcast over gloo into it,
    app/serving/weight_updates.py) against the default disk method. With the lag forced to 2 a run is
    deterministic, so both must sample and train alike; the publication check verifies each version on the way."""
    common = ["run.steps=4", "eval.greedy=false", "rollout.max_lag=2", "rollout.exact_lag=true"]
    disk = run(small_config(tmp_path / "disk", tiny_model_dir, *common))
    gloo = run(small_config(tmp_path / "gloo", tiny_model_dir, *common, "rollout.sglang.weight_sync.method=distributed"))
    assert lag_history(gloo) == lag_history(disk) == [0.0, 1.0, 2.0, 2.0]
    assert gloo["final_accuracy"] == disk["final_accuracy"]
    wa, wb = final_weights(gloo), final_weights(disk)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any((tmp_path / "disk" / "run" / "weights").glob("v*"))
    assert not (tmp_path / "gloo" / "run" / "weights").exists()  # nothing went through the file system


def lag_history(summary) -> list[float]:
    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    lags = client.get_metric_history(summary["mlflow_run_id"], "rollout/policy_lag/max")
    return [m.value for m in sorted(lags, key=lambda m: m.step)]


def test_exact_lag_trains_each_step_on_samples_exactly_k_versions_old(tmp_path, tiny_model_dir):
    summary = run(
        small_config(
            tmp_path, tiny_model_dir, "rollout.max_lag=2", "rollout.exact_lag=true", "run.steps=5", "eval.every=0"
        )
    )
    assert lag_history(summary) == [0.0, 1.0, 2.0, 2.0, 2.0]  # min(k, step - 1): no older weights exist early on
    assert summary["dropped_groups"] == 0


def test_auto_lag_raises_the_bound_as_the_ess_allows_and_records_it(tmp_path, tiny_model_dir):
    """rollout.max_lag=auto with a floor every step clears: the bound starts at 0 (synchronous) and rises by
    one after PATIENCE steps measured at it; no step trains on samples older than the bound its tickets were
    issued under; the bound is logged every step and recorded in the checkpoint and its MLflow model version,
    and a resumed run continues from it."""
    steps = 3 * PATIENCE
    cfg = small_config(
        tmp_path, tiny_model_dir, "rollout.max_lag=auto", "rollout.min_ess=0.01", f"run.steps={steps}",
        "eval.every=0", f"checkpoint.every={steps}", "eval.greedy=false",
    )  # fmt: skip
    summary = run(cfg)
    assert summary["steps"] == steps and summary["max_lag"] == "auto"
    client = MlflowClient(tracking_uri=summary["tracking_uri"])

    def history(key):
        return [m.value for m in sorted(client.get_metric_history(summary["mlflow_run_id"], key), key=lambda m: m.step)]

    bounds, issued, lags = history("rollout/lag_bound"), history("rollout/max_lag"), lag_history(summary)
    assert len(bounds) == len(issued) == len(lags) == steps
    # Steps 1..PATIENCE were all issued under bound 0 (the synchronous loop); then it rose to 1.
    assert issued[:PATIENCE] == [0.0] * PATIENCE and lags[:PATIENCE] == [0.0] * PATIENCE
    assert bounds[:PATIENCE] == [0.0] * (PATIENCE - 1) + [1.0]
    assert bounds == sorted(bounds) and bounds[-1] >= 1.0  # the floor never bit: the bound only rose
    for step in range(steps):  # samples no older than the bound they were issued under, and that bound no
        # larger than the one in force before the step
        assert lags[step] <= issued[step] <= (bounds[step - 1] if step else 0.0), (step, lags, issued, bounds)
    assert summary["mean_max_lag_in_force"] == pytest.approx(sum(issued) / steps)
    state = json.loads((tmp_path / "run" / "checkpoints" / f"step-{steps:06d}" / "state.json").read_text())
    assert state["max_lag_in_force"] == bounds[-1]  # where a resumed run continues
    (version,) = client.search_model_versions(f"name='{cfg.run.name}'")
    assert version.tags["max_lag"] == str(int(bounds[-1]))
    # Resumed for one more step, the run continues at the recorded bound (not at 0).
    more = small_config(
        tmp_path, tiny_model_dir, "rollout.max_lag=auto", "rollout.min_ess=0.01", f"run.steps={steps + 1}",
        "eval.every=0", "eval.greedy=false", "tracking.log_model=false", f"resume={tmp_path / 'run'}",
    )  # fmt: skip
    resumed = run(more)
    assert resumed["resumed_from_step"] == steps
    assert history("rollout/max_lag")[steps] == bounds[-1]  # its first ticket was issued under that bound


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
    assert (tmp_path / "run" / "checkpoints" / "step-000002" / "model" / "config.json").is_file()


def test_async_loop_through_the_cpu_rollout_server_keeps_lag_within_the_bound(tmp_path, tiny_model_dir, caplog):
    """The default: rollout.engine=local, max_lag=1. The run starts `trustbatch rollout-server`, generates
    through the SGLang client while it trains, and pushes every version with /update_weights_from_disk."""
    cfg = small_config(tmp_path, tiny_model_dir, "run.steps=4", "eval.greedy=false")
    assert (cfg.rollout.engine, cfg.rollout.max_lag) == ("local", 1)
    caplog.set_level(logging.INFO, logger="trustbatch")
    summary = run(cfg)
    # Each held-out evaluation reports its progress, counted as the server's responses arrive.
    total = summary["eval_samples"]
    reports = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval at step")]
    assert [r.split(": ")[1].split(",")[0] for r in reports] == [f"{total}/{total} completions"] * 3, reports
    assert [r.split(" (")[0] for r in reports] == ["eval at step 0", "eval at step 2", "eval at step 4"]
    assert summary["steps"] == 4 and summary["max_lag"] == 1
    lags = lag_history(summary)
    assert lags[0] == 0.0 and all(lag <= 1.0 for lag in lags)
    assert summary["dropped_groups"] == 0
    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    run_id = summary["mlflow_run_id"]
    for key in ("timing/weight_sync", "rollout/utilisation", "train/utilisation", "rollout/policy_lag/frac_1"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2, 3, 4], key
    for key in ("rollout/utilisation", "train/utilisation"):  # 0 when a step found its rollouts all done
        values = [m.value for m in client.get_metric_history(run_id, key)]
        assert all(0.0 <= v <= 1.0 + 1e-6 for v in values) and max(values) > 0, (key, values)
    run_dir = tmp_path / "run"
    # The three newest versions stay on disk for restarted servers and slower ranks; older ones are removed.
    assert sorted(d.name for d in (run_dir / "weights").iterdir()) == ["v2", "v3", "v4"]
    assert (run_dir / "rollout-server-rank0.log").is_file()


def test_time_limit_stops_after_the_step_that_crosses_it_and_still_evaluates_and_checkpoints(tmp_path, tiny_model_dir):
    summary = run(small_config(tmp_path, tiny_model_dir, "run.steps=50", "run.time_limit_s=0.001", "eval.greedy=false"))
    assert summary["steps"] == 1  # the first step already crossed the limit
    assert summary["checkpoint_dir"].endswith("step-000001/model")
    assert AutoModelForCausalLM.from_pretrained(summary["checkpoint_dir"]).num_parameters() > 0
    assert 0.0 <= summary["final_accuracy"] <= 1.0


def test_reference_kl_pulls_toward_the_starting_model(tmp_path, tiny_model_dir):
    """objective.ref_kl_coef > 0: the run keeps a frozen copy of its starting weights and trains with the penalty
    (issue 40's bisection): zero on the first step, when the policy is still the reference, positive after."""
    summary = run(small_config(tmp_path, tiny_model_dir, "objective.ref_kl_coef=0.1", "rollout.max_lag=0"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and [row["step"] for row in rows] == [1, 2, 3]
    assert rows[0]["loss/ref_kl"] == pytest.approx(0.0, abs=1e-9)
    assert rows[1]["loss/ref_kl"] > 0 and rows[2]["loss/ref_kl"] > 0
