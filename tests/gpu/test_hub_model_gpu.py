"""configs/qwen2.5-0.5b-gsm8k.yaml on one CUDA GPU: smoke training steps, then `serve` and `eval` of the checkpoint.

Skipped without CUDA, without SGLang in the server interpreter, or without the model: nothing is downloaded here.
The model is $TRUSTBATCH_QWEN_DIR (a local Hugging Face directory), else Qwen/Qwen2.5-0.5B-Instruct when the
hub cache already holds it. The data are $GSM8K_DIR/{train,test}.jsonl when given, else the four GSM8K rows of
tests/fixtures/gsm8k_small.jsonl. Run by tests/gpu/run_sglang_gpu.sh (one venv: SGLang + trustbatch).

Covered, each through the command line a user types:
- `trustbatch train` of the config with smoke overrides: 3 asynchronous ESS steps, SGLang on the trainer's GPU,
  weights published from disk, a checkpoint registered in MLflow;
- `trustbatch serve` of the registered checkpoint with --engine sglang: a chat completion through the openai
  client, using the model's chat template;
- `trustbatch eval` of the checkpoint on the held-out file with --engine sglang: pass@1 with its standard error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import wait_for_health

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "qwen2.5-0.5b-gsm8k.yaml"
HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"
FIXTURE = REPO / "tests" / "fixtures" / "gsm8k_small.jsonl"
NAME = "qwen2.5-0.5b-gsm8k"


def _model() -> str | None:
    local = os.environ.get("TRUSTBATCH_QWEN_DIR")
    if local:
        return local if (Path(local) / "config.json").is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(HUB_ID, "config.json")
    except Exception:
        return None
    return HUB_ID if isinstance(hit, str) else None


def _sglang_python() -> str:
    return os.environ.get("TRUSTBATCH_SGLANG_PYTHON", sys.executable)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = _model()
    if model is None:
        pytest.skip(f"no local model: set TRUSTBATCH_QWEN_DIR, or put {HUB_ID} in the hub cache")
    python = _sglang_python()
    if python == sys.executable and importlib.util.find_spec("sglang") is None:
        pytest.skip("no SGLang here: set TRUSTBATCH_SGLANG_PYTHON or install the gpu extra")
    root = tmp_path_factory.mktemp("hub-model")
    data = os.environ.get("GSM8K_DIR")
    train = f"{data}/train.jsonl" if data else str(FIXTURE)
    test = f"{data}/test.jsonl" if data else str(FIXTURE)
    env = {**os.environ, "TRUSTBATCH_QWEN_DIR": os.environ.get("TRUSTBATCH_QWEN_DIR", ""),
           "TRUSTBATCH_SGLANG_PYTHON": python}  # fmt: skip
    if not env["TRUSTBATCH_QWEN_DIR"]:
        env.pop("TRUSTBATCH_QWEN_DIR")
    return {"root": root, "model": model, "train": train, "test": test, "env": env,
            "uri": f"sqlite:///{root / 'mlflow.db'}"}  # fmt: skip


def trustbatch(setup, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=REPO, env=setup["env"], text=True,
                         capture_output=True, timeout=timeout)  # fmt: skip
    assert out.returncode == 0, f"trustbatch {' '.join(args)}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def trained(setup):
    run_dir = setup["root"] / "run"
    trustbatch(
        setup, "train", str(CONFIG), f"run.dir={run_dir}", "run.steps=3", f"model.path={setup['model']}",
        f"data.train={setup['train']}", f"data.eval={setup['test']}", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=256", "trainer.micro_batch_size=8", "eval.every=0",
        "eval.num_prompts=4", "eval.samples_per_prompt=2", "checkpoint.every=3", f"tracking.uri={setup['uri']}",
    )  # fmt: skip
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def test_smoke_steps_of_the_gpu_config_train_and_register(trained):
    run_dir, summary = trained
    assert summary["steps"] == 3 and summary["max_lag"] == 1 and summary["dropped_groups"] == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["rollout/samples"] == 16 and row["rollout/policy_lag/max"] <= 1
        assert 0 < row["loss/ess"] <= 1 + 1e-6
        assert 1 < row["rollout/response_len/mean"] <= 256
    print(f"\nQwen2.5-0.5B GPU smoke: {summary['samples_per_s']:.1f} samples/s, rows {rows[-1]}")

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    assert [v.tags["step"] for v in client.search_model_versions(f"name='{NAME}'")] == ["3"]


def test_serve_the_checkpoint_with_sglang_answers_chat(trained, setup):
    import openai

    from app.rollout.process import free_port

    port = free_port()
    log_path = setup["root"] / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", f"models:/{NAME}@best", "--port", str(port),
             "--tracking-uri", setup["uri"], "--engine", "sglang", "--sglang-python", setup["env"]["TRUSTBATCH_SGLANG_PYTHON"]],
            cwd=REPO, env=setup["env"], stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_health(process, url, log_path, timeout_s=900, what="trustbatch serve --engine sglang")
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
                [model] = client.models.list().data
                out = client.chat.completions.create(
                    model=model.id, messages=[{"role": "user", "content": "What is 12 * 7? Answer briefly."}],
                    max_tokens=64, temperature=0,
                )  # fmt: skip
        finally:
            process.terminate()
            process.wait(timeout=120)
    text = out.choices[0].message.content
    assert text.strip() and "<|im_end|>" not in text
    assert out.choices[0].finish_reason in ("stop", "length") and 0 < out.usage.completion_tokens <= 64


def test_eval_the_checkpoint_with_sglang_on_held_out_gsm8k(trained, setup):
    run_dir, summary = trained
    out_file = setup["root"] / "eval.json"
    trustbatch(
        setup, "eval", summary["checkpoint_dir"], "--config", str(CONFIG), "--data", setup["test"],
        "--k", "1", "--samples", "2", "--max-new-tokens", "256", "--engine", "sglang",
        "--sglang-python", setup["env"]["TRUSTBATCH_SGLANG_PYTHON"], "--out", str(out_file),
        "--tracking-uri", setup["uri"],
    )  # fmt: skip
    report = json.loads(out_file.read_text())
    assert report["num_prompts"] >= 4 and 0.0 <= report["metrics"]["pass@1"]["value"] <= 1.0
    print(f"\nQwen2.5-0.5B eval (after 3 steps): {report['metrics']}")
