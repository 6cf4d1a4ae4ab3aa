"""The quickstart's gain against how its warm start draws its batches (issue: the quickstart's lost gain).

When the tiny model's warm start moved onto `trustbatch sft`'s loop, its batches changed from independent draws
(with replacement) to seeded epochs, and one clean-clone run went from 12.20% to 9.78% at the start and from
+3.77 to about +2.5 points of gain. This script builds both warm starts for several seeds (model.tiny.seed, which
seeds the initial weights and the draws) and runs `trustbatch train configs/quickstart.yaml` from each, with
run.seed the same seed, then reports per seed and across seeds:

- what each warm start saw: distinct training rows, and where the epoch boundary falls in the cosine schedule;
- the start's accuracy (the run's own step-0 evaluation: 1,500 held-out prompts, 4 samples each, and greedy);
- the RL gain, and the difference between the two orders paired by seed, with the across-seed SE.

    .venv/bin/python bench/warm_start.py --seeds 0 1 2            # about 4 minutes a run on 2 cores

Writes bench/results/warm_start/summary.json and one run directory per (order, seed).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from app.config import load_config  # noqa: E402
from app.training.bootstrap import bootstrap  # noqa: E402
from bench.training_runs import REPO, machine, mean_se, train  # noqa: E402

ORDERS = ("epochs", "replacement")


def coverage(order: str, rows: int, draws: int, seed: int) -> float:
    """Fraction of the training rows a warm start of `draws` examples sees at least once."""
    if order == "epochs":
        return min(draws, rows) / rows
    rng = random.Random(seed)  # the same draws as app.training.bootstrap
    return len({rng.randrange(rows) for _ in range(draws)}) / rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--orders", nargs="+", choices=ORDERS, default=list(ORDERS))
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "warm_start")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every training run")
    args = parser.parse_args()
    torch.set_num_threads(1)

    cfg = load_config(args.config)
    args.out.mkdir(parents=True, exist_ok=True)
    sft = cfg.model.sft
    draws = sft.steps * sft.batch_size
    from app.data import load_split

    rows = len(load_split(cfg.data, "train", "sft"))
    boundary = rows / sft.batch_size  # the step at which the first epoch ends
    lr_frac = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(boundary, sft.steps) / sft.steps))
    print(f"warm start: {sft.steps} steps x {sft.batch_size} = {draws} examples over {rows} rows "
          f"({draws / rows:.2f} epochs); the first epoch ends at step {boundary:.0f}, where the cosine "
          f"schedule is at {lr_frac:.2f} of model.sft.lr", flush=True)  # fmt: skip

    results = []
    for seed in args.seeds:
        for order in args.orders:
            label = f"{order}-s{seed}"
            model_dir = args.out / "models" / label
            cfg.model.tiny.seed = seed
            t0 = time.perf_counter()
            if not (model_dir / "config.json").exists():
                bootstrap(cfg.model, cfg.data, model_dir, show_progress=False, draws=order)
            warm_s = time.perf_counter() - t0
            run_dir = args.out / "runs" / label
            if (run_dir / "summary.json").exists():
                summary = json.loads((run_dir / "summary.json").read_text())
            else:
                overrides = [f"model.path={model_dir}", "model.bootstrap=false", f"run.seed={seed}",
                             f"run.name=warm-start-{label}", f"tracking.uri=sqlite:///{args.out / 'mlflow.db'}",
                             *args.overrides]  # fmt: skip
                summary = train(args.config, run_dir, overrides)["summary"]
            row = {
                "order": order, "seed": seed, "rows_seen": coverage(order, rows, draws, seed), "warm_start_s": warm_s,
                **{k: summary[k] for k in ("initial_accuracy", "initial_accuracy_se", "final_accuracy",
                                           "accuracy_gain", "accuracy_gain_se", "initial_greedy_accuracy",
                                           "final_greedy_accuracy", "greedy_accuracy_gain", "samples_per_s")},
            }  # fmt: skip
            results.append(row)
            print(f"{label:>15}: rows seen {row['rows_seen']:.1%}, start {row['initial_accuracy']:.2%} "
                  f"(greedy {row['initial_greedy_accuracy']:.2%}), gain {100 * row['accuracy_gain']:+.2f} "
                  f"± {100 * row['accuracy_gain_se']:.2f} points (greedy {100 * row['greedy_accuracy_gain']:+.2f})",
                  flush=True)  # fmt: skip

    table = {}
    print(f"\n{'order':>12} | {'start (sampled)':>18} | {'start (greedy)':>18} | {'gain, points':>16} | "
          f"{'greedy gain':>16}  (mean ± across-seed SE, {len(args.seeds)} seeds)")  # fmt: skip
    for order in args.orders:
        mine = [r for r in results if r["order"] == order]
        stats = {k: mean_se([100 * r[k] for r in mine]) for k in
                 ("initial_accuracy", "initial_greedy_accuracy", "accuracy_gain", "greedy_accuracy_gain")}  # fmt: skip
        table[order] = stats
        print(f"{order:>12} | " + " | ".join(f"{m:>9.2f} ± {s:<5.2f}" for m, s in stats.values()))
    paired = {}
    if set(ORDERS) <= set(args.orders):
        by = {(r["order"], r["seed"]): r for r in results}
        for key in ("initial_accuracy", "accuracy_gain", "greedy_accuracy_gain"):
            diffs = [100 * (by["replacement", s][key] - by["epochs", s][key]) for s in args.seeds]
            paired[key] = mean_se(diffs)
            print(f"replacement - epochs, {key}: {paired[key][0]:+.2f} ± {paired[key][1]:.2f} points, paired by seed")
    out = {"machine": machine(), "config": str(args.config), "overrides": args.overrides, "rows": rows,
           "draws": draws, "epoch_boundary_step": boundary, "lr_fraction_at_boundary": lr_frac,
           "runs": results, "by_order": table, "paired": paired}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
