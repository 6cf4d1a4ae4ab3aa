"""Asynchronous against synchronous RL, and `rollout.max_lag: auto` against fixed bounds, at equal wall time.

For each lag setting (default 0 1 2 4 auto; 0 = synchronous: generate, train, push, repeat) and each seed
(default 0 1 2) it runs `trustbatch train configs/quickstart.yaml rollout.max_lag=K run.seed=S
run.time_limit_s=T` from the same warm-started model, one run after another on this machine, and reports per
setting the mean over seeds ± the across-seed SE of trained samples/s, the mean policy lag and the bound in
force, rollout and train utilisation, and the held-out sampled pass@1 gain (1500 prompts x 4 samples, start
and end of the same training time; evaluations are excluded from T). Each setting is also compared with the
synchronous run of the same seed (paired by seed): the samples/s ratio and the gain difference. Prints a
table, writes bench/results/async_vs_sync.json and a PNG (gain and samples/s per setting, one dot a seed).

    .venv/bin/python bench/async_vs_sync.py [--seconds 120] [--lags 0 1 2 4 auto] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from training_runs import REPO, machine, mean_se, train


def lag_setting(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a lag is an integer >= 0 or auto")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0, help="training wall time per run (run.time_limit_s)")
    parser.add_argument("--lags", type=lag_setting, nargs="+", default=["0", "1", "2", "4", "auto"],
                        help="rollout.max_lag settings; the first is the baseline of the paired comparisons")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    config = REPO / "configs" / "quickstart.yaml"
    runs: dict[tuple[str, int], dict] = {}
    for seed in args.seeds:  # seed-major: a drift in machine load during the sweep hits every setting alike
        for lag in args.lags:
            run_dir = args.out / "async_vs_sync" / f"max_lag_{lag}-seed{seed}"
            print(f"seed {seed}, max_lag={lag}: training for {args.seconds:g} s ...", flush=True)
            result = train(
                config,
                run_dir,
                [
                    f"rollout.max_lag={lag}",
                    f"run.seed={seed}",
                    f"run.time_limit_s={args.seconds}",
                    "run.steps=100000",  # the time limit decides; a constant learning rate keeps runs comparable
                    "eval.every=0",  # held-out evaluation before the first step and after the last
                    "checkpoint.every=0",
                    "tracking.log_model=false",
                    *args.overrides,
                ],
            )
            runs[lag, seed] = result["summary"]

    base = args.lags[0]
    rows = []
    for lag in args.lags:
        per_seed = [runs[lag, seed] for seed in args.seeds]
        row = {"max_lag": lag}
        for key in ("samples_per_s", "accuracy_gain", "final_accuracy", "mean_policy_lag", "mean_max_lag_in_force",
                    "train_utilisation", "rollout_utilisation", "steps"):
            row[key], row[f"{key}_se"] = mean_se([float(s[key]) for s in per_seed])
        row["ratio_vs_base"], row["ratio_vs_base_se"] = mean_se(
            [runs[lag, s]["samples_per_s"] / runs[base, s]["samples_per_s"] for s in args.seeds])
        row["gain_vs_base"], row["gain_vs_base_se"] = mean_se(
            [runs[lag, s]["accuracy_gain"] - runs[base, s]["accuracy_gain"] for s in args.seeds])
        row["gain_se_by_prompt"] = [s["accuracy_gain_se"] for s in per_seed]
        row["per_seed"] = {seed: {"samples_per_s": runs[lag, seed]["samples_per_s"],
                                  "accuracy_gain": runs[lag, seed]["accuracy_gain"]} for seed in args.seeds}
        rows.append(row)

    print(f"\n{len(args.seeds)} seeds, {args.seconds:g} s of training each; mean ± across-seed SE; "
          f"'vs {base}' paired by seed")
    header = (f"{'max_lag':>7} {'steps':>6} {'samples/s':>13} {'x vs ' + base:>13} {'lag':>5} {'bound':>5} "
              f"{'roll%':>6} {'train%':>6} {'gain (points)':>15} {'gain - ' + base:>15}")
    print(header)
    for r in rows:
        print(f"{r['max_lag']:>7} {r['steps']:>6.0f} {r['samples_per_s']:>7.0f} ± {r['samples_per_s_se']:<4.0f}"
              f"{r['ratio_vs_base']:>7.2f} ± {r['ratio_vs_base_se']:<4.2f}{r['mean_policy_lag']:>5.2f} "
              f"{r['mean_max_lag_in_force']:>5.2f} {100 * r['rollout_utilisation']:>6.0f} "
              f"{100 * r['train_utilisation']:>6.0f} {100 * r['accuracy_gain']:>+7.2f} ± {100 * r['accuracy_gain_se']:<5.2f}"
              f"{100 * r['gain_vs_base']:>+7.2f} ± {100 * r['gain_vs_base_se']:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"bench": "async_vs_sync", "machine": machine(), "seconds": args.seconds, "seeds": args.seeds,
              "overrides": args.overrides, "rows": rows}
    (args.out / "async_vs_sync.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, args.seeds, args.out / "async_vs_sync.png", args.seconds)
    print(f"wrote {args.out / 'async_vs_sync.json'} and {args.out / 'async_vs_sync.png'}")
    return 0


def plot(rows: list[dict], seeds: list[int], path: Path, seconds: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = ["sync" if r["max_lag"] == "0" else f"max_lag {r['max_lag']}" for r in rows]
    x = range(len(rows))
    for ax, key, scale, label in ((left, "accuracy_gain", 100, "held-out pass@1 gain (points)"),
                                  (right, "samples_per_s", 1, "trained samples / s")):
        ax.bar(x, [scale * r[key] for r in rows], yerr=[scale * r[f"{key}_se"] for r in rows], capsize=4,
               color=["#888"] + ["#2a7"] * (len(rows) - 1), alpha=0.6)
        for i, r in enumerate(rows):  # one dot a seed
            ax.scatter([i] * len(seeds), [scale * r["per_seed"][s][key] for s in seeds], color="k", s=12, zorder=3)
        ax.set_xticks(list(x), names)
        ax.set_ylabel(label)
    left.set_title(f"gain after {seconds:g} s of training (mean ± SE over {len(seeds)} seeds)")
    right.set_title("throughput (2 CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
