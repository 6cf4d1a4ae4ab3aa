"""Asynchronous against synchronous RL on the quickstart setup, at equal training wall time.

For each max_lag in {0, 1, 2} (0 = synchronous: generate, train, push, repeat) it runs
`trustbatch train configs/quickstart.yaml rollout.max_lag=K run.time_limit_s=T` from the same warm-started
model and seed, one run after another on this machine, and reports trained samples/s, the async/sync ratio,
the mean policy lag, rollout and train utilisation, and held-out sampled pass@1 (1500 prompts x 4 samples)
at the end of the same training time (evaluations are excluded from T). Prints a table, writes
bench/results/async_vs_sync.json and a PNG (accuracy against training time; samples/s per mode).

    .venv/bin/python bench/async_vs_sync.py [--seconds 240] [--lags 0 1 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from training_runs import REPO, machine, train


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=240.0, help="training wall time per run (run.time_limit_s)")
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    config = REPO / "configs" / "quickstart.yaml"
    runs = {}
    for lag in args.lags:
        run_dir = args.out / "async_vs_sync" / f"max_lag_{lag}"
        print(f"max_lag={lag}: training for {args.seconds:g} s ...", flush=True)
        runs[lag] = train(
            config,
            run_dir,
            [
                f"rollout.max_lag={lag}",
                f"run.time_limit_s={args.seconds}",
                "run.steps=100000",  # the time limit decides; a constant learning rate keeps runs comparable
                f"eval.every={args.eval_every}",
                f"checkpoint.every={args.eval_every}",
                "tracking.log_model=false",
                *args.overrides,
            ],
        )
    base = runs[args.lags[0]]["summary"]["samples_per_s"]
    rows = []
    for lag, result in runs.items():
        s = result["summary"]
        rows.append({
            "max_lag": lag,
            "steps": s["steps"],
            "samples_per_s": round(s["samples_per_s"], 1),
            "ratio_vs_sync": round(s["samples_per_s"] / base, 3),
            "mean_policy_lag": round(s["mean_policy_lag"], 3),
            "dropped_groups": s["dropped_groups"],
            "rollout_utilisation": round(s["rollout_utilisation"], 3),
            "train_utilisation": round(s["train_utilisation"], 3),
            "initial_accuracy": round(s["initial_accuracy"], 4),
            "final_accuracy": round(s["final_accuracy"], 4),
            "accuracy_gain": round(s["accuracy_gain"], 4),
            "accuracy_gain_se": round(s["accuracy_gain_se"], 4),
            "final_greedy_accuracy": s["final_greedy_accuracy"],
            "train_wall_s": round(s["train_wall_s"], 1),
        })
    header = f"{'max_lag':>7} {'steps':>6} {'samples/s':>10} {'x sync':>7} {'lag':>5} {'roll%':>6} {'train%':>6} {'pass@1':>8} {'gain':>14}"
    print(header)
    for r in rows:
        print(f"{r['max_lag']:>7} {r['steps']:>6} {r['samples_per_s']:>10.1f} {r['ratio_vs_sync']:>7.2f} "
              f"{r['mean_policy_lag']:>5.2f} {100 * r['rollout_utilisation']:>6.0f} {100 * r['train_utilisation']:>6.0f} "
              f"{100 * r['final_accuracy']:>7.2f}% {100 * r['accuracy_gain']:>+7.2f} ± {100 * r['accuracy_gain_se']:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"bench": "async_vs_sync", "machine": machine(), "seconds": args.seconds, "rows": rows,
              "curves": {lag: r["evals"] for lag, r in runs.items()}}
    (args.out / "async_vs_sync.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(runs, rows, args.out / "async_vs_sync.png", args.seconds)
    print(f"wrote {args.out / 'async_vs_sync.json'} and {args.out / 'async_vs_sync.png'}")
    return 0


def plot(runs: dict, rows: list[dict], path: Path, seconds: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for lag, result in runs.items():
        evals = result["evals"]
        left.errorbar([e["train_s"] for e in evals], [100 * e["eval/accuracy"] for e in evals],
                      yerr=[100 * e["eval/accuracy_se"] for e in evals], marker="o", capsize=3,
                      label="synchronous" if lag == 0 else f"async, max_lag {lag}")
    left.set_xlabel("training wall time (s, evaluations excluded)")
    left.set_ylabel("held-out sampled pass@1 (%)")
    left.set_title(f"accuracy at equal wall time ({seconds:g} s)")
    left.legend()
    names = ["sync" if r["max_lag"] == 0 else f"max_lag {r['max_lag']}" for r in rows]
    bars = right.bar(names, [r["samples_per_s"] for r in rows], color=["#888"] + ["#2a7"] * (len(rows) - 1))
    for bar, r in zip(bars, rows, strict=True):
        right.annotate(f"{r['ratio_vs_sync']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                       ha="center", va="bottom")
    right.set_ylabel("trained samples / s")
    right.set_title("throughput (2 CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
