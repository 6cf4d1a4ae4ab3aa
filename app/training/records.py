"""What a training run records, beside the loop: step metrics, checkpoints and their MLflow versions, the
per-step history (metrics.jsonl, replayed on resume) and the end-of-run summary.

The loop (app/training/loop.py) calls these at fixed points and never reads back what they write, except on
resume. Every metric is global over ranks, except the scoring metrics (error and timeout rates, per-verifier
means: each rank's own, and rank 0's are logged); only rank 0 writes files. The keys are listed in the metric
glossary (trainer/README.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.config import to_yaml
from app.evaluation import paired_gain
from app.rollout.base import Completion
from app.training.plots import plot_run
from app.training.runtime import Evaluator, Parts
from rewards import Score
from trainer.checkpoint import list_checkpoints, prune_checkpoints, save_checkpoint, step_dir
from trainer.distributed import barrier
from trainer.step import TrainBatch

log = logging.getLogger("trustbatch")


@dataclass(frozen=True)
class Ticket:
    """One ticket's prompts as scored: its number, the scoring metrics of all its samples (error and
    timeout rates, per-verifier means) and the lag bound it was issued under. Every group of the ticket points
    at the same record."""

    number: int
    scoring: dict[str, float]
    lag_bound: int = 0


@dataclass
class Group:
    """The `group_size` scored completions of one prompt, from one ticket."""

    ticket: Ticket
    completions: list[Completion]
    scores: list[Score]


# ---------------------------------------------------------------------------------------------- step metrics


def step_metrics(
    p: Parts, groups: list[Group], lags: list[int], rewards: torch.Tensor, stats: dict, batch: TrainBatch
) -> dict[str, float]:
    """Statistics of the groups a step trained on, summed over ranks, so every number is global.

    Policy lag = trainer version (optimizer steps taken before this one) − the version that generated the
    group; `rollout/policy_lag/frac_k` is the share of groups at lag k (the lag histogram). The scoring
    metrics are this rank's, averaged over the tickets its groups came from.
    """
    completions = [c for g in groups for c in g.completions]
    scores = [s for g in groups for s in g.scores]
    max_lag = p.cfg.rollout.lag_limit
    lag_max, issued_under = p.reducer.max_(
        torch.tensor([max(lags), max(g.ticket.lag_bound for g in groups)], dtype=torch.float64)
    ).tolist()
    histogram = [float(sum(lag == k for lag in lags)) for k in range(max_lag + 1)]
    sums = torch.tensor(
        [
            float(rewards.sum()),
            float(sum(bool(s.correct) for s in scores)),
            float(len(scores)),
            float(sum(len(c.output_ids) for c in completions)),
            stats["advantage/zero_variance_groups"],
            float(sum(c.finish_reason == "length" for c in completions)),
            float(batch.batch_size),
            float(sum(lags)),
            float(len(lags)),
            *histogram,
        ],
        dtype=torch.float64,
    )
    reward, correct, n, length, zero_var, truncated, trained, lag, num_groups, *hist = p.reducer.sum_(
        sums
    ).tolist()
    tickets = {g.ticket.number: g.ticket.scoring for g in groups}
    keys = sorted({k for m in tickets.values() for k in m if k != "reward/mean"})
    return {
        "reward/mean": reward / n,
        "reward/correct": correct / n,
        "rollout/samples": n,
        "rollout/response_len/mean": length / n,
        "rollout/truncated_frac": truncated / n,
        "rollout/trained_frac": trained / n,
        "advantage/zero_variance_groups": zero_var,
        "rollout/policy_lag/mean": lag / num_groups,
        "rollout/policy_lag/max": lag_max,
        "rollout/max_lag": issued_under,
        **{f"rollout/policy_lag/frac_{k}": count / num_groups for k, count in enumerate(hist)},
        **{k: sum(m.get(k, 0.0) for m in tickets.values()) / len(tickets) for k in keys},
    }


class Utilisation:
    """Each step's wall time (from the end of the previous one, evaluation and checkpointing excluded), and
    the fraction of it that rollouts were generating and that the trainer was training."""

    def __init__(self, p: Parts):
        self.p = p
        self.restart()

    def restart(self) -> None:
        self.t0, self.busy0 = time.perf_counter(), self.p.fleet.busy.read()

    def read(self, train_s: float, samples: float) -> dict[str, float]:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        out = {
            "rollout/utilisation": (self.p.fleet.busy.read() - self.busy0) / wall,
            "train/utilisation": train_s / wall,
            "rollout/server_restarts": float(self.p.fleet.restarts),
            "rollout/resubmits": float(self.p.fleet.resubmits),
            "timing/step": wall,
            "throughput/samples_per_s": samples / wall,
        }
        self.restart()
        return out


# ---------------------------------------------------------------------------------------------- history


class History:
    """The per-step metrics of the run: kept in memory for the summary and plot, appended to
    `metrics.jsonl`, logged to MLflow, and replayed from the file when a run resumes."""

    def __init__(self, p: Parts, resumed_at: int):
        self.p, self.path = p, p.cfg.run.path / "metrics.jsonl"
        self.rows: list[dict[str, float]] = self._replay(resumed_at) if resumed_at else []
        self.counters: dict[str, float] = p.resume.state.get(
            "counters", {"train_wall_s": 0.0, "samples": 0.0}
        )
        """Run totals over every step, resumed ones included: what `samples_per_s` is computed from."""

    def add(self, step: int, metrics: dict[str, float]) -> None:
        self.counters["train_wall_s"] += metrics["timing/step"]
        self.counters["samples"] += metrics["rollout/samples"]
        self.rows.append(metrics)
        self.p.tracker.log_metrics(metrics, step=step)
        if self.p.dist.is_main:
            with open(self.path, "a") as f:
                f.write(json.dumps(metrics) + "\n")

    def out_of_time(self) -> bool:
        """`run.time_limit_s` of training reached, on every rank when it is on one (ranks stop together)."""
        limit = self.p.cfg.run.time_limit_s
        if not limit:
            return False  # the same on every rank: no collective
        flag = self.counters["train_wall_s"] >= limit
        return bool(self.p.reducer.max_(torch.tensor([float(flag)])).item())

    def _replay(self, upto: int) -> list[dict]:
        """The steps a resumed run already did (later ones were lost with the crash). Rank 0 rewrites the file
        without them before any rank reads it (every rank calls this, at the same point of `train`)."""
        if self.p.dist.is_main and self.path.is_file():
            rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            kept = {int(r["step"]): r for r in rows if int(r["step"]) <= upto}  # a redone step: last wins
            self.path.write_text("".join(json.dumps(kept[s]) + "\n" for s in sorted(kept)))
        barrier()
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def mean(self, key: str) -> float:
        values = [h[key] for h in self.rows if key in h]
        return sum(values) / len(values) if values else 0.0


# ---------------------------------------------------------------------------------------------- checkpoints


async def checkpoint(
    p: Parts, evaluator: Evaluator, history: History, step: int, *, evaluated: bool, lag_in_force: int
) -> None:
    """A complete training checkpoint, registered in MLflow as a model version, and old ones pruned.

    `lag_in_force`: the lag bound new tickets are issued under (rollout.max_lag, or the one rollout.max_lag=auto
    has chosen); a resumed run continues from it.
    """
    cfg = p.cfg
    root = cfg.run.path / "checkpoints"
    accuracy = evaluator.history[-1]["eval/accuracy"] if evaluated else None
    state = {
        "step": step,
        "policy_version": step,
        "data_cursor": step * cfg.rollout.prompts_per_step,
        "mlflow_run_id": p.tracker.run_id,
        "eval_accuracy": accuracy,
        "counters": history.counters,
        "max_lag_in_force": lag_in_force,
        **evaluator.state(),
    }
    path = await asyncio.to_thread(
        save_checkpoint,
        step_dir(root, step),
        model=p.model,
        tokenizer=p.tokenizer,
        optimizer=p.optimizer,
        scheduler=p.scheduler,
        state=state,
        config_yaml=to_yaml(cfg),
        rank=p.dist.rank,
        world_size=p.dist.world_size,
    )
    if not p.dist.is_main:
        return
    if cfg.tracking.log_model:
        version = await asyncio.to_thread(
            p.tracker.register_checkpoint,
            path / "model",
            name=cfg.tracking.registered_model or cfg.run.name,
            step=step,
            policy_version=step,
            eval_accuracy=accuracy,
            max_lag=lag_in_force,
        )
        log.info("step %d: checkpoint %s (model version %s)", step, path, version)
    best = _best_checkpoint(root)
    prune_checkpoints(root, keep_last=cfg.checkpoint.keep_last, keep=(best,) if best else ())


def _best_checkpoint(root: Path) -> Path | None:
    """The kept checkpoint with the highest held-out accuracy (never pruned)."""
    best, best_acc = None, float("-inf")
    for _, path in list_checkpoints(root):
        acc = json.loads((path / "state.json").read_text()).get("eval_accuracy")
        if acc is not None and acc > best_acc:
            best, best_acc = path, acc
    return best


# ---------------------------------------------------------------------------------------------- summary


def finish(p: Parts, evaluator: Evaluator, history: History, last: int, wall_s: float) -> dict:
    """summary.json, the plot, and their MLflow artifacts (the last checkpoint is already written)."""
    cfg, rows, counters = p.cfg, history.rows, history.counters
    before, after = evaluator.results[0], evaluator.results[last]
    gain, gain_se = paired_gain(before["sampled"], after["sampled"])
    lags = [h["rollout/policy_lag/mean"] for h in rows]
    summary = {
        "initial_accuracy": before["sampled"].accuracy,
        "final_accuracy": after["sampled"].accuracy,
        "initial_accuracy_se": before["sampled"].stderr,
        "final_accuracy_se": after["sampled"].stderr,
        "accuracy_gain": gain,
        "accuracy_gain_se": gain_se,
        "eval_prompts": len(p.eval.rows),
        "eval_samples": before["sampled"].samples,
        "initial_greedy_accuracy": before["greedy"].accuracy if "greedy" in before else None,
        "final_greedy_accuracy": after["greedy"].accuracy if "greedy" in after else None,
        "initial_answer_rate": before["sampled"].answer_rate,
        "final_answer_rate": after["sampled"].answer_rate,
        "initial_greedy_answer_rate": before["greedy"].answer_rate if "greedy" in before else None,
        "final_greedy_answer_rate": after["greedy"].answer_rate if "greedy" in after else None,
        "steps": last,
        "max_lag": cfg.rollout.max_lag,
        "mean_max_lag_in_force": history.mean("rollout/max_lag"),
        "mean_policy_lag": sum(lags) / len(lags) if lags else 0.0,
        "dropped_groups": int(rows[-1]["buffer/dropped_groups"]) if rows else 0,
        "skipped_steps": int(sum(h["train/skipped"] for h in rows)),
        "clipped_fraction": sum(h.get("train/clipped", 0.0) for h in rows) / len(rows) if rows else 0.0,
        "train_samples": int(counters["samples"]),
        "samples_per_s": counters["samples"] / max(counters["train_wall_s"], 1e-9),
        "rollout_utilisation": history.mean("rollout/utilisation"),
        "train_utilisation": history.mean("train/utilisation"),
        "server_restarts": p.fleet.restarts,
        "resubmits": p.fleet.resubmits,
        "wall_s": wall_s,
        "train_wall_s": counters["train_wall_s"],
        "world_size": p.dist.world_size,
        "model_dir": str(p.model_dir),
        "checkpoint_dir": str(step_dir(cfg.run.path / "checkpoints", last) / "model"),
        "mlflow_run_id": p.tracker.run_id,
        "tracking_uri": p.tracker.tracking_uri,
        "resumed_from_step": p.resume.step or None,
    }
    if p.dist.is_main:
        plot_path = cfg.run.path / "training.png"
        title = f"{cfg.run.name}: {cfg.objective.name}, lr {cfg.optim.lr:g}, max_lag {cfg.rollout.max_lag}"
        plot_run(rows, evaluator.history, plot_path, title=title)
        (cfg.run.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        p.tracker.log_metrics(
            {
                "summary/accuracy_gain": gain,
                "summary/accuracy_gain_se": gain_se,
                "summary/samples_per_s": summary["samples_per_s"],
            },
            step=last,
        )
        p.tracker.log_artifact(plot_path)
        p.tracker.log_artifact(cfg.run.path / "summary.json")
    p.tracker.finish()
    return summary


def rate(per_s: float) -> str:
    """A throughput for people: whole numbers from 10 up, two decimals below (a real model on CPU: 0.36/s)."""
    return f"{per_s:.0f}" if per_s >= 10 else f"{per_s:.2f}"


def summary_lines(summary: dict) -> list[str]:
    """What `trustbatch train` prints at the end."""

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.2f}%"

    se = summary["accuracy_gain_se"]
    z = summary["accuracy_gain"] / se if se else float("nan")
    return [
        f"held-out sampled pass@1: {pct(summary['initial_accuracy'])} → {pct(summary['final_accuracy'])}"
        f"  (gain {100 * summary['accuracy_gain']:+.2f} ± {100 * se:.2f} points, {z:.1f} SE;"
        f" {summary['eval_samples']} samples each)",
        f"held-out greedy accuracy: {pct(summary['initial_greedy_accuracy'])} → "
        f"{pct(summary['final_greedy_accuracy'])}",
        *(
            [
                f"held-out answer found (format), sampled: {pct(summary['initial_answer_rate'])} → "
                f"{pct(summary['final_answer_rate'])}"
            ]
            if summary.get("initial_answer_rate") is not None
            else []
        ),
        f"{summary['steps']} steps, {rate(summary['samples_per_s'])} samples/s (max_lag {summary['max_lag']}"
        + (f" (mean in force {summary['mean_max_lag_in_force']:.2f})" if summary["max_lag"] == "auto" else "")
        + ", "
        f"mean lag {summary['mean_policy_lag']:.2f}, {summary['dropped_groups']} groups dropped), "
        f"wall {summary['wall_s']:.0f} s",
        f"rollout busy {100 * summary['rollout_utilisation']:.0f}% / train busy "
        f"{100 * summary['train_utilisation']:.0f}% of step time",
        f"MLflow run {summary['mlflow_run_id']} in {summary['tracking_uri']}",
    ]
