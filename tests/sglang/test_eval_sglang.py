"""`trustbatch eval --engine sglang` against real SGLang 0.5.23 (CPU, float32) that the command launches itself.

The evaluation samples through app/evaluation/run.py `sample_and_score`, the code training's held-out evaluation
uses, with an SGLangClient in place of the in-process engine. Covered: the command end to end (a launched
server, the table, the JSON) giving, at temperature 0, the same completions and scores as the embedded engine
(both engines run the same float32 weights; their logprobs agree to ~5e-7, see test_generate.py, far from
any argmax tie over these few tokens); sampled pass@k through the library call against running servers
named by URL (the session's server: nothing launched), n draws per prompt and pass@k from the per-prompt
counts.
"""

from __future__ import annotations

import json

import pytest

from app.config import load_config
from app.evaluation.command import evaluate_model
from app.evaluation.metrics import pass_at_k
from tests.integration.conftest import tiny_model_dir  # noqa: F401 - the bootstrapped tiny model fixture
from tests.integration.model_refs import trustbatch
from tests.sglang.conftest import SGLANG_PYTHON, client_config, sglang_env_missing

pytestmark = pytest.mark.sglang

NO_STORE = "sqlite:////nonexistent/mlflow.db"  # a directory reference needs no store


def settings(*overrides: str):
    """The config `trustbatch eval` builds (its --k, --num-prompts, ... as config keys)."""
    return load_config(None, ["eval.greedy=false", "eval.seed=0", *overrides])


@pytest.fixture(autouse=True)
def _require_env():
    if sglang_env_missing():
        # Reached only under CI=true (otherwise conftest skips these tests without the environment).
        pytest.fail(f"CI must run the real-SGLang tests: {sglang_env_missing()}")


def test_eval_command_through_launched_sglang_matches_the_embedded_engine(tmp_path, tiny_model_dir):  # noqa: F811
    greedy = settings(
        "eval.k=1", "eval.samples_per_prompt=1", "eval.num_prompts=8", "eval.temperature=0", "eval.max_new_tokens=8"
    )
    embedded = evaluate_model(str(tiny_model_dir), greedy.eval_job, tracking_uri=NO_STORE)
    embedded_texts = [[s.text for s in group] for group in embedded.by_prompt]
    embedded_verdicts = [[s.correct for s in group] for group in embedded.by_prompt]
    out_file = tmp_path / "sglang.json"
    out = trustbatch(
        "eval", str(tiny_model_dir), "--engine", "sglang", "--sglang-python", str(SGLANG_PYTHON),
        "--k", "1", "--num-prompts", "8", "--temperature", "0", "--max-new-tokens", "8",
        "--out", str(out_file), "--no-track",
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "pass@1" in out.stdout and "engine sglang" in out.stdout
    result = json.loads(out_file.read_text())
    assert result["settings"]["engine"] == "sglang" and result["num_prompts"] == 8
    served = [[c["text"] for c in prompt["completions"]] for prompt in result["prompts"]]
    assert served == embedded_texts
    assert [[c["correct"] for c in prompt["completions"]] for prompt in result["prompts"]] == embedded_verdicts
    assert result["metrics"]["pass@1"]["value"] == pytest.approx(embedded.pass_at(1).value)


def test_sampled_pass_at_k_through_running_sglang_servers(server, models):
    # Servers named by rollout.sglang.urls (the session's server, holding models.v0): none is launched.
    cfg = settings(
        "eval.k=4", "eval.samples_per_prompt=4", "eval.num_prompts=6", "eval.temperature=1.0",
        "eval.max_new_tokens=8", "eval.seed=5",
    )  # fmt: skip
    cfg.rollout.sglang = client_config(server.url)
    report = evaluate_model(str(models.v0), cfg.eval_job, tracking_uri=NO_STORE, engine="sglang")
    groups = report.by_prompt
    assert [len(group) for group in groups] == [4] * 6 and report.engine == "sglang"
    for i, group in enumerate(groups):
        assert all(s.prompt == i and 1 <= len(s.completion.output_ids) <= 8 for s in group)
        assert all(s.completion.policy_version == 0 for s in group)
    assert len({tuple(s.completion.output_ids) for group in groups for s in group}) > 6  # real draws
    counts = [sum(s.correct for s in group) for group in groups]
    assert counts == report.correct
    for k, result in report.pass_at_ks(4).items():
        assert result.per_prompt == [pass_at_k(4, c, k) for c in counts]
