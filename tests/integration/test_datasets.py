"""Data sources, mixtures and benchmarks through a real training run and the real CLI (issue 38).

The tiny model trains on a two-source mixture (the built-in arithmetic task and a CSV file mapped by a template),
with a GSM8K mirror in the hub's exact schema evaluated at every evaluation; the summary, metrics.jsonl and the
MLflow run carry reward and accuracy per source and the benchmark's accuracy. Decontamination finds a planted
overlap and, with data.decontaminate=drop, leaves those rows out. `trustbatch data` and `trustbatch eval --bench`
run as a user runs them.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from app.training.loop import run
from app.training.records import summary_lines

from .conftest import REPO
from .test_loop import small_config

pytestmark = pytest.mark.slow

# Short GSM8K-schema problems the tiny model's tokenizer can read (digits and operators): the hub's columns
# `question` and `answer` (worked solution, <<calculator>> annotations, `#### final`).
GSM8K_ROWS = [{"question": f"{a}+{b}=", "answer": f"{a}+{b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
              for a in range(1, 4) for b in range(1, 4)]  # fmt: skip


def sums_csv(path: Path, pairs) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["x", "y", "total"])
        writer.writerows([x, y, x + y] for x, y in pairs)
    return path


SUMS = "{source: %s, name: sums, template: '{x}+{y}=', fields: {answer: total}, task: math}"


def mixture(root: Path, *extra: str, planted: tuple = ()) -> list[str]:
    """Overrides for the mixture: builtin:arithmetic (weight 3) and a CSV of sums x + y (weight 1) under ``root``,
    evaluated on both; ``planted``: held-out sums also written into the training file."""
    root.mkdir(parents=True, exist_ok=True)
    held_out = [(x, y) for x in range(30, 34) for y in range(5, 8)]
    train = sums_csv(root / "sums_train.csv", [(x, y) for x in range(10, 30) for y in range(0, 5)] + list(planted))
    test = sums_csv(root / "sums_test.csv", held_out)
    return [
        f"data.train=[{{source: 'builtin:arithmetic', weight: 3}}, {(SUMS % train)[:-1]}, weight: 1}}]",
        f"data.eval=['builtin:arithmetic', {SUMS % test}]",
        "eval.num_prompts=36",  # all of both: 24 arithmetic problems, then the 12 held-out sums
        *extra,
    ]


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bench")
    (root / "gsm8k.jsonl").write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    return root


def test_a_mixture_run_reports_each_source_and_each_benchmark(tmp_path, tiny_model_dir, bench_dir):
    cfg = small_config(tmp_path, tiny_model_dir, *mixture(tmp_path), "eval.benchmarks=[gsm8k]",
                       f"eval.bench_dir={bench_dir}", "eval.max_new_tokens=8")  # fmt: skip
    summary = run(cfg)
    run_dir = tmp_path / "run"
    # Per source: the training reward of the steps that drew it, the held-out accuracy at each evaluation.
    assert set(summary["sources"]) == {"arithmetic", "sums"}, summary["sources"]
    for name in ("arithmetic", "sums"):
        entry = summary["sources"][name]
        assert 0.0 <= entry["final_accuracy"] <= 1.0 and 0.0 <= entry["initial_accuracy"] <= 1.0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    drew = [m for m in metrics if any(k.startswith("reward/source/") for k in m)]
    assert drew and all(0.0 <= v <= 1.0 for m in drew for k, v in m.items() if k.startswith("reward/source/"))

    # Held-out evaluations (MLflow): per source and per benchmark at every one.
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    run_id = summary["mlflow_run_id"]

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    sums, arithmetic, overall = (history(f"eval/{k}accuracy") for k in ("source/sums/", "source/arithmetic/", ""))
    assert sorted(sums) == sorted(arithmetic) == [0, 2, 3]
    # The per-source accuracies recombine to the overall one, weighted by each source's number of samples.
    assert overall[3] == pytest.approx((24 * arithmetic[3] + 12 * sums[3]) / 36)
    assert summary["sources"]["sums"]["final_accuracy"] == pytest.approx(sums[3])
    assert sorted(history("bench/gsm8k/accuracy")) == [0, 2, 3]
    bench = summary["benchmarks"]["gsm8k"]
    assert 0.0 <= bench["initial_accuracy"] <= 1.0 and 0.0 <= bench["final_accuracy"] <= 1.0
    lines = summary_lines(summary)
    assert any("gsm8k" in line for line in lines) and any("sums" in line for line in lines), lines

    # MLflow: the same, and the decontamination report (the built-in task's short prompts repeat across splits).
    logged = client.get_run(run_id).data.metrics
    for key in ("eval/source/sums/accuracy", "eval/source/arithmetic/accuracy", "bench/gsm8k/accuracy",
                "data/contaminated_rows", "data/decontaminated_rows"):  # fmt: skip
        assert key in logged, (key, sorted(logged))
    assert logged["data/decontaminated_rows"] == 0  # report mode keeps them


def test_decontamination_drop_leaves_the_planted_rows_out(tmp_path, tiny_model_dir):
    """The same one-step run twice, the second with two held-out sums copied into the training file: drop mode
    leaves out exactly those two more rows, and the overlap of sums with its own held-out set is counted."""
    short = ("data.decontaminate=drop", "run.steps=1", "eval.every=0", "checkpoint.every=0")

    def dropped(root: Path, planted: tuple) -> dict[str, float]:
        cfg = small_config(root, tiny_model_dir, *mixture(root, *short, planted=planted))
        summary = run(cfg)
        return MlflowClient(tracking_uri=cfg.tracking_uri).get_run(summary["mlflow_run_id"]).data.metrics

    clean = dropped(tmp_path / "clean", ())
    planted = dropped(tmp_path / "planted", ((30, 5), (31, 6)))
    assert clean.get("data/overlap/sums/data.eval:sums", 0) == 0
    assert planted["data/overlap/sums/data.eval:sums"] == 2
    assert planted["data/decontaminated_rows"] == clean["data/decontaminated_rows"] + 2


def trustbatch(*args: str, cwd: Path = REPO, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env)  # fmt: skip


def test_the_data_command_shows_each_source_and_checks_the_references(tmp_path):
    config = tmp_path / "mixture.yaml"
    config.write_text((REPO / "configs" / "quickstart-mixture.yaml").read_text().replace(
        "configs/data/", f"{REPO / 'configs' / 'data'}/"))  # fmt: skip
    done = trustbatch("data", str(config), "--check-references", cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout
    assert "sums" in out and "arithmetic" in out and "316" in out and "decontamination" in out
    assert "pass their own verifiers" in out

    # A source that no verifier serves stops with the source named and the fix.
    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text().replace("      task: math\n", "      task: poetry\n", 1))
    done = trustbatch("data", str(bad), cwd=tmp_path)
    assert done.returncode != 0
    assert "poetry" in done.stderr + done.stdout and "sums" in done.stderr + done.stdout


def test_eval_bench_prints_one_table_and_writes_json(tmp_path, tiny_model_dir, bench_dir):
    out = tmp_path / "bench.json"
    done = trustbatch("eval", str(tiny_model_dir), "--bench", "gsm8k", "--bench-dir", str(bench_dir),
                      "--max-new-tokens", "8", "--out", str(out), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert "gsm8k" in done.stdout and "pass@1 (greedy)" in done.stdout
    report = json.loads(out.read_text())
    [row] = report["table"]
    assert row["benchmark"] == "gsm8k" and 0.0 <= row["pass@1"] <= 1.0, row
    assert row["prompts"] == len(GSM8K_ROWS)

    # An unknown name, and a benchmark with no mirror and no network: a clear error, no traceback.
    done = trustbatch("eval", str(tiny_model_dir), "--bench", "gsm9k", cwd=tmp_path)
    assert done.returncode != 0 and "gsm9k" in done.stderr + done.stdout and "Traceback" not in done.stderr
    done = trustbatch("eval", str(tiny_model_dir), "--bench", "math500", "--bench-dir", str(bench_dir),
                      cwd=tmp_path, env_extra={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert done.returncode != 0 and "bench-dir" in done.stderr + done.stdout and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def long_context_tiny(tmp_path_factory) -> Path:
    """An untrained tiny Qwen2 (byte-level tokenizer) with 2,048 positions: room for HumanEval's prompts."""
    from trainer.model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer, save_model

    out = tmp_path_factory.mktemp("models") / "tiny-2048"
    tokenizer = build_tiny_tokenizer()
    save_model(build_tiny_model(TinyModelConfig(max_position_embeddings=2048), tokenizer), tokenizer, out)
    return out


def test_eval_bench_humaneval_and_gsm8k_from_a_mirror(tmp_path, long_context_tiny, bench_dir):
    """`trustbatch eval MODEL --bench humaneval gsm8k`: HumanEval from the cache (`make humaneval`), graded in the
    sandbox; GSM8K from a local mirror; one table, one JSON file."""
    import os

    from app.fetch import humaneval_path

    if not humaneval_path().is_file():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"no {humaneval_path()}; CI runs `make humaneval` before the tests, so it must be there")
        pytest.skip(f"no {humaneval_path()}; fetch it with: make humaneval")
    out = tmp_path / "bench.json"
    done = trustbatch("eval", str(long_context_tiny), "--bench", "humaneval", "gsm8k", "--bench-dir", str(bench_dir),
                      "--num-prompts", "6", "--max-new-tokens", "32", "--out", str(out), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    table = {row["benchmark"]: row for row in json.loads(out.read_text())["table"]}
    assert set(table) == {"humaneval", "gsm8k"}
    assert table["humaneval"]["prompts"] == 6 and table["gsm8k"]["prompts"] == 6, table
    assert "humaneval" in done.stdout and "gsm8k" in done.stdout
