"""Redraw a training run's PNG from its run directory and MLflow store (app/training/plots.py `plot_run`).

    .venv/bin/python bench/plot_run.py RUN_DIR OUT.png [--title TITLE]

The per-step rows come from RUN_DIR/metrics.jsonl, the held-out evaluations from the run's MLflow metrics
(summary.json names the run and the store), so a run finished with an older plot gets the current one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.training.plots import plot_run  # noqa: E402

EVAL_KEYS = ("eval/accuracy", "eval/accuracy_se", "eval/greedy_accuracy", "eval/answer_rate", "eval/greedy_answer_rate")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    from mlflow import MlflowClient

    rows = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((args.run_dir / "summary.json").read_text())
    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    by_step: dict[int, dict] = {}
    for key in EVAL_KEYS:
        for metric in client.get_metric_history(summary["mlflow_run_id"], key):
            by_step.setdefault(metric.step, {"step": metric.step})[key] = metric.value
    evals = [by_step[step] for step in sorted(by_step)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_run(rows, evals, args.out, title=args.title or args.run_dir.name)
    print(f"wrote {args.out} ({len(rows)} steps, {len(evals)} evaluations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
