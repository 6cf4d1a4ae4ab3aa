"""`trustbatch sft` end to end on the tiny model, and on SmolLM2 then RL from its output (CI).

- the run: steps, held-out loss, atomic checkpoints registered as MLflow model versions, the verifier accuracy
  of the held-out prompts through the evaluation `train` and `eval` use, summary.json;
- resume= continues from the last checkpoint to the same weights as an uninterrupted run;
- under torchrun (2 ranks, gloo, FSDP2) the steps give the one-process losses;
- `train` takes the registered reference (models:/NAME/VERSION) as model.path.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from app.config import ConfigError, load_config
from app.training.loop import run
from app.training.sft import run_sft

from .conftest import REPO, TINY_DATA


def _tiny_cfg(tmp_path, model_dir, *extra):
    return load_config(REPO / "configs" / "quickstart.yaml", [
        *TINY_DATA, f"model.path={model_dir}", "model.bootstrap=false", "run.name=tiny-sft",
        f"run.dir={tmp_path / 'sft'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "sft.batch_size=16", "trainer.micro_batch_size=8", "sft.num_eval=16", "optim.lr=1e-3", "data.arithmetic.solutions=worked",
        "checkpoint.every=2", "checkpoint.keep_last=5", "rollout.engine=local", "eval.samples_per_prompt=2",
        *extra,
    ])  # fmt: skip


def _metrics(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_sft_trains_checkpoints_registers_verifies_and_train_takes_its_output(tiny_model_dir, tmp_path):
    cfg = _tiny_cfg(tmp_path, tiny_model_dir, "sft.steps=4", "sft.eval_every=2")
    summary = run_sft(cfg)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = summary["mlflow_run_id"]
    assert [s for s, _ in _metrics(client, run_id, "sft/loss")] == [1, 2, 3, 4]
    held = _metrics(client, run_id, "sft/held_out_loss")
    assert [s for s, _ in held] == [0, 2, 4] and held[-1][1] < held[0][1]  # a new reply format: learnt
    assert summary["held_out_loss_first"] == held[0][1] and summary["held_out_loss_last"] == held[-1][1]
    # Two checkpoints, each a registered version; the last one carries the verifier accuracy.
    root = tmp_path / "sft" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000004"]
    versions = sorted(client.search_model_versions("name='tiny-sft'"), key=lambda v: int(v.version))
    assert [v.tags["step"] for v in versions] == ["2", "4"]
    assert float(versions[-1].tags["eval_accuracy"]) == pytest.approx(summary["sampled_accuracy"])
    assert "greedy_accuracy" in versions[-1].tags
    assert summary["model_ref"] == f"models:/tiny-sft/{versions[-1].version}"
    assert summary["eval_prompts"] == 24 and 0.0 <= summary["greedy_accuracy"] <= 1.0
    assert json.loads((tmp_path / "sft" / "summary.json").read_text())["steps"] == 4
    assert 0.0 <= summary["padding_fraction"] < 0.5

    # RL starts from the registered reference: the weights it loads are the SFT checkpoint's.
    rl = load_config(REPO / "configs" / "quickstart.yaml", [
        *TINY_DATA, f"model.path={summary['model_ref']}", "model.bootstrap=false", f"run.dir={tmp_path / 'rl'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "run.steps=1", "eval.every=0", "checkpoint.every=1",
        "rollout.prompts_per_step=8", "trainer.share_prompts=false",
    ])  # fmt: skip
    rl_summary = run(rl)
    assert rl_summary["steps"] == 1
    sft_weights = load_file(str(root / "step-000004" / "model" / "model.safetensors"))
    assert rl_summary["initial_accuracy"] is not None and sft_weights
    # Each command resumes only its own checkpoints, and says what to do instead.
    with pytest.raises(ConfigError, match=r"is a checkpoint of `train`, not of `sft`"):
        run_sft(_tiny_cfg(tmp_path, tiny_model_dir, f"resume={tmp_path / 'rl'}"))
    with pytest.raises(ConfigError, match=r"is a checkpoint of `trustbatch sft`; .* model\.path="):
        run(replace(rl, resume=str(tmp_path / "sft")))


def test_resume_reaches_the_weights_of_an_uninterrupted_run(tiny_model_dir, tmp_path):
    run_sft(_tiny_cfg(tmp_path / "a", tiny_model_dir, "sft.steps=4", "sft.verify=false"))
    first = run_sft(_tiny_cfg(tmp_path / "b", tiny_model_dir, "sft.steps=4", "sft.verify=false", "run.time_limit_s=1e-9"))
    assert first["steps"] == 1  # stopped after its first step by the time limit, checkpointed there
    resumed = run_sft(_tiny_cfg(tmp_path / "b", tiny_model_dir, "sft.steps=4", "sft.verify=false",
                                f"resume={tmp_path / 'b' / 'sft'}"))  # fmt: skip
    assert resumed["steps"] == 4 and resumed["mlflow_run_id"] == first["mlflow_run_id"]
    a = load_file(str(tmp_path / "a" / "sft" / "checkpoints" / "step-000004" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "sft" / "checkpoints" / "step-000004" / "model" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    client = MlflowClient(f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}")
    assert [s for s, _ in _metrics(client, first["mlflow_run_id"], "sft/loss")] == [1, 2, 3, 4]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_ranks_with_fsdp2_give_the_one_process_losses(tiny_model_dir, tmp_path):
    common = [*TINY_DATA, f"model.path={tiny_model_dir}", "model.bootstrap=false", "run.name=tiny-sft",
              "sft.steps=2", "sft.batch_size=16", "trainer.micro_batch_size=3", "sft.num_eval=10",
              "optim.lr=1e-3", "checkpoint.every=0", "sft.verify=false", "tracking.log_model=false"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}", "-m", "app.cli", "sft", str(REPO / "configs" / "quickstart.yaml"), *common,
        f"run.dir={tmp_path / 'two'}", f"tracking.uri=sqlite:///{tmp_path / 'two.db'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    one = run_sft(load_config(REPO / "configs" / "quickstart.yaml", [
        *common, f"run.dir={tmp_path / 'one'}", f"tracking.uri=sqlite:///{tmp_path / 'one.db'}",
    ]))  # fmt: skip
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    for key in ("train_loss_first", "train_loss_last", "held_out_loss_first", "held_out_loss_last"):
        assert two[key] == pytest.approx(one[key], rel=1e-4), key


# The two SmolLM2 pipelines of docs/real-models.md and docs/tools.md: (SFT config, RL config, SFT extras, RL extras).
# The tool pipeline's SFT takes 6 steps at a high step size so that its model writes programs: the RL steps then run
# them in the real sandbox (Docker, else bubblewrap) and the test counts the calls. The SFT's own held-out evaluation
# (sft.verify) is off: it is tests/integration/test_sft.py's first test, and here it would launch one more server.
PIPELINES = {
    "text": ("smollm2-sft.yaml", "smollm2-math.yaml", ["sft.steps=2"], ["rollout.max_new_tokens=32"]),
    "tools": ("smollm2-tools-sft.yaml", "smollm2-tools.yaml", ["sft.steps=6", "optim.lr=5e-4", "optim.warmup_steps=0"],
              ["rollout.max_new_tokens=48"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_smollm2_sft_then_rl_from_its_output(smollm2_dir, tmp_path, pipeline):
    """The pipeline's SFT config for a few steps, then its RL config for two steps from the registered result."""
    sft_file, rl_file, sft_extra, rl_extra = PIPELINES[pipeline]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sft_cfg = load_config(REPO / "configs" / sft_file, [
        f"model.path={smollm2_dir}", f"run.dir={tmp_path / 'sft'}", f"tracking.uri={uri}", *sft_extra,
        "sft.batch_size=4", "trainer.micro_batch_size=4", "data.num_train=32", "data.num_eval=2", "sft.num_eval=2",
        "eval.num_prompts=2", "sft.verify=false", "run.threads=1",
    ])  # fmt: skip
    assert sft_cfg.data.train == "builtin:word_problems"
    summary = run_sft(sft_cfg)
    steps = sft_cfg.sft.steps
    assert summary["steps"] == steps and summary["model_ref"].startswith(f"models:/{sft_cfg.run.name}/")
    assert summary["train_loss_first"] > 0
    if pipeline == "tools":  # six steps at 5e-4 on transcripts of one shape
        assert summary["train_loss_last"] < summary["train_loss_first"]
    rl = load_config(REPO / "configs" / rl_file, [
        f"model.path={summary['model_ref']}", f"run.dir={tmp_path / 'rl'}", f"tracking.uri={uri}", "run.steps=2",
        "run.time_limit_s=0", "data.num_train=8", "data.num_eval=2", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "trainer.micro_batch_size=8", "eval.num_prompts=2", "eval.samples_per_prompt=1",
        "checkpoint.every=2", "tracking.log_model=false", *rl_extra,
    ])  # fmt: skip
    assert rl.objective.name == "ess" and rl.rollout.max_lag == 1
    rl_summary = run(rl)
    assert rl_summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines() if line]
    assert [int(r["step"]) for r in rows] == [1, 2] and all(r["rollout/samples"] == 8 for r in rows)
    if pipeline == "tools":  # the SFT model writes programs, and the sandbox ran them
        assert [t.name for t in rl.tools] == ["python"]
        assert all(r["tools/calls_per_trajectory"] > 0.5 and r["rollout/turns/mean"] > 1.5 for r in rows), rows
        assert all(r["tools/timeout_rate"] == 0 for r in rows)
    else:
        assert "tools/calls_per_trajectory" not in rows[0]


def test_filter_prompts_keeps_the_prompts_in_the_pass_rate_band(tiny_model_dir, tmp_path):
    """`trustbatch filter-prompts`: n samples of each data.train prompt; the kept ones load as data.train."""
    from typer.testing import CliRunner

    from app.cli import app
    from app.data import load_prompts

    out = tmp_path / "edge.jsonl"
    result = CliRunner().invoke(app, [
        "filter-prompts", str(REPO / "configs" / "quickstart.yaml"), *TINY_DATA, f"run.dir={tmp_path / 'run'}",
        "--model", str(tiny_model_dir), "--n", "4", "--low", "0.25", "--high", "0.75", "--num", "40",
        "--engine", "embedded", "--out", str(out),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    kept = load_prompts(out)
    line = next(x for x in result.output.splitlines() if x.startswith("pass rates of 40 prompts (4 samples each): "))
    counts = dict(part.split(": ") for part in line.split("each): ")[1].split(", "))
    in_band = sum(v for k, v in ((int(k.split("/")[0]), int(v)) for k, v in counts.items()) if 1 <= k <= 3)
    assert sum(int(v) for v in counts.values()) == 40 and len(kept) == in_band
    assert f"kept {in_band} of 40 prompts" in result.output
    assert all(0.25 <= row.metadata["pass_rate"] <= 0.75 for row in kept)
    assert all(row.id.startswith("arithmetic-train-") for row in kept)  # the train split, not the held-out one
    bad = CliRunner().invoke(app, ["filter-prompts", str(REPO / "configs" / "quickstart.yaml"), "--model",
                                   str(tiny_model_dir), "--low", "0.9", "--high", "0.1"])  # fmt: skip
    assert bad.exit_code == 2 and "must satisfy 0 <= low <= high <= 1" in bad.output


def test_the_warm_start_draws_its_batches_in_epochs_or_with_replacement(tmp_path):
    """bench/warm_start.py's two warm starts: the same seed, different batches, so different weights; each is
    deterministic, and an unknown order is refused."""
    from app.training.bootstrap import bootstrap

    cfg = load_config(REPO / "configs" / "quickstart.yaml", [*TINY_DATA, "model.sft.steps=3", "model.sft.batch_size=8"])

    def weights(draws: str, name: str) -> dict:
        out = bootstrap(cfg.model, cfg.data, tmp_path / name, show_progress=False, draws=draws)
        return load_file(str(out / "model.safetensors"))

    epochs, again, replacement = weights("epochs", "a"), weights("epochs", "b"), weights("replacement", "c")
    assert all(torch.equal(epochs[k], again[k]) for k in epochs)
    assert any(not torch.equal(epochs[k], replacement[k]) for k in epochs)
    with pytest.raises(ValueError, match="draws='shuffle' is not one of"):
        bootstrap(cfg.model, cfg.data, tmp_path / "d", show_progress=False, draws="shuffle")
