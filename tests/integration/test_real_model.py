"""The whole product on the real pretrained SmolLM2-135M-Instruct (`make smollm2`), on CPU, end to end.

One tiny asynchronous ESS run (module fixture `trained`: 2 steps of 2 prompts x 2 samples of builtin:word_problems
chat rows, through the built-in rollout server with max_lag 1, tracked in a SQLite MLflow store under the test's
folder) is shared by every test: the run itself (steps, lag, finite losses, moved weights, a registered model
version), `trustbatch serve` on that registered version answering /v1/chat/completions through the `openai`
client, `trustbatch eval` of the checkpoint on the held-out split, and the run's peak memory.

Without the converted model in the cache the `smollm2_dir` fixture skips these tests (and fails them under CI=true,
where `make smollm2` runs first). Every process uses one torch thread.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from mlflow import MlflowClient
from safetensors import safe_open
from transformers import AutoTokenizer

from app.config import load_config
from app.training.loop import run
from tests.helpers import remove_unless_failed, wait_for_health
from trainer.model import encode_prompt

from .conftest import REPO
from .model_refs import free_port, trustbatch

pytestmark = pytest.mark.slow

NAME = "smollm2-reasoning"
"""run.name of configs/smollm2-reasoning.yaml: the registered model's name too."""
MAX_NEW_TOKENS = 24
SHAPING = "tests.fixtures.plugins.my_verifier:make_verifier"
"""A word-count reward beside math-verify: 24 tokens of a 135M model rarely hold a right \\boxed{} answer, so
without it every group could have equal rewards (zero advantage, dropped) and the weights would not move."""
GIB = 1024**3


@dataclass(frozen=True)
class Trained:
    root: Path
    summary: dict
    tracking_uri: str
    peak_rss: dict[str, int]
    """Peak resident set sizes in bytes, read right after the run: this process, and its largest waited-for child
    (the rollout server, the reward worker)."""

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def checkpoint(self) -> Path:
        return Path(self.summary["checkpoint_dir"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, smollm2_dir, request) -> Trained:
    root = tmp_path_factory.mktemp("real-model")
    request.addfinalizer(lambda: remove_unless_failed(request, root))
    uri = f"sqlite:///{root / 'mlflow.db'}"
    overrides = [
        f"run.dir={root / 'run'}",
        "run.steps=2",
        f"model.path={smollm2_dir}",
        "data.num_train=8",
        "data.num_eval=2",
        "rollout.engine=local",
        "rollout.max_lag=1",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        "trainer.micro_batch_size=4",
        "eval.num_prompts=2",
        "eval.samples_per_prompt=1",
        "eval.greedy=false",
        "checkpoint.every=2",
        f"tracking.uri={uri}",
        "rewards.verifiers=[{name: math, tasks: [math], params: {extraction: [boxed]}}, "
        f"{{name: '{SHAPING}', weight: 0.5, tasks: [math], params: {{target: 40}}}}]",
    ]
    cfg = load_config(REPO / "configs" / "smollm2-reasoning.yaml", overrides)
    assert (cfg.rollout.engine, cfg.rollout.max_lag, cfg.objective.name) == ("local", 1, "ess")
    assert cfg.data.train == "builtin:word_problems"
    summary = run(cfg)
    peak = {  # ru_maxrss is in KiB on Linux
        "self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    }
    return Trained(root, summary, uri, peak)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


# ---------------------------------------------------------------------------------------------- training


def test_async_ess_training_on_word_problems_runs_moves_the_weights_and_registers_the_checkpoint(
    trained, smollm2_dir
):
    summary, run_dir = trained.summary, trained.run_dir
    assert summary["steps"] == 2 and summary["max_lag"] == 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [int(r["step"]) for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/samples"] == 2 * 2
        assert row["rollout/policy_lag/max"] <= 1
        assert math.isfinite(row["loss/ess"]) and 0 < row["loss/ess"] <= 1 + 1e-6, row["loss/ess"]
        assert math.isfinite(row["train/grad_norm"]) and row["train/grad_norm"] >= 0
        # The chat template and stop ids work on the real tokenizer: completions are real text, not a
        # sequence cut at its first token, and never longer than the budget.
        assert 1 < row["rollout/response_len/mean"] <= MAX_NEW_TOKENS, row["rollout/response_len/mean"]
        assert 0 <= row["rollout/truncated_frac"] <= 1
        assert 0 <= row["reward/mean"] <= 1.5
    assert rows[0]["rollout/policy_lag/max"] == 0  # nothing older than the starting weights exists
    assert any(row["train/grad_norm"] > 0 for row in rows)  # the shaping reward gave a signal
    assert summary["dropped_groups"] == 0

    # The server loaded each published version from disk; the trainer's weights moved away from the start.
    assert {"v1", "v2"} <= {d.name for d in (run_dir / "weights").iterdir()}
    assert (run_dir / "rollout-server-rank0.log").is_file()
    moved = 0
    with (
        safe_open(str(smollm2_dir / "model.safetensors"), "pt") as start,
        safe_open(str(trained.checkpoint / "model.safetensors"), "pt") as final,
    ):
        assert set(start.keys()) == set(final.keys())
        for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
            a, b = start.get_tensor(key), final.get_tensor(key)
            assert a.shape == b.shape and a.isfinite().all() and b.isfinite().all()
            moved += not bool((a == b).all())
    assert moved >= 1

    # The checkpoint is a registered model version of the run, with its tags and the alias `best`.
    client = MlflowClient(tracking_uri=trained.tracking_uri)
    [version] = client.search_model_versions(f"name='{NAME}'")
    assert version.tags["step"] == "2" and version.tags["run_id"] == summary["mlflow_run_id"]
    assert 0.0 <= float(version.tags["eval_accuracy"]) <= 1.0
    assert client.get_model_version_by_alias(NAME, "best").version == version.version
    mlflow_run = client.get_run(summary["mlflow_run_id"])
    assert (
        mlflow_run.data.params["objective.name"] == "ess" and mlflow_run.data.params["rollout.max_lag"] == "1"
    )
    assert sorted(m.step for m in client.get_metric_history(summary["mlflow_run_id"], "loss/ess")) == [1, 2]
    assert summary["eval_samples"] == 2 * 1 and 0.0 <= summary["final_accuracy"] <= 1.0


def test_peak_memory_of_the_training_run_stays_well_inside_the_machine(trained):
    peak = trained.peak_rss
    report = {key: round(value / GIB, 3) for key, value in peak.items()}
    (trained.root / "peak_rss.json").write_text(json.dumps({"peak_rss_gib": report}) + "\n")
    print(f"\npeak RSS of the SmolLM2-135M training run (GiB): {report}  -> {trained.root / 'peak_rss.json'}")
    # The trainer (weights, gradients, Adam state, activations of 4 sequences over a 49k vocabulary) and the
    # rollout server each hold a 135M-parameter float32 model: a few GiB, not tens.
    assert 0 < peak["self"] < 8 * GIB
    assert 0 < peak["children"] < 8 * GIB


# ---------------------------------------------------------------------------------------------- serve


@pytest.fixture(scope="module")
def served(trained, tmp_path_factory, request):
    """`trustbatch serve models:/smollm2-reasoning@best` (the run's registered checkpoint), as a user starts it."""
    folder = tmp_path_factory.mktemp("serve")
    request.addfinalizer(lambda: remove_unless_failed(request, folder))
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRUSTBATCH_CACHE_DIR": str(folder / "cache")}
    log_path = folder / "serve.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", f"models:/{NAME}@best", "--port", str(port),
         "--tracking-uri", trained.tracking_uri],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(process, url, log_path, timeout_s=300)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            yield client
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
SERVED = f"{NAME}@best"
"""The served model name: the reference without its scheme."""


def test_serve_answers_chat_completions_with_the_models_chat_template(served, tokenizer):
    assert [m.id for m in served.models.list().data] == [SERVED]
    out = served.chat.completions.create(
        model=SERVED, messages=MESSAGES, max_tokens=48, temperature=0, seed=0, logprobs=True
    )
    [choice] = out.choices
    text = choice.message.content
    assert choice.message.role == "assistant" and text.strip()
    assert "<|im_end|>" not in text and "<|im_start|>" not in text
    # The instruct model ends its turn itself (<|im_end|>, one of the stop ids) well before 48 tokens.
    assert choice.finish_reason == "stop", (choice.finish_reason, text)
    assert out.usage.prompt_tokens == len(encode_prompt(tokenizer, messages=MESSAGES))  # its own template
    assert out.usage.completion_tokens == len(choice.logprobs.content) <= 48
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # A budget cut ends with `length`, the same greedy text cut short.
    short = served.chat.completions.create(
        model=SERVED, messages=MESSAGES, max_tokens=3, temperature=0, seed=0
    )
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert text.startswith(short.choices[0].message.content)

    # Streamed: the role first, then the content in several chunks; together the greedy text, same usage.
    chunks = list(
        served.chat.completions.create(
            model=SERVED, messages=MESSAGES, max_tokens=48, temperature=0, seed=0, stream=True,
            stream_options={"include_usage": True}, logprobs=True,
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    pieces = [c.choices[0].delta.content for c in with_choices if c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == text
    assert with_choices[-1].choices[0].finish_reason == "stop"
    token_events = [c for c in with_choices if c.choices[0].logprobs is not None]
    assert len(token_events) == out.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


# ---------------------------------------------------------------------------------------------- eval


def test_eval_command_scores_the_checkpoint_on_held_out_word_problems(trained, tmp_path):
    out_file = tmp_path / "eval.json"
    out = trustbatch(
        "eval", str(trained.checkpoint), "--data", "builtin:word_problems", "--k", "1", "--samples", "1",
        "--num-prompts", "3", "--max-new-tokens", "16", "--out", str(out_file), "--no-track",
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "pass@1" in out.stdout
    result = json.loads(out_file.read_text())
    assert result["num_prompts"] == 3 and result["settings"]["samples"] == 1
    assert sorted(result["metrics"]) == ["pass@1"]
    assert 0.0 <= result["metrics"]["pass@1"]["value"] <= 1.0
    assert result["reward_error_rate"] == 0.0
    assert 1 <= result["completion_tokens_mean"] <= 16
    for prompt in result["prompts"]:
        assert prompt["id"].startswith("word_problems-test-")  # the held-out split
        assert [m["role"] for m in prompt["messages"]] == ["system", "user"] and prompt["task"] == "math"
        [completion] = prompt["completions"]
        assert completion["finish_reason"] in ("stop", "length") and completion["text"].strip()
        assert "<|im_end|>" not in completion["text"]
