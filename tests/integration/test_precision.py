"""bfloat16 compute: the trainer's autocast over float32 weights (trainer.compute_dtype) and the built-in
engines in bf16 (rollout.dtype), on real tiny models."""

import subprocess
import sys

import httpx
import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from app.config import ConfigError, load_config
from app.rollout.base import SamplingParams, WeightSource
from app.rollout.embedded import EmbeddedEngine
from app.rollout.process import LocalServerProcess
from app.training.loop import run
from tests.integration.dist_worker import build_batch, build_model
from tests.integration.test_loop import small_config
from trainer.distributed import LocalReducer
from trainer.logprobs import shared_prefix_token_logprobs, token_logprobs
from trainer.objective import ObjectiveConfig
from trainer.precision import compute
from trainer.sft import Example, held_out_loss, plan_sft_step, sft_step
from trainer.step import TrainerConfig, train_step

from .conftest import REPO


def _sgd_step(cfg: TrainerConfig, shared: int = 0):
    model = build_model(0)
    batch = build_batch(model, shared_prompts=shared)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, ObjectiveConfig(name="ess"),
                         LocalReducer(), cfg)  # fmt: skip
    return model, metrics, {k: before[k] - p.detach() for k, p in model.named_parameters()}


def _cosine(a: dict, b: dict) -> float:
    x = torch.cat([v.flatten() for v in a.values()])
    y = torch.cat([b[k].flatten() for k in a])
    return float(x @ y / (x.norm() * y.norm()))


def test_bf16_compute_gives_float32_logprobs_near_the_float32_ones():
    model = build_model(0)
    batch = build_batch(model)
    with torch.no_grad():
        exact, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
        with compute(model, "bfloat16"):
            assert torch.is_autocast_enabled("cpu")
            approx, entropy = token_logprobs(model, batch.input_ids, batch.attention_mask, with_entropy=True)
            shared, _ = shared_prefix_token_logprobs(
                model, batch.input_ids, batch.attention_mask, batch.loss_mask
            )
    assert approx.dtype == entropy.dtype == shared.dtype == torch.float32
    gap = (approx - exact)[batch.loss_mask].abs()
    assert 0 < float(gap.max()) < 0.1  # bf16 rounding shows, and stays small
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with compute(model, "float32"):
        assert not torch.is_autocast_enabled("cpu")


def test_bf16_weights_need_no_autocast():
    model = build_model(0).to(torch.bfloat16)
    with compute(model, "bfloat16"):
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("shared", [0, 3], ids=["padded", "shared-prompts"])
def test_bf16_train_step_updates_float32_weights_along_the_float32_gradient(shared):
    exact_model, exact_metrics, exact = _sgd_step(
        TrainerConfig(max_grad_norm=0.0, share_prompts=bool(shared)), shared
    )
    model, metrics, approx = _sgd_step(
        TrainerConfig(max_grad_norm=0.0, share_prompts=bool(shared), compute_dtype="bfloat16"), shared
    )
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())
    assert approx.keys() == exact.keys()
    assert any(not torch.equal(approx[k], exact[k]) for k in exact)  # the forward really ran in bf16
    assert _cosine(approx, exact) > 0.99
    assert metrics["loss/ess"] == pytest.approx(exact_metrics["loss/ess"], abs=0.02)
    assert metrics["train/num_tokens"] == exact_metrics["train/num_tokens"]


def test_bf16_sft_step_and_held_out_loss():
    model = build_model(0)
    examples = [Example(ids=(1, 5, 9, 4, 7, 2), start=3), Example(ids=(3, 8, 8, 6, 2), start=2)]
    plan = plan_sft_step(examples, 2, pad_id=0, reducer=LocalReducer())
    exact = held_out_loss(model, examples, 2, 0)
    approx = held_out_loss(model, examples, 2, 0, compute_dtype="bfloat16")
    assert approx != exact and approx == pytest.approx(exact, rel=0.02)
    metrics = sft_step(model, torch.optim.SGD(model.parameters(), lr=0.1), plan, max_grad_norm=1.0,
                       compute_dtype="bfloat16")  # fmt: skip
    assert metrics["sft/loss"] == pytest.approx(approx, rel=0.02)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("key", ["trainer.compute_dtype", "rollout.dtype"])
def test_a_bad_dtype_is_refused_with_its_key(tmp_path, key):
    path = tmp_path / "c.yaml"
    path.write_text("run: {name: x}\n")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(path, [f"{key}=float16"])


def test_embedded_engine_in_bf16_casts_each_publish(model_dirs):
    engine = EmbeddedEngine.from_pretrained(model_dirs[0], dtype=torch.bfloat16)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=3)
    outs = engine.generate_sync([[5, 6, 7]], params)
    assert len(outs) == 2 and all(len(o.output_logprobs) == len(o.output_ids) >= 1 for o in outs)
    reference = build_model(0)  # any float32 state of another shape must still be refused
    with pytest.raises(ValueError):
        engine.update_weights_sync(WeightSource(state_dict=reference.state_dict()), version=1)
    fp32 = EmbeddedEngine.from_pretrained(model_dirs[1])
    state = {k: v.clone() for k, v in fp32.model.state_dict().items()}
    engine.update_weights_sync(WeightSource(state_dict=state), version=2)
    assert engine.policy_version == 2
    for name, param in engine.model.state_dict().items():
        assert param.dtype == torch.bfloat16
        torch.testing.assert_close(param, state[name].to(torch.bfloat16), rtol=0, atol=0)


def test_rollout_server_runs_in_bf16_and_keeps_it_across_updates(model_dirs, tmp_path):
    server = LocalServerProcess(
        model_dirs[0], max_batch_size=8, log_path=tmp_path / "server.log", dtype="bfloat16"
    )
    server.start()
    try:
        server.wait_ready()
        assert httpx.get(f"{server.url}/server_info").json()["dtype"] == "bfloat16"
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
        assert httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["meta_info"][
            "completion_tokens"
        ]
        update = httpx.post(f"{server.url}/update_weights_from_disk", timeout=60,
                            json={"model_path": str(model_dirs[1]), "weight_version": "1"})  # fmt: skip
        assert update.status_code == 200, update.text
        info = httpx.get(f"{server.url}/server_info").json()
        assert info["dtype"] == "bfloat16"
        out = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
        assert out["meta_info"]["weight_version"] == "1"
    finally:
        server.stop()


def test_rollout_server_refuses_an_unknown_dtype(model_dirs):
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "rollout-server", "--model", str(model_dirs[0]), "--dtype", "float16"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "--dtype 'float16'" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_loop_trains_with_bf16_on_both_sides(tmp_path, tiny_model_dir):
    """Both keys through the real loop: the local server samples in bf16 (and keeps it across every publish),
    the trainer computes in bf16 over float32 weights, and the checkpoint it writes is float32."""
    cfg = small_config(tmp_path, tiny_model_dir, "rollout.dtype=bfloat16", "trainer.compute_dtype=bfloat16",
                       "eval.greedy=false")  # fmt: skip
    assert cfg.rollout.engine == "local"
    summary = run(cfg)
    assert summary["steps"] == 3
    log = (tmp_path / "run" / "rollout-server-rank0.log").read_text()
    assert "--dtype bfloat16" in log
    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    ess = [m.value for m in client.get_metric_history(summary["mlflow_run_id"], "loss/ess")]
    # Step 1 learns from the starting weights (lag 0): what is left is the bf16 engine against the bf16 trainer.
    assert len(ess) == 3 and ess[0] > 0.99
    saved = AutoModelForCausalLM.from_pretrained(
        next((tmp_path / "run" / "checkpoints").glob("step-*")) / "model"
    )
    assert {p.dtype for p in saved.parameters()} == {torch.float32}
