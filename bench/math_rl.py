"""Report the SmolLM2 math pipeline stage by stage: base → SFT (configs/smollm2-sft.yaml) → RL
(configs/smollm2-math.yaml), from what the runs wrote, and draw its curves.

    .venv/bin/python bench/math_rl.py --sft runs/smollm2-sft --rl runs/smollm2-math [--rl RUN_DIR2 ...] \\
        [--base base.json] [--out bench/results/math_rl.json] [--plot bench/plots/smollm2_math.png] [--seeds]

Several --rl runs (e.g. learning rates) are drawn side by side; a run stopped before its end (no summary.json)
contributes its training curve and step metrics only.

- Base: `trustbatch eval <base model> --config configs/smollm2-sft.yaml --out base.json` (same held-out prompts
  and settings), when given.
- SFT: its summary.json (held-out loss, verifier accuracy of the saved model) and its loss curves (MLflow).
- RL: held-out sampled pass@1 (T = 1) and greedy accuracy at the first evaluation (the SFT model) and the last,
  paired by prompt (app/evaluation/metrics.py `paired_gain`), from the last checkpoint's state.json; the
  boxed-answer rates; throughput (samples/s, trainer tokens/s) and where step time went; the training accuracy
  on the prompts trained on, step by step (the sanity-check curve).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.evaluation.metrics import clustered_stderr, paired_gain  # noqa: E402


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def across_seeds(rl: list[dict]) -> dict:
    """Mean held-out gain of runs that differ only in their seed, with the across-seed standard error."""
    out = {}
    for name in ("sampled", "greedy"):
        gains = [r["held_out"][name]["gain"] for r in rl if name in r.get("held_out", {})]
        if len(gains) >= 2:
            mean = sum(gains) / len(gains)
            sd = (sum((g - mean) ** 2 for g in gains) / (len(gains) - 1)) ** 0.5
            out[name] = {"n": len(gains), "mean": mean, "se": sd / len(gains) ** 0.5, "gains": gains}
    return out


def rl_held_out(run_dir: Path) -> dict:
    steps = sorted((run_dir / "checkpoints").glob("step-*/state.json"))
    if not steps:
        raise SystemExit(f"{run_dir}: no checkpoint with a state.json")
    evals = json.loads(steps[-1].read_text())["evals"]
    first, last = evals[min(evals, key=int)], evals[max(evals, key=int)]
    out: dict = {"first_step": int(min(evals, key=int)), "last_step": int(max(evals, key=int))}
    for name in ("sampled", "greedy"):
        if name in first and name in last:
            a, b = first[name]["per_prompt"], last[name]["per_prompt"]
            gain, se = paired_gain(a, b)
            out[name] = {
                "prompts": len(a), "start": sum(a) / len(a), "start_se": clustered_stderr(a), "end": sum(b) / len(b),
                "end_se": clustered_stderr(b), "gain": gain, "gain_se": se, "gain_in_se": gain / se if se else None,
                "start_answer_rate": first[name].get("answer_rate"), "end_answer_rate": last[name].get("answer_rate"),
            }  # fmt: skip
    return out


def sft_curves(summary: dict) -> dict[str, list[tuple[int, float]]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    return {
        key: [(m.step, m.value) for m in sorted(client.get_metric_history(summary["mlflow_run_id"], key), key=lambda m: m.step)]
        for key in ("sft/loss", "sft/held_out_loss")
    }  # fmt: skip


def window(rows: list[dict], key: str, lo: int, hi: int) -> float:
    part = rows[lo:hi]
    return sum(r[key] for r in part) / len(part)


def rl_report(run_dir: Path) -> dict:
    rows = rows_of(run_dir)
    n = len(rows)
    k = min(20, max(1, n // 3))
    out = {
        "run_dir": str(run_dir),
        "lr": json.loads(json.dumps(_lr(run_dir))),
        "steps": n,
        "samples": int(sum(r["rollout/samples"] for r in rows)),
        "train_min": sum(r["timing/step"] for r in rows) / 60,
        "samples_per_s": sum(r["rollout/samples"] for r in rows) / sum(r["timing/step"] for r in rows),
        "trainer_tokens_per_s": window(rows, "perf/train_tokens_per_s", 0, n),
        "rollout_utilisation": window(rows, "rollout/utilisation", 0, n),
        "train_utilisation": window(rows, "train/utilisation", 0, n),
        "completion_tokens": window(rows, "rollout/response_len/mean", 0, n),
        "truncated": window(rows, "rollout/truncated_frac", 0, n),
        "window_steps": k,
        "train_accuracy_first": window(rows, "reward/correct", 0, k),
        "train_accuracy_last": window(rows, "reward/correct", n - k, n),
        "zero_variance_first": window(rows, "advantage/zero_variance_groups", 0, k) / max(1, rows[0]["rollout/samples"] / 8),
        "zero_variance_last": window(rows, "advantage/zero_variance_groups", n - k, n) / max(1, rows[0]["rollout/samples"] / 8),
        "ess": window(rows, "loss/ess", 0, n),
        "entropy": window(rows, "loss/entropy", 0, n),
    }  # fmt: skip
    if (run_dir / "summary.json").is_file():
        out["held_out"] = rl_held_out(run_dir)
    return out


def _lr(run_dir: Path) -> float:
    from app.config import load_config

    return load_config(run_dir / "config.yaml").optim.lr


def plot(path: Path, curves: dict, rl_runs: dict[str, list[dict]], table: list[tuple[str, float | None, float | None]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for key, label in (("sft/loss", "train (per step)"), ("sft/held_out_loss", "held-out")):
        if curves.get(key):
            ax.plot(*zip(*curves[key], strict=True), marker="o" if "held" in key else None, label=label)
    ax.set(title="SFT: loss on the reply tokens", xlabel="SFT step", ylabel="mean NLL per token")
    ax.legend()
    ax = axes[1]
    span = 10
    for label, rl_rows in rl_runs.items():
        steps = [int(r["step"]) for r in rl_rows]
        correct = [r["reward/correct"] for r in rl_rows]
        smooth = [sum(correct[max(0, i - span + 1) : i + 1]) / len(correct[max(0, i - span + 1) : i + 1])
                  for i in range(len(correct))]  # fmt: skip
        (line,) = ax.plot(steps, smooth, label=f"{label} (mean of last {span} steps)")
        ax.plot(steps, correct, alpha=0.2, color=line.get_color())
    ax.set(title="RL: training accuracy on the prompts trained on", xlabel="RL step", ylabel="correct samples",
           ylim=(0, 1))  # fmt: skip
    ax.legend()
    ax = axes[2]
    names = [t[0] for t in table]
    x = range(len(names))
    for offset, idx, label in ((-0.2, 1, "greedy"), (0.2, 2, "sampled pass@1 (T=1)")):
        values = [100 * (t[idx] or 0.0) for t in table]
        ax.bar([i + offset for i in x], values, width=0.4, label=label)
    ax.set_xticks(list(x), names)
    ax.set(title="held-out word problems", ylabel="% correct")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", type=Path, required=True)
    parser.add_argument("--rl", type=Path, action="append", default=[])
    parser.add_argument("--base", type=Path, nargs="*", default=[], help="trustbatch eval --out JSON(s) of the base model")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "math_rl.json")
    parser.add_argument("--plot", type=Path, default=REPO / "bench" / "plots" / "smollm2_math.png")
    parser.add_argument("--seeds", action="store_true",
                        help="the --rl runs are seeds of one config: also their mean gains ± the across-seed SE")
    args = parser.parse_args()
    sft = json.loads((args.sft / "summary.json").read_text())
    rl = [rl_report(run) for run in args.rl]
    base = [json.loads(p.read_text()) for p in args.base]

    def pct(x) -> str:
        return "n/a" if x is None else f"{100 * x:.2f}%"

    print(f"SFT: {sft['steps']} steps ({sft['epochs']:.2f} epochs of {sft['examples']}), {sft['train_s'] / 60:.1f} min, "
          f"{sft['tokens_per_s']:.0f} tokens/s, padding {pct(sft['padding_fraction'])}; held-out loss "
          f"{sft['held_out_loss_first']:.3f} -> {sft['held_out_loss_last']:.3f}; {sft.get('eval_prompts')} held-out "
          f"problems: greedy {pct(sft.get('greedy_accuracy'))}, sampled {pct(sft.get('sampled_accuracy'))} ± "
          f"{100 * (sft.get('sampled_accuracy_se') or 0):.2f}, boxed {pct(sft.get('sampled_answer_rate'))}")  # fmt: skip
    table: list[tuple[str, float | None, float | None]] = []
    if base:  # trustbatch eval JSONs: the greedy one has temperature 0
        by_t = {b["settings"]["temperature"] == 0: b["metrics"]["pass@1"]["value"] for b in base}
        table.append(("base", by_t.get(True), by_t.get(False)))
        print("base: " + ", ".join(f"{'greedy' if b['settings']['temperature'] == 0 else 'sampled'} "
                                   f"{pct(b['metrics']['pass@1']['value'])} on {b['num_prompts']} problems, boxed "
                                   f"{pct(b['answer_rate'])}, {b['completion_tokens_mean']:.1f} tokens" for b in base))  # fmt: skip
    if sft.get("sampled_accuracy") is not None:
        table.append(("SFT", sft.get("greedy_accuracy"), sft.get("sampled_accuracy")))
    else:  # sft.verify=false: the SFT model's numbers are the first RL run's step-0 evaluation
        held = next((r["held_out"] for r in rl if "held_out" in r), None)
        if held:
            table.append(("SFT (RL step 0)", held.get("greedy", {}).get("start"), held["sampled"]["start"]))
    for r in rl:
        print(f"RL {Path(r['run_dir']).name}, lr {r['lr']:g}: {r['steps']} steps, {r['samples']} samples, {r['train_min']:.1f} min, "
              f"{r['samples_per_s']:.2f} samples/s, trainer {r['trainer_tokens_per_s']:.0f} tokens/s, rollout busy "
              f"{pct(r['rollout_utilisation'])}, train busy {pct(r['train_utilisation'])}; {r['completion_tokens']:.1f} "
              f"tokens, truncated {pct(r['truncated'])}; training accuracy {pct(r['train_accuracy_first'])} -> "
              f"{pct(r['train_accuracy_last'])} (first/last {r['window_steps']} steps); all-right-or-wrong groups "
              f"{pct(r['zero_variance_first'])} -> {pct(r['zero_variance_last'])}; mean ESS {r['ess']:.4f}, entropy "
              f"{r['entropy']:.3f}")  # fmt: skip
        held = r.get("held_out")
        if held:
            for name in ("sampled", "greedy"):
                if name in held:
                    h = held[name]
                    print(f"  held-out {name} ({h['prompts']}): {pct(h['start'])} -> {pct(h['end'])}, gain "
                          f"{100 * h['gain']:+.2f} ± {100 * h['gain_se']:.2f} ({h['gain_in_se'] or 0:.1f} SE)")  # fmt: skip
            table.append((f"RL\n{Path(r['run_dir']).name.removeprefix('smollm2-math-')}", held.get("greedy", {}).get("end"), held["sampled"]["end"]))
    seeds = across_seeds(rl) if args.seeds else {}
    for name, s in seeds.items():
        print(f"across {s['n']} seeds, held-out {name}: gain {100 * s['mean']:+.2f} ± {100 * s['se']:.2f} (across-seed SE; "
              f"per seed {', '.join(f'{100 * g:+.2f}' for g in s['gains'])})")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"sft": sft, "rl": rl, "base": base, "across_seeds": seeds}, indent=2, default=str) + "\n")
    plot(args.plot, sft_curves(sft), {f"{Path(r['run_dir']).name}, lr {r['lr']:g}": rows_of(Path(r["run_dir"])) for r in rl},
         table)  # fmt: skip
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
