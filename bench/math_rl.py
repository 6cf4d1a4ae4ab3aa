"""Report the SmolLM2 math pipeline stage by stage: base → SFT (configs/smollm2-sft.yaml) → RL
(configs/smollm2-math.yaml), from what the runs wrote, and draw its curves.

    .venv/bin/python bench/math_rl.py --sft runs/smollm2-sft --rl runs/smollm2-math [--base base.json] \\
        [--out bench/results/math_rl.json] [--plot bench/plots/smollm2_math.png]

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


def plot(path: Path, curves: dict, rl_rows: list[dict], table: list[tuple[str, float | None, float | None]]) -> None:
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
    steps = [int(r["step"]) for r in rl_rows]
    correct = [r["reward/correct"] for r in rl_rows]
    ax.plot(steps, correct, alpha=0.35, label="per step")
    window = 5
    smooth = [sum(correct[max(0, i - window + 1) : i + 1]) / len(correct[max(0, i - window + 1) : i + 1])
              for i in range(len(correct))]  # fmt: skip
    ax.plot(steps, smooth, label=f"mean of last {window} steps")
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
    parser.add_argument("--rl", type=Path, required=True)
    parser.add_argument("--base", type=Path, help="trustbatch eval --out JSON of the base model")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "math_rl.json")
    parser.add_argument("--plot", type=Path, default=REPO / "bench" / "plots" / "smollm2_math.png")
    args = parser.parse_args()
    sft = json.loads((args.sft / "summary.json").read_text())
    rl = json.loads((args.rl / "summary.json").read_text())
    rl_rows = rows_of(args.rl)
    held = rl_held_out(args.rl)
    base = json.loads(args.base.read_text()) if args.base else None

    def pct(x) -> str:
        return "n/a" if x is None else f"{100 * x:.2f}%"

    table: list[tuple[str, float | None, float | None]] = []
    if base is not None:
        print(f"base: {json.dumps({k: base.get(k) for k in ('pass_at_1', 'num_prompts')})}")
    table.append(("SFT", held.get("greedy", {}).get("start"), held["sampled"]["start"]))
    table.append(("SFT + RL", held.get("greedy", {}).get("end"), held["sampled"]["end"]))
    train_s = rl["train_wall_s"]
    tokens = sum(r.get("rollout/response_len/mean", 0) * r["rollout/samples"] for r in rl_rows)
    report = {
        "sft": {k: sft.get(k) for k in ("steps", "epochs", "examples", "train_s", "tokens_per_s", "padding_fraction",
                                        "held_out_loss_first", "held_out_loss_last", "sampled_accuracy",
                                        "sampled_accuracy_se", "greedy_accuracy", "sampled_answer_rate",
                                        "greedy_answer_rate", "model_ref")},
        "rl": {
            "steps": rl["steps"], "train_samples": rl["train_samples"], "train_wall_s": train_s,
            "samples_per_s": rl["samples_per_s"], "completion_tokens_per_s": tokens / train_s,
            "trainer_tokens_per_s": sum(r.get("perf/train_tokens_per_s", 0) for r in rl_rows) / len(rl_rows),
            "rollout_utilisation": rl["rollout_utilisation"], "train_utilisation": rl["train_utilisation"],
            "truncated_first_5": sum(r["rollout/truncated_frac"] for r in rl_rows[:5]) / min(5, len(rl_rows)),
            "truncated_last_5": sum(r["rollout/truncated_frac"] for r in rl_rows[-5:]) / min(5, len(rl_rows)),
            "train_accuracy_first_5": sum(r["reward/correct"] for r in rl_rows[:5]) / min(5, len(rl_rows)),
            "train_accuracy_last_5": sum(r["reward/correct"] for r in rl_rows[-5:]) / min(5, len(rl_rows)),
            "held_out": held,
        },  # fmt: skip
        "base": base,
    }
    print(f"SFT: {sft['steps']} steps ({sft['epochs']:.2f} epochs), {sft['train_s'] / 60:.1f} min, "
          f"{sft['tokens_per_s']:.0f} tokens/s; held-out loss {sft['held_out_loss_first']:.3f} -> "
          f"{sft['held_out_loss_last']:.3f}")  # fmt: skip
    for name in ("sampled", "greedy"):
        if name in held:
            r = held[name]
            print(f"RL held-out {name} ({r['prompts']} prompts): SFT {pct(r['start'])} ± {100 * r['start_se']:.2f} -> "
                  f"{pct(r['end'])} ± {100 * r['end_se']:.2f}; gain {100 * r['gain']:+.2f} ± {100 * r['gain_se']:.2f} "
                  f"points ({r['gain_in_se'] or 0:.1f} SE); boxed {pct(r['start_answer_rate'])} -> "
                  f"{pct(r['end_answer_rate'])}")  # fmt: skip
    x = report["rl"]
    print(f"RL: {x['steps']} steps, {x['train_samples']} samples in {train_s / 60:.1f} min: {x['samples_per_s']:.2f} "
          f"samples/s, {x['completion_tokens_per_s']:.0f} completion tokens/s; rollout busy "
          f"{100 * x['rollout_utilisation']:.0f}%, train busy {100 * x['train_utilisation']:.0f}%; truncated "
          f"{pct(x['truncated_first_5'])} -> {pct(x['truncated_last_5'])}; training accuracy "
          f"{pct(x['train_accuracy_first_5'])} -> {pct(x['train_accuracy_last_5'])} (first/last 5 steps)")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(args.plot, sft_curves(sft), rl_rows, table)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
