"""A synchronous run, and a run at a forced lag, are reproducible bitwise at the quickstart's scale on a busy machine.

Issue 41: three identical quickstart runs at max_lag 0 ended at three different accuracies. The built-in server
took queued jobs one at a time up to its batch limit; a ticket of 32 prompts x 8 samples fills that limit, so
whenever another request's job was queued ahead of it (the publish check's probe, sent as the new version is
held, or an evaluation's request at step 0) its last prompt ran as a second generation from the same seed and
drew other samples. Which request reached the queue first depended on timing. The test before this one ran 8 x 4
sequences a step, far under the limit, and never saw a split.

Here each run has the quickstart's batch shape (32 prompts x 8 samples, shared prompts, the built-in HTTP server,
its reward workers and the publish check), an evaluation at the start that overlaps the first ticket, several
steps, and two CPU-bound processes started beside it, so that the order in which requests arrive moves from run to
run. Every metric that is not a timing, every held-out accuracy and every final weight must be equal.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from app.training.loop import run

from .test_loop import final_weights, small_config

pytestmark = pytest.mark.slow

TIMING_PREFIXES = ("timing/", "throughput/", "perf/")
TIMING_KEYS = {"rollout/utilisation", "train/utilisation", "wall_s", "buffer/size"}


def quickstart_scale(tmp_path, model_dir, *extra):
    return small_config(
        tmp_path, model_dir,
        "run.steps=24", "rollout.prompts_per_step=32", "rollout.group_size=8", "trainer.micro_batch_size=64",
        "optim.lr=3e-5", "eval.every=0", "checkpoint.every=0", "data.arithmetic.max_ops=2", "data.num_train=2000",
        "data.num_eval=128", "eval.num_prompts=128",
        "eval.samples_per_prompt=4", *extra,
    )  # fmt: skip


def step_metrics(run_dir) -> list[dict]:
    """Every step's metrics without the timings (wall time, rates, utilisation: those move with the load)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES) and k not in TIMING_KEYS}
        for row in rows
    ]


@pytest.fixture
def busy_machine():
    """Two CPU-bound processes beside the run (the machine has two cores): the run's threads and processes are
    descheduled at moments that change from run to run."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@pytest.mark.parametrize(
    "mode", [("rollout.max_lag=0",), ("rollout.max_lag=2", "rollout.exact_lag=true")], ids=["sync", "exact_lag_2"]
)
def test_runs_are_bitwise_alike_at_the_quickstart_scale_on_a_busy_machine(tmp_path, tiny_model_dir, mode, busy_machine):
    summaries = [run(quickstart_scale(tmp_path / name, tiny_model_dir, *mode)) for name in ("a", "b")]
    a, b = summaries
    assert a["steps"] == b["steps"] == 24
    for key in ("initial_accuracy", "final_accuracy", "initial_greedy_accuracy", "final_greedy_accuracy"):
        assert a[key] == b[key], key
    metrics_a, metrics_b = (step_metrics(tmp_path / name / "run") for name in ("a", "b"))
    assert len(metrics_a) == 24
    for step, (row_a, row_b) in enumerate(zip(metrics_a, metrics_b, strict=True), start=1):
        differ = [k for k in sorted(set(row_a) | set(row_b)) if row_a.get(k) != row_b.get(k)]
        assert not differ, f"step {step}: " + ", ".join(f"{k} {row_a.get(k)} != {row_b.get(k)}" for k in differ[:6])
    wa, wb = final_weights(a), final_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
