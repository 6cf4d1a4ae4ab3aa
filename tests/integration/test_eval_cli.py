"""`trustbatch eval`: the warm-started tiny model, real math-verify, a real MLflow store (SQLite in a temp dir).

Covered: the library call (samples, scores, pass@k from the per-prompt counts, reproducible for a seed), the
command on a registered model (table, JSON, a new MLflow run with params and metrics), a user JSONL file with a
config's rewards and rollout sections, and bad input (exit 2, one message, no traceback). The pass@k estimator's
values are checked by hand in tests/unit/test_pass_at_k.py.
"""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from app.config import load_config
from app.evaluation.command import evaluate_model
from app.evaluation.metrics import pass_at_k
from rewards import RewardsConfig, VerifierInput, build_verifier

from .model_refs import make_registry, trustbatch

# What `trustbatch eval --k 4 --num-prompts 12 --temperature 1 --max-new-tokens 8` sets.
K, NUM_PROMPTS, MAX_NEW = 4, 12, 8
SETTINGS = [
    "data.eval=builtin:arithmetic", f"data.num_eval={NUM_PROMPTS}", f"eval.num_prompts={NUM_PROMPTS}",
    f"eval.k={K}", f"eval.samples_per_prompt={K}", "eval.temperature=1.0", f"eval.max_new_tokens={MAX_NEW}",
    "eval.seed=0", "eval.greedy=false",
]  # fmt: skip
NO_STORE = "sqlite:////nonexistent/mlflow.db"  # a directory reference needs no store


def evaluate(model_dir, *overrides: str, engine: str = "embedded"):
    return evaluate_model(str(model_dir), load_config(None, [*SETTINGS, *overrides]).eval_job, tracking_uri=NO_STORE,
                          engine=engine)


def texts(result) -> list[list[str]]:
    return [[s.text for s in group] for group in result.by_prompt]


def verdicts(result) -> list[list[bool]]:
    return [[s.correct for s in group] for group in result.by_prompt]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Downloads of registry references go to the test's folder (the commands inherit the environment)."""
    monkeypatch.setenv("TRUSTBATCH_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def registry(tmp_path_factory, tiny_model_dir):
    return make_registry(tmp_path_factory.getbasetemp() / "registry", tiny_model_dir)


@pytest.fixture(scope="module")
def report(tiny_model_dir):
    return evaluate(tiny_model_dir)


def test_every_prompt_gets_k_scored_samples(report):
    assert len(report.rows) == NUM_PROMPTS
    assert all(len(group) == K for group in texts(report))
    assert report.correct == [sum(v) for v in verdicts(report)] and len(report.correct) == NUM_PROMPTS
    assert report.error_rate == 0.0
    assert 1 <= report.mean_completion_tokens <= MAX_NEW


def test_correctness_is_math_verify_on_each_completion(report):
    # The verdicts the runner's worker process gave, in the right order, are what math-verify says in-process.
    verify = build_verifier("math")
    for row, row_texts, row_verdicts in zip(report.rows, texts(report), verdicts(report), strict=True):
        for text, verdict in zip(row_texts, row_verdicts, strict=True):
            score = verify(
                VerifierInput(prompt=row.prompt, completion=text, reference=row.answer, metadata={})
            )
            assert bool(score.correct) == verdict, (row.prompt, text, row.answer)


def test_pass_at_k_comes_from_the_per_prompt_counts(report):
    n = K
    counts = [sum(v) for v in verdicts(report)]
    passes = report.pass_at_ks(K)
    assert sorted(passes) == [1, 2, 4]
    for k, result in passes.items():
        assert result.per_prompt == [pass_at_k(n, c, k) for c in counts]
        assert result.value == pytest.approx(sum(result.per_prompt) / len(counts))
    # pass@1 is the fraction of correct samples; pass@k never decreases with k.
    assert passes[1].value == pytest.approx(sum(counts) / (n * len(counts))) == pytest.approx(report.accuracy)
    values = [passes[k].value for k in (1, 2, 4)]
    assert values == sorted(values)


def test_the_same_settings_and_seed_give_the_same_samples(report, tiny_model_dir):
    again = evaluate(tiny_model_dir)
    assert texts(again) == texts(report) and verdicts(again) == verdicts(report)


def _cli(*args: str):
    return trustbatch(*args, timeout=600)


def test_eval_command_on_a_registered_model_writes_json_and_an_mlflow_run(registry, tmp_path):
    out_file = tmp_path / "results.json"
    ref = f"models:/{registry.name}@best"
    # Training and evaluation runs share one store; count this command's runs by their tag.
    client = MlflowClient(tracking_uri=registry.uri)
    out = _cli(
        "eval", ref, "--k", "4", "--samples", "6", "--num-prompts", "8", "--max-new-tokens", "8",
        "--out", str(out_file), "--tracking-uri", registry.uri,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    assert "eval: 48/48 completions, " in out.stderr  # the progress line (8 prompts x 6 samples)
    for fragment in (
        "pass@1",
        "pass@2",
        "pass@4",
        "8 prompts x 6 samples",
        f"version {registry.versions['best']}",
    ):
        assert fragment in out.stdout
    result = json.loads(out_file.read_text())
    assert (
        result["model"]["version"] == registry.versions["best"] and result["model"]["name"] == registry.name
    )
    assert result["num_prompts"] == 8 and result["settings"]["samples"] == 6
    assert sorted(result["metrics"]) == ["pass@1", "pass@2", "pass@4"]
    for prompt in result["prompts"]:
        assert len(prompt["completions"]) == 6
        assert prompt["pass_at"]["4"] == pytest.approx(pass_at_k(6, prompt["correct"], 4))

    run = client.get_run(result["mlflow_run_id"])
    assert f"MLflow run {run.info.run_id}" in out.stdout
    assert run.data.tags["trustbatch.kind"] == "eval" and run.data.tags["trustbatch.model_ref"] == ref
    assert run.data.params["model.version"] == registry.versions["best"] and run.data.params["eval.k"] == "4"
    for k in (1, 2, 4):
        assert run.data.metrics[f"eval/pass_at_{k}"] == pytest.approx(result["metrics"][f"pass@{k}"]["value"])
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["eval_results.json"]


def test_eval_command_on_a_jsonl_file_uses_the_config_sections(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"id": "p1", "prompt": "3+4=", "answer": "7"},
        {"id": "p2", "messages": [{"role": "user", "content": "9*8="}], "answer": 72},
        {"id": "p3", "prompt": "6-1=", "answer": "5", "task": "sums"},
    ]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tmp_path / "eval.yaml"
    config.write_text(
        "rollout: {temperature: 0.7, max_new_tokens: 6}\n"
        "rewards:\n"
        "  num_workers: 1\n"
        "  verifiers:\n"
        "    - {name: math, tasks: [math, sums], params: {numeric_answer: true}}\n"
        "tracking: {experiment: evals}\n"
    )
    store = tmp_path / "store" / "mlflow.db"
    out_file = tmp_path / "out.json"
    out = _cli(
        "eval", str(tiny_model_dir), "--data", str(prompts), "--k", "2", "--config", str(config),
        "--out", str(out_file), "--tracking-uri", f"sqlite:///{store}", "--dtype", "bfloat16",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out_file.read_text())
    assert [p["id"] for p in result["prompts"]] == ["p1", "p2", "p3"]
    assert result["settings"]["temperature"] == 0.7 and result["settings"]["max_new_tokens"] == 6
    assert result["settings"]["dtype"] == "bfloat16" and result["settings"]["engine"] == "embedded"
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("evals")
    assert client.get_run(result["mlflow_run_id"]).info.experiment_id == experiment.experiment_id
    assert experiment.artifact_location.startswith((store.parent / "mlartifacts").as_uri())


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--k", "0"], "eval.k=0: k must be >= 1 (--k sets eval.k"),
        (["--k", "4", "--samples", "2"], "eval.samples_per_prompt=2 is below eval.k=4"),
        (["--k", "4", "--samples", "2"], "--samples sets eval.samples_per_prompt"),
        (["--data", "prompts.txt"], "data.eval='prompts.txt' is neither builtin:<task>, hub:<owner>/<name>, a directory, nor a file"),
        (["--data", "prompts.txt"], "(--data sets data.eval)"),
        (["--engine", "vllm"], "engine 'vllm': choose one of embedded, local, sglang, auto"),
        (["--dtype", "float16"], "rollout.dtype='float16' must be one of ['float32', 'bfloat16']"),
        (["--dtype", "float16"], "(--dtype sets rollout.dtype)"),
        (["--data", "builtin:geometry"], "unknown built-in task 'geometry'"),
        (["--data", "tests/fixtures/prompts_small.jsonl"], "have no verifier"),
        (["--config", "configs/missing.yaml"], "does not exist"),
    ],
)
def test_eval_command_bad_input_exits_2(tiny_model_dir, args, fragment):
    out = _cli("eval", str(tiny_model_dir), *args, "--no-track")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert fragment in out.stderr and "Traceback" not in out.stderr + out.stdout


def test_eval_command_unknown_model_exits_2(registry):
    out = _cli("eval", f"models:/{registry.name}/7", "--tracking-uri", registry.uri)
    assert out.returncode == 2 and "has no version 7" in out.stderr and "Traceback" not in out.stderr


def test_default_rewards_score_math(report):
    assert [spec.name for spec in RewardsConfig().verifiers] == ["math"]  # what evaluate_model used above
    assert {row.task for row in report.rows} == {"math"}


def test_the_built_in_server_engine_gives_the_embedded_engines_greedy_samples(tiny_model_dir):
    # One sampling path for every engine: the same prompts through the CPU server (over HTTP) and in process.
    greedy = ["eval.k=1", "eval.samples_per_prompt=1", "eval.num_prompts=6", "eval.temperature=0.0"]
    embedded = evaluate(tiny_model_dir, *greedy)
    served = evaluate(tiny_model_dir, *greedy, engine="local")
    assert texts(served) == texts(embedded) and verdicts(served) == verdicts(embedded)
    assert served.engine == "local" and embedded.engine == "embedded"


def _long_prompts(tmp_path):
    """Two short prompts and one whose tokens fill the tiny model's 256-token context."""
    prompts = tmp_path / "long.jsonl"
    rows = [
        {"id": "short1", "prompt": "3+4=", "answer": "7"},
        {"id": "long", "prompt": "1+" * 200 + "1=", "answer": "201"},
        {"id": "short2", "prompt": "6-1=", "answer": "5"},
    ]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return prompts


def test_eval_command_refuses_a_prompt_too_long_for_the_context(tiny_model_dir, tmp_path):
    out = _cli("eval", str(tiny_model_dir), "--data", str(_long_prompts(tmp_path)), "--k", "1", "--no-track")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "1 prompt(s) longer than 255 tokens" in out.stderr
    assert "long.jsonl: line 2: prompt has" in out.stderr
    assert "data.on_long_prompt=drop" in out.stderr and "--on-long-prompt sets data.on_long_prompt" in out.stderr
    assert "Traceback" not in out.stderr


def test_eval_command_drops_and_counts_long_prompts_when_asked(tiny_model_dir, tmp_path):
    out_file = tmp_path / "out.json"
    out = _cli(
        "eval", str(tiny_model_dir), "--data", str(_long_prompts(tmp_path)), "--k", "2", "--max-new-tokens", "6",
        "--on-long-prompt", "drop", "--out", str(out_file), "--no-track",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out_file.read_text())
    assert [p["id"] for p in result["prompts"]] == ["short1", "short2"]
    assert result["dropped_long_prompts"] == 1 and "1 too long, dropped" in out.stdout
