"""Shared by the training benchmarks: run `trustbatch train` as a user would and read back what it wrote.

Each run is a fresh `python -m app.cli train <config> key=value ...` process (one torch thread), so runs do not
share warm caches or threads. Its run directory holds `summary.json`, `metrics.jsonl` (one line per step) and
the evaluation history (inside the last checkpoint's state.json), which is all a benchmark needs.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean, stdev

REPO = Path(__file__).resolve().parents[1]


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample std / sqrt(n)); nan for no values, SE nan for one."""
    if not values:
        return float("nan"), float("nan")
    return mean(values), (stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan"))


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def train(config: Path, run_dir: Path, overrides: list[str], *, log: Path | None = None) -> dict:
    """Run one training to completion; returns summary, per-step metrics and evaluations (with train time)."""
    run_dir = Path(run_dir)
    command = [sys.executable, "-m", "app.cli", "train", str(config), f"run.dir={run_dir}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = log or run_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(command)} exited with {code}; end of {log}:\n{tail}")
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    state = json.loads((checkpoints[-1] / "state.json").read_text())
    elapsed, train_time = 0.0, {0: 0.0}
    for row in steps:
        elapsed += row["timing/step"]
        train_time[int(row["step"])] = elapsed
    evals = [{**e, "train_s": train_time.get(int(e["step"]), elapsed)} for e in state["eval_history"]]
    return {"summary": summary, "steps": steps, "evals": evals, "process_s": time.perf_counter() - start}
