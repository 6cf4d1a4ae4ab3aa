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
from typing import TYPE_CHECKING

import torch

from app.config import Config, to_yaml
from app.evaluation.held_out import HeldOut
from app.evaluation.metrics import paired_gain
from app.rollout.base import Completion
from app.rollout.fleet import Fleet
from app.tracking import Tracker
from app.training.plots import plot_run
from rewards import Score
from trainer.checkpoint import list_checkpoints, prune_checkpoints, save_checkpoint, step_dir
from trainer.distributed import DistInfo, Reducer, barrier
from trainer.step import TrainBatch

if TYPE_CHECKING:
    from app.training.setup import Policy

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

    @property
    def version(self) -> int:
        """The policy version of the group: its oldest completion's (a staleness bound must not be too lenient)."""
        return min(c.policy_version for c in self.completions)


# ---------------------------------------------------------------------------------------------- step metrics


def step_metrics(
    groups: list[Group],
    lags: list[int],
    rewards: torch.Tensor,
    stats: dict,
    batch: TrainBatch,
    *,
    reducer: Reducer,
    lag_limit: int,
) -> dict[str, float]:
    """Statistics of the groups a step trained on, summed over ranks, so every number is global.

    Policy lag = trainer version (optimizer steps taken before this one) − the version that generated the
    group; `rollout/policy_lag/frac_k` is the share of groups at lag k (the lag histogram). The scoring
    metrics are this rank's, averaged over the tickets its groups came from.
    """
    completions = [c for g in groups for c in g.completions]
    scores = [s for g in groups for s in g.scores]
    lag_max, issued_under = reducer.max_(
        torch.tensor([max(lags), max(g.ticket.lag_bound for g in groups)], dtype=torch.float64)
    ).tolist()
    histogram = [float(sum(lag == k for lag in lags)) for k in range(lag_limit + 1)]
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
    reward, correct, n, length, zero_var, truncated, trained, lag, num_groups, *hist = reducer.sum_(
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
        "advantage/zero_variance_frac": zero_var / num_groups,
        "rollout/policy_lag/mean": lag / num_groups,
        "rollout/policy_lag/max": lag_max,
        "rollout/max_lag": issued_under,
        **{f"rollout/policy_lag/frac_{k}": count / num_groups for k, count in enumerate(hist)},
        **{k: _ticket_mean(tickets.values(), k) for k in keys},
    }


def _ticket_mean(tickets, key: str) -> float:
    """A scoring metric over the step's tickets: a mixture's per-source metric over the tickets that drew the
    source (a ticket without it did not score 0 on it), any other over all of them (absent counts 0)."""
    tickets = list(tickets)
    if key.startswith("reward/source/"):
        values = [m[key] for m in tickets if key in m]
        return sum(values) / len(values)
    return sum(m.get(key, 0.0) for m in tickets) / len(tickets)


class Utilisation:
    """Each step's wall time (from the end of the previous one, evaluation and checkpointing excluded), and
    the fraction of it that rollouts were generating and that the trainer was training."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.restart()

    def restart(self) -> None:
        self.t0, self.busy0 = time.perf_counter(), self.fleet.busy.read()

    def read(self, train_s: float, samples: float) -> dict[str, float]:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        out = {
            "rollout/utilisation": (self.fleet.busy.read() - self.busy0) / wall,
            "train/utilisation": train_s / wall,
            "rollout/server_restarts": float(self.fleet.restarts),
            "rollout/resubmits": float(self.fleet.resubmits),
            "timing/step": wall,
            "throughput/samples_per_s": samples / wall,
        }
        self.restart()
        return out


# ---------------------------------------------------------------------------------------------- history


class History:
    """The per-step metrics of the run: kept in memory for the summary and plot, appended to
    `metrics.jsonl`, logged to MLflow, and replayed from the file when a run resumes."""

    def __init__(
        self,
        run_dir: Path,
        tracker: Tracker,
        reducer: Reducer,
        *,
        is_main: bool,
        time_limit_s: float,
        resumed_at: int,
        counters: dict[str, float] | None = None,
    ):
        self.path, self.tracker, self.reducer = run_dir / "metrics.jsonl", tracker, reducer
        self.is_main, self.time_limit_s = is_main, time_limit_s
        self.rows: list[dict[str, float]] = self._replay(resumed_at) if resumed_at else []
        self.counters: dict[str, float] = counters or {"train_wall_s": 0.0, "samples": 0.0}
        """Run totals over every step, resumed ones included: what `samples_per_s` is computed from."""

    def add(self, step: int, metrics: dict[str, float]) -> None:
        self.counters["train_wall_s"] += metrics["timing/step"]
        self.counters["samples"] += metrics["rollout/samples"]
        self.rows.append(metrics)
        self.tracker.log_metrics(metrics, step=step)
        if self.is_main:
            with open(self.path, "a") as f:
                f.write(json.dumps(metrics) + "\n")

    def out_of_time(self) -> bool:
        """`run.time_limit_s` of training reached, on every rank when it is on one (ranks stop together)."""
        if not self.time_limit_s:
            return False  # the same on every rank: no collective
        flag = self.counters["train_wall_s"] >= self.time_limit_s
        return bool(self.reducer.max_(torch.tensor([float(flag)])).item())

    def _replay(self, upto: int) -> list[dict]:
        """The steps a resumed run already did (later ones were lost with the crash). Rank 0 rewrites the file
        without them before any rank reads it (every rank calls this, at the same point of `train`)."""
        if self.is_main and self.path.is_file():
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


def checkpoint_state(
    cfg: Config, tracker: Tracker, held_out: HeldOut, history: History, step: int, *, evaluated: bool,
    lag_in_force: int,
) -> dict:
    """A checkpoint's state.json: where the run stands (step, data position, MLflow run, counters), the lag bound
    new tickets are issued under (rollout.max_lag, or the one rollout.max_lag=auto has chosen: a resumed run
    continues from it) and the held-out results so far (a resumed run reports the same gains and plot)."""
    return {
        "step": step,
        "policy_version": step,
        "data_cursor": step * cfg.rollout.prompts_per_step,
        "mlflow_run_id": tracker.run_id,
        "eval_accuracy": held_out.history[-1]["eval/accuracy"] if evaluated else None,
        "counters": history.counters,
        "max_lag_in_force": lag_in_force,
        **held_out.state(),
    }  # fmt: skip


async def checkpoint(cfg: Config, policy: Policy, tracker: Tracker, dist: DistInfo, state: dict) -> None:
    """A complete training checkpoint of ``state["step"]``, registered in MLflow as a model version, and old
    ones pruned (the best is kept)."""
    root, step = cfg.run.path / "checkpoints", state["step"]
    path = await asyncio.to_thread(
        save_checkpoint,
        step_dir(root, step),
        model=policy.model,
        tokenizer=policy.tokenizer,
        optimizer=policy.optimizer,
        scheduler=policy.scheduler,
        state=state,
        config_yaml=to_yaml(cfg),
        rank=dist.rank,
        world_size=dist.world_size,
    )
    if not dist.is_main:
        return
    if cfg.tracking.log_model:
        version = await asyncio.to_thread(
            tracker.register_checkpoint,
            path / "model",
            name=cfg.tracking.registered_model or cfg.run.name,
            step=step,
            policy_version=step,
            eval_accuracy=state["eval_accuracy"],
            max_lag=state["max_lag_in_force"],
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


def finish(
    cfg: Config,
    held_out: HeldOut,
    history: History,
    last: int,
    *,
    wall_s: float,
    tracker: Tracker,
    fleet: Fleet,
    dist: DistInfo,
    model_dir: Path,
    resumed_from: int,
) -> dict:
    """summary.json, the plot, and their MLflow artifacts (the last checkpoint is already written)."""
    rows, counters = history.rows, history.counters
    before, after = held_out.results[0], held_out.results[last]
    gain, gain_se = paired_gain(before["sampled"].per_prompt, after["sampled"].per_prompt)
    greedy = "greedy" in before and "greedy" in after
    greedy_gain, greedy_gain_se = (
        paired_gain(before["greedy"].per_prompt, after["greedy"].per_prompt) if greedy else (None, None)
    )
    lags = [h["rollout/policy_lag/mean"] for h in rows]
    summary = {
        "initial_accuracy": before["sampled"].accuracy,
        "final_accuracy": after["sampled"].accuracy,
        "initial_accuracy_se": before["sampled"].stderr,
        "final_accuracy_se": after["sampled"].stderr,
        "accuracy_gain": gain,
        "accuracy_gain_se": gain_se,
        "eval_prompts": len(held_out.rows),
        "eval_samples": before["sampled"].num_samples,
        "initial_greedy_accuracy": before["greedy"].accuracy if "greedy" in before else None,
        "final_greedy_accuracy": after["greedy"].accuracy if "greedy" in after else None,
        "greedy_accuracy_gain": greedy_gain,
        "greedy_accuracy_gain_se": greedy_gain_se,
        "initial_truncated_rate": before["sampled"].truncated_rate,
        "final_truncated_rate": after["sampled"].truncated_rate,
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
        "skipped_prompts": int(rows[-1].get("rollout/skipped_prompts", 0)) if rows else 0,
        "group_size": cfg.rollout.group_size,
        "zero_variance_groups": int(sum(h.get("advantage/zero_variance_groups", 0.0) for h in rows)),
        "samples_per_s": counters["samples"] / max(counters["train_wall_s"], 1e-9),
        "rollout_utilisation": history.mean("rollout/utilisation"),
        "train_utilisation": history.mean("train/utilisation"),
        "server_restarts": fleet.restarts,
        "resubmits": fleet.resubmits,
        "wall_s": wall_s,
        "train_wall_s": counters["train_wall_s"],
        "world_size": dist.world_size,
        "model_dir": str(model_dir),
        "checkpoint_dir": str(step_dir(cfg.run.path / "checkpoints", last) / "model"),
        "mlflow_run_id": tracker.run_id,
        "tracking_uri": tracker.tracking_uri,
        "resumed_from_step": resumed_from or None,
        **tool_summary(rows),
        **source_summary(rows, before["sampled"], after["sampled"]),
        **benchmark_summary(held_out.history),
    }
    if dist.is_main:
        plot_path = cfg.run.path / "training.png"
        title = f"{cfg.run.name}: {cfg.objective.name}, lr {cfg.optim.lr:g}, max_lag {cfg.rollout.max_lag}"
        plot_run(rows, held_out.history, plot_path, title=title)
        (cfg.run.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        tracker.log_metrics(
            {
                "summary/accuracy_gain": gain,
                "summary/accuracy_gain_se": gain_se,
                "summary/samples_per_s": summary["samples_per_s"],
            },
            step=last,
        )
        tracker.log_artifact(plot_path)
        tracker.log_artifact(cfg.run.path / "summary.json")
    tracker.finish()
    return summary


TOOL_KEYS = ("tools/calls_per_trajectory", "tools/error_rate", "tools/timeout_rate", "tools/wait_frac",
             "rollout/turns/mean", "rollout/void_turn_rate")  # fmt: skip


def tool_summary(rows: list[dict]) -> dict:
    """The tool-using answers of a run, averaged over its steps: calls, errors, turns, statuses, and each turn's
    ESS and engine-trainer gap (docs/tools.md); empty without tools."""
    tooled = [r for r in rows if "tools/calls_per_trajectory" in r]
    if not tooled:
        return {}

    def mean(key: str) -> float:
        values = [r[key] for r in tooled if key in r]
        return sum(values) / len(values) if values else float("nan")

    out = {"tools": {key: mean(key) for key in TOOL_KEYS}}
    out["tools"]["statuses"] = {key.rpartition("/")[2]: mean(key) for key in tooled[0] if key.startswith("rollout/status/")}
    turns = sorted({int(k.rpartition("/")[2]) for r in tooled for k in r if k.startswith("loss/ess_turn/")})
    out["tools"]["per_turn"] = {
        str(k): {"ess": mean(f"loss/ess_turn/{k}"), "logprob_gap": mean(f"loss/logprob_gap_turn/{k}")} for k in turns
    }
    return out


def source_summary(rows: list[dict], before, after) -> dict:
    """A mixture's sources (``metadata.data_source``): each one's share of the training samples' correct answers
    over the run, and its held-out sampled pass@1 before and after; empty for one source."""
    prefix = "reward/source/"
    train = {k[len(prefix) : -len("/correct")] for r in rows for k in r if k.startswith(prefix) and k.endswith("/correct")}
    first, last = before.by_source(), after.by_source()
    names = sorted(train | set(first))
    if not names:
        return {}
    out = {}
    for name in names:
        values = [r[f"{prefix}{name}/correct"] for r in rows if f"{prefix}{name}/correct" in r]
        out[name] = {
            "train_correct": sum(values) / len(values) if values else None,
            "initial_accuracy": first[name][0] if name in first else None,
            "final_accuracy": last[name][0] if name in last else None,
            "eval_prompts": first[name][2] if name in first else 0,
        }
    return {"sources": out}


def benchmark_summary(evaluations: list[dict]) -> dict:
    """eval.benchmarks: each one's accuracy (and its SE) at the first and the last evaluation; empty without."""
    if not evaluations:
        return {}
    first, last = evaluations[0], evaluations[-1]
    names = sorted({k.split("/")[1] for k in first if k.startswith("bench/") and k.endswith("/accuracy")})
    if not names:
        return {}
    return {"benchmarks": {
        name: {
            "initial_accuracy": first[f"bench/{name}/accuracy"], "initial_accuracy_se": first[f"bench/{name}/accuracy_se"],
            "final_accuracy": last.get(f"bench/{name}/accuracy"), "final_accuracy_se": last.get(f"bench/{name}/accuracy_se"),
        } for name in names
    }}  # fmt: skip


def rate(per_s: float) -> str:
    """A throughput for people: whole numbers from 10 up, two decimals below (a real model on CPU: 0.36/s)."""
    return f"{per_s:.0f}" if per_s >= 10 else f"{per_s:.2f}"


def _gain(gain: float | None, se: float | None) -> str:
    """`  (gain +x ± y points, z SE)`, or nothing when there is no paired gain."""
    if gain is None or se is None:
        return ""
    z = f", {gain / se:.1f} SE" if se else ""
    return f"  (gain {100 * gain:+.2f} ± {100 * se:.2f} points{z})"


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
        f"{pct(summary['final_greedy_accuracy'])}" + _gain(summary.get("greedy_accuracy_gain"),
                                                          summary.get("greedy_accuracy_gain_se")),  # fmt: skip
        *(
            [
                f"held-out answer found (format), sampled: {pct(summary['initial_answer_rate'])} → "
                f"{pct(summary['final_answer_rate'])}"
            ]
            if summary.get("initial_answer_rate") is not None
            else []
        ),
        *(
            [
                f"held-out completions cut at max_new_tokens, sampled: {pct(summary['initial_truncated_rate'])} → "
                f"{pct(summary['final_truncated_rate'])}"
            ]
            if summary.get("initial_truncated_rate") is not None and summary.get("final_truncated_rate") is not None
            else []
        ),
        f"{summary['steps']} steps, {rate(summary['samples_per_s'])} samples/s (max_lag {summary['max_lag']}"
        + (f" (mean in force {summary['mean_max_lag_in_force']:.2f})" if summary["max_lag"] == "auto" else "")
        + ", "
        f"mean lag {summary['mean_policy_lag']:.2f}, {summary['dropped_groups']} groups dropped), "
        f"wall {summary['wall_s']:.0f} s",
        f"rollout busy {100 * summary['rollout_utilisation']:.0f}% / train busy "
        f"{100 * summary['train_utilisation']:.0f}% of step time",
        *(
            [
                f"rollout.skip_decided: {summary['skipped_prompts']} prompt draws passed over (their "
                f"{summary['skipped_prompts'] * summary['group_size']} completions not generated); "
                f"{summary['zero_variance_groups']} groups generated were all right or all wrong"
            ]
            if summary.get("skipped_prompts")
            else []
        ),
        *_tool_lines(summary.get("tools")),
        *(
            f"source {name}: training samples correct {pct(v['train_correct'])}; held-out sampled pass@1 "
            f"{pct(v['initial_accuracy'])} → {pct(v['final_accuracy'])} ({v['eval_prompts']} prompts)"
            for name, v in (summary.get("sources") or {}).items()
        ),
        *(
            f"benchmark {name}: {pct(v['initial_accuracy'])} ± {100 * v['initial_accuracy_se']:.2f} → "
            f"{pct(v['final_accuracy'])} ± {100 * (v['final_accuracy_se'] or 0):.2f}"
            for name, v in (summary.get("benchmarks") or {}).items()
        ),
        f"MLflow run {summary['mlflow_run_id']} in {summary['tracking_uri']}",
    ]


def _tool_lines(tools: dict | None) -> list[str]:
    if not tools:
        return []
    statuses = ", ".join(f"{name} {100 * share:.1f}%" for name, share in tools["statuses"].items() if share > 0)
    turns = "; ".join(f"turn {k}: ESS {v['ess']:.4f}, gap {v['logprob_gap']:.4f}" for k, v in tools["per_turn"].items())
    return [
        f"tools: {tools['tools/calls_per_trajectory']:.2f} calls and {tools['rollout/turns/mean']:.2f} turns per "
        f"answer, {100 * tools['tools/error_rate']:.1f}% of calls failed, {100 * tools['tools/timeout_rate']:.1f}% "
        f"timed out, {100 * tools['tools/wait_frac']:.0f}% of answer time waiting on tools, void turns "
        f"{100 * tools['rollout/void_turn_rate']:.1f}%",
        f"answers ended: {statuses}",
        f"per turn (engine-trainer logprob gap, nats/token): {turns}",
    ]
