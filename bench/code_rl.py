"""Report a code-RL run (`trustbatch train configs/smollm2-code.yaml`) from what it wrote: the held-out start → end
table paired by problem, the truncation rate, and the sandbox's throughput under training load.

    .venv/bin/python bench/code_rl.py RUN_DIR [--out bench/results/code_rl.json]

- Held-out: sampled pass@1 and the greedy pass rate at the first and the last evaluation, from the last
  checkpoint's state.json (each problem's mean correctness), with the paired gain and its SE (clustered by
  problem; app/evaluation/metrics.py `paired_gain`). When the run wrote its evaluations' completions
  (`RUN_DIR/eval/`), the pass rates by task category too.
- Training rollouts: the share cut at `rollout.max_new_tokens` and the share with a code block (the code
  verifier's answer rate), over the first and the last five steps.
- The sandbox under training load: every answered completion runs all of its tests (one sandbox execution each,
  `fail_fast: false`), so executions per step = samples x answer rate x tests per problem; executions/s is that
  over `timing/reward/score` (the scoring wall time of the step's batch, summed over reward workers in parallel),
  and the share of step time is `timing/reward/score / timing/step`. Scoring runs in the rollout producer,
  beside the trainer, so a share below 100% of the producer's spare time is not on the critical path.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.config import load_config  # noqa: E402
from app.evaluation.metrics import clustered_stderr, paired_gain  # noqa: E402


def last_state(run_dir: Path) -> dict:
    steps = sorted((run_dir / "checkpoints").glob("step-*/state.json"))
    if not steps:
        raise SystemExit(f"{run_dir}: no checkpoint with a state.json")
    return json.loads(steps[-1].read_text())


def held_out(state: dict) -> dict:
    evals = state["evals"]
    first, last = evals[min(evals, key=int)], evals[max(evals, key=int)]
    out = {"first_step": int(min(evals, key=int)), "last_step": int(max(evals, key=int))}
    for name in ("sampled", "greedy"):
        if name not in first or name not in last:
            continue
        a, b = first[name]["per_prompt"], last[name]["per_prompt"]
        gain, se = paired_gain(a, b)
        out[name] = {
            "problems": len(a),
            "samples_per_problem": first[name]["samples"] // len(a),
            "start": sum(a) / len(a),
            "start_se": clustered_stderr(a),
            "end": sum(b) / len(b),
            "end_se": clustered_stderr(b),
            "gain": gain,
            "gain_se": se,
            "gain_in_se": gain / se if se else None,
            "start_answer_rate": first[name].get("answer_rate"),
            "end_answer_rate": last[name].get("answer_rate"),
        }
    return out


def by_category(run_dir: Path, first: int, last: int) -> dict:
    """Pass rate per category at the first and last evaluation, from RUN_DIR/eval/ (when the run wrote it)."""
    cfg = load_config(run_dir / "config.yaml")
    from app.data import load_split

    category = {row.id: row.metadata.get("category", "?") for row in load_split(cfg.data, "eval")}
    out: dict = {}
    for step in (first, last):
        path = run_dir / "eval" / f"step-{step:06d}-sampled.jsonl"
        if not path.is_file():
            return {}
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            c = counts[category.get(sample["prompt"], "?")]
            c[0] += bool(sample["correct"])
            c[1] += 1
        out[str(step)] = {k: {"correct": v[0], "samples": v[1], "rate": v[0] / v[1]} for k, v in sorted(counts.items())}
    return out


def rollouts(rows: list[dict], num_tests: int) -> dict:
    def window(part: list[dict]) -> dict:
        samples = sum(r["rollout/samples"] for r in part)
        executions = sum(r["rollout/samples"] * r.get("reward/code/answer_rate", 1.0) * num_tests for r in part)
        score_s = sum(r["timing/reward/score"] for r in part)
        return {
            "steps": [int(part[0]["step"]), int(part[-1]["step"])],
            "truncated_rate": sum(r["rollout/truncated_frac"] * r["rollout/samples"] for r in part) / samples,
            "answer_rate": sum(r.get("reward/code/answer_rate", float("nan")) * r["rollout/samples"] for r in part)
            / samples,
            "reward_mean": sum(r["reward/mean"] * r["rollout/samples"] for r in part) / samples,
            "response_tokens_mean": sum(r["rollout/response_len/mean"] * r["rollout/samples"] for r in part)
            / samples,
            "sandbox_executions": executions,
            "scoring_s": score_s,
            "executions_per_s": executions / score_s if score_s else None,
            "scoring_share_of_step_time": score_s / sum(r["timing/step"] for r in part),
        }

    return {"first_5": window(rows[:5]), "last_5": window(rows[-5:]), "all": window(rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "code_rl.json")
    args = parser.parse_args()
    run_dir = args.run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = load_config(run_dir / "config.yaml")
    state = last_state(run_dir)
    report = {
        "run_dir": str(run_dir),
        "steps": summary["steps"],
        "train_samples": summary["train_samples"],
        "train_wall_s": summary["train_wall_s"],
        "samples_per_s": summary["samples_per_s"],
        "sandbox_backend": cfg.rewards.verifiers[0].params.get("backend", "auto"),
        "held_out": held_out(state),
        "rollouts": rollouts(rows, cfg.data.python_functions.num_tests),
    }
    h = report["held_out"]
    report["by_category"] = by_category(run_dir, h["first_step"], h["last_step"])

    def pct(x: float) -> str:
        return f"{100 * x:.2f}%"

    print(f"{run_dir}: {summary['steps']} steps, {summary['train_samples']} samples, "
          f"{summary['train_wall_s'] / 60:.1f} min of training, {summary['samples_per_s']:.2f} samples/s")  # fmt: skip
    for name, r in ((n, h[n]) for n in ("sampled", "greedy") if n in h):
        print(f"held-out {name} ({r['problems']} problems x {r['samples_per_problem']}): {pct(r['start'])} ± "
              f"{100 * r['start_se']:.2f} → {pct(r['end'])} ± {100 * r['end_se']:.2f}, gain {100 * r['gain']:+.2f} "
              f"± {100 * r['gain_se']:.2f} points ({r['gain_in_se'] or 0:.1f} SE)")  # fmt: skip
    for window, r in report["rollouts"].items():
        print(f"rollouts {window} (steps {r['steps'][0]}-{r['steps'][1]}): truncated {pct(r['truncated_rate'])}, "
              f"code block {pct(r['answer_rate'])}, reward {r['reward_mean']:.3f}, {r['response_tokens_mean']:.0f} "
              f"tokens; sandbox {r['sandbox_executions']:.0f} executions in {r['scoring_s']:.1f} s "
              f"({r['executions_per_s']:.1f}/s), scoring = {pct(r['scoring_share_of_step_time'])} of step time")  # fmt: skip
    for step, cats in report["by_category"].items():
        print(f"step {step} by category: " + ", ".join(f"{k} {pct(v['rate'])}" for k, v in cats.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
