"""The training loop: rollouts and training run at the same time, held together by a bound on policy lag.

This file is the architecture. Two tasks per rank share one event loop (asyncio); blocking work (sampling on
the servers, scoring, `train_step`, saving weights) happens in other processes or worker threads, so neither
task stops the other:

    task        consumes                       waits for                          unblocks
    ----------  -----------------------------  ---------------------------------  ----------------------------
    produce     prompt tickets (one per step)  engines to hold version            the trainer (groups in the
                                               >= ticket - 1 - max_lag (clock);   buffer); exact_lag: the
                                               room in the buffer                 publish of the next version
    train       scored groups from the buffer  `prompts_per_step` groups whose    produce (a new version on the
                (oldest first; too-stale ones  lag <= max_lag                     clock, room in the buffer)
                dropped and counted)

One step of `train`: take groups → group advantages → `train_step` (ESS objective) → save the new weights and
push them to every rollout server as version `step` (the push finishes in the background; the clock
advances when every server holds it) → log; every `eval.every` steps evaluate, every `checkpoint.every` steps
checkpoint and register an MLflow model version. `rollout.max_lag = 0` is the synchronous loop: ticket t
waits for the weights of step t - 1 (app/buffer.py). Held-out evaluation runs before the first step, every
`eval.every` steps and after the last. Under `torchrun` every rank runs both tasks on its share of each
ticket; collectives happen only in the train task, in the same order on every rank. Only rank 0 writes files.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from app.buffer import PolicyClock, StalenessBuffer, Versioned, Watermark, publish_gate, ticket_gate
from app.config import Config, to_yaml
from app.eval import paired_gain
from app.plots import plot_run
from app.rollout.base import Completion, WeightSource
from app.rollout.batching import build_train_batch
from app.runtime import Evaluator, Parts, PromptSampler, completions_version, find_resume, setup
from app.scoring import score_texts
from rewards import Score
from trainer.advantages import group_advantages, informative_groups
from trainer.checkpoint import (
    list_checkpoints,
    prune_checkpoints,
    save_checkpoint,
    save_hf_checkpoint,
    step_dir,
)
from trainer.distributed import barrier, full_state_dict
from trainer.step import TrainBatch, train_step

log = logging.getLogger("trustbatch")


@dataclass
class Group:
    """The `group_size` scored completions of one prompt, from one ticket."""

    ticket: int
    completions: list[Completion]
    scores: list[Score]
    reward_metrics: dict[str, float]
    """The scoring metrics of the ticket it came from (error and timeout rates, per-verifier means)."""


def run(cfg: Config) -> dict:
    t_start = time.perf_counter()
    resume = find_resume(cfg)
    if resume.run_dir is not None and resume.run_dir.resolve() != cfg.run.path.resolve():
        log.info("resume: writing to the interrupted run's directory %s", resume.run_dir)
        cfg = replace(cfg, run=replace(cfg.run, dir=str(resume.run_dir)))
    p = setup(cfg, resume)
    try:
        return asyncio.run(train(cfg, p, t_start))
    except BaseException:
        p.tracker.finish("FAILED")  # a resumed run sets it RUNNING again
        raise
    finally:
        p.close()


async def train(cfg: Config, p: Parts, t_start: float) -> dict:
    r, start = cfg.rollout, p.resume.step
    per_rank = len(range(p.dist.rank, r.prompts_per_step, p.dist.world_size))
    clock = PolicyClock(start)
    buffer: StalenessBuffer[Group] = StalenessBuffer(r.max_lag, capacity=(r.max_lag + 1) * max(per_rank, 1))
    generated = Watermark(start)
    publisher = Publisher(cfg, p, clock, generated, on_error=buffer.close)
    evaluator = Evaluator(cfg, p)
    loop = asyncio.get_running_loop()

    def generate_blocking(prompts, params):  # for evaluation, which runs in a worker thread
        return asyncio.run_coroutine_threadsafe(p.fleet.generate(prompts, params), loop).result()

    async def evaluate(step: int) -> dict[str, float]:
        await publisher.flush()  # the engines hold the weights of `step`
        return await asyncio.to_thread(evaluator, step, generate_blocking)

    await publisher.connect()
    p.fleet.start_watchdog()
    producer = asyncio.create_task(produce(cfg, p, clock, buffer, generated, first_ticket=start + 1))
    history: list[dict[str, float]] = _read_history(cfg, start) if start else []
    counters = p.resume.state.get("counters", {"train_wall_s": 0.0, "samples": 0.0})
    try:
        if start == 0:
            first = await evaluate(0)
            if p.dist.is_main:
                log.info(
                    "step 0: held-out sampled pass@1 %.2f%% ± %.2f, greedy %.2f%%",
                    100 * first["eval/accuracy"],
                    100 * first["eval/accuracy_se"],
                    100 * first.get("eval/greedy_accuracy", float("nan")),
                )
        bar = tqdm(
            range(start + 1, cfg.run.steps + 1),
            desc="train",
            initial=start,
            total=cfg.run.steps,
            disable=not p.dist.is_main,
            dynamic_ncols=True,
        )
        meter = Utilisation(p)
        last = start
        for step in bar:
            metrics = await train_one_step(cfg, p, buffer, publisher, step, per_rank)
            metrics.update(meter.read(metrics["timing/train"]))
            metrics["throughput/samples_per_s"] = metrics["rollout/samples"] / metrics["timing/step"]
            counters["train_wall_s"] += metrics["timing/step"]
            counters["samples"] += metrics["rollout/samples"]
            history.append(metrics)
            p.tracker.log_metrics(metrics, step=step)
            _append_history(cfg, p, metrics)
            last = step
            out_of_time = bool(cfg.run.time_limit_s) and _any_rank(
                p, counters["train_wall_s"] >= cfg.run.time_limit_s
            )
            final = step == cfg.run.steps or out_of_time
            evaluated = final or bool(cfg.eval.every and step % cfg.eval.every == 0)
            if evaluated:
                await evaluate(step)
            if final or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                await checkpoint(cfg, p, evaluator, step, counters, evaluated=evaluated)
            meter.restart()  # evaluation and checkpointing are not part of the next step's wall time
            bar.set_postfix(
                reward=f"{metrics['reward/mean']:.3f}",
                acc=f"{100 * evaluator.history[-1]['eval/accuracy']:.1f}",
                ess=f"{metrics['loss/ess']:.3f}",
                lag=f"{metrics['rollout/policy_lag/mean']:.1f}",
                sps=f"{metrics['throughput/samples_per_s']:.0f}",
            )
            if out_of_time:
                log.info("run.time_limit_s=%g reached after step %d", cfg.run.time_limit_s, step)
                break
        bar.close()
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await publisher.close()
        await p.fleet.close()
    return finish(cfg, p, evaluator, history, counters, last, wall_s=time.perf_counter() - t_start)


# ---------------------------------------------------------------------------------------------- produce


async def produce(
    cfg: Config,
    p: Parts,
    clock: PolicyClock,
    buffer: StalenessBuffer[Group],
    generated: Watermark,
    *,
    first_ticket: int,
) -> None:
    """Issue ticket after ticket as the lag bound allows; each generates, scores and queues its groups.

    Tickets run concurrently (at most max_lag + 1 at a time, by the clock), and queue their groups in ticket
    order. Runs until cancelled; a ticket that fails for good closes the buffer with its error, which stops
    the trainer.
    """
    sampler = PromptSampler(len(p.train.rows), cfg.run.seed, cursor=(first_ticket - 1) * cfg.rollout.prompts_per_step)
    finished: set[int] = set()
    queued_before: asyncio.Future | None = None
    tasks: set[asyncio.Task] = set()

    async def one_ticket(ticket: int, chosen: list[int], turn: asyncio.Future | None, mine: asyncio.Future):
        try:
            completions = await p.fleet.generate(
                [p.train.ids[i] for i in chosen],
                replace(p.sampling, seed=cfg.run.seed * 100_003 + ticket * 64 + p.dist.rank),
            )
            finished.add(ticket)
            while generated.value + 1 in finished:  # the watermark: every ticket up to it has generated
                await generated.advance(generated.value + 1)
            rows = [p.train.rows[i] for i in chosen for _ in range(p.sampling.n)]
            texts = [p.decode(c.output_ids) for c in completions]
            scores, reward_metrics = await asyncio.to_thread(score_texts, p.runner, rows, texts)
            n = p.sampling.n
            groups = [
                Group(ticket, completions[k * n : (k + 1) * n], scores[k * n : (k + 1) * n], reward_metrics)
                for k in range(len(chosen))
            ]
            if turn is not None:
                await turn  # queue after the previous ticket, so the trainer sees tickets in order
            await buffer.put([Versioned(g, completions_version(g.completions)) for g in groups])
            mine.set_result(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the trainer must hear of it
            await buffer.close(exc)
            raise

    try:
        ticket = first_ticket
        while True:
            await clock.wait_for(ticket_gate(ticket, cfg.rollout.max_lag))
            chosen = sampler.take(cfg.rollout.prompts_per_step)[p.dist.rank :: p.dist.world_size]
            mine = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(one_ticket(ticket, chosen, queued_before, mine), name=f"ticket-{ticket}")
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            queued_before, ticket = mine, ticket + 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------------------------------- train


async def train_one_step(
    cfg: Config, p: Parts, buffer: StalenessBuffer[Group], publisher: Publisher, step: int, per_rank: int
) -> dict[str, float]:
    t0 = time.perf_counter()
    taken = await buffer.take(per_rank, trainer_version=step - 1)
    t1 = time.perf_counter()
    groups = [item.item for item in taken]
    batch, rewards, stats = to_train_batch(cfg, p, groups)
    step_metrics = await asyncio.to_thread(
        train_step, p.model, p.optimizer, batch, cfg.objective, p.reducer, cfg.trainer, scheduler=p.scheduler
    )
    t2 = time.perf_counter()
    await publisher.publish(step)
    t3 = time.perf_counter()
    metrics = {
        "step": step,
        **rollout_metrics(p, groups, [step - 1 - item.version for item in taken], rewards, stats, batch),
        **reward_metrics(groups),
        **step_metrics,
        "buffer/dropped_groups": float(buffer.stats.dropped),
        "buffer/size": float(len(buffer)),
        "timing/wait_rollout": t1 - t0,
        "timing/train": t2 - t1,
        "timing/weight_save": t3 - t2,
        "timing/weight_sync": publisher.last_sync_s,
        "timing/step": t3 - t0,
    }
    return metrics


def to_train_batch(cfg: Config, p: Parts, groups: list[Group]) -> tuple[TrainBatch, torch.Tensor, dict]:
    """Group advantages → the padded TrainBatch of the groups worth training on."""
    rewards = torch.tensor([[s.reward for s in g.scores] for g in groups], dtype=torch.float32)
    advantages, stats = group_advantages(rewards, scale_by_std=cfg.advantage.scale_by_std)
    keep = list(range(rewards.shape[0]))
    if cfg.advantage.drop_zero_variance_groups:
        # A rank with no informative group keeps one (advantage 0) so it still joins the step's collectives.
        keep = informative_groups(rewards).nonzero().flatten().tolist() or [0]
    batch = build_train_batch(
        [c for g in keep for c in groups[g].completions],
        advantages[keep].flatten().tolist(),
        pad_id=p.tokenizer.pad_token_id,
        temperature=cfg.rollout.temperature,
    )
    return batch, rewards, stats


def rollout_metrics(
    p: Parts, groups: list[Group], lags: list[int], rewards: torch.Tensor, stats: dict, batch: TrainBatch
) -> dict[str, float]:
    """Statistics of the groups a step trained on, summed over ranks, so every number is global.

    Policy lag = trainer version (optimizer steps taken before this one) − the version that generated the
    group; `rollout/policy_lag/frac_k` is the share of groups at lag k (the lag histogram).
    """
    completions = [c for g in groups for c in g.completions]
    scores = [s for g in groups for s in g.scores]
    max_lag = p.cfg.rollout.max_lag
    lag_max = p.reducer.max_(torch.tensor([max(lags)], dtype=torch.float64)).item()
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
    reward, correct, n, length, zero_var, truncated, trained, lag, num_groups, *hist = p.reducer.sum_(sums).tolist()
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
        **{f"rollout/policy_lag/frac_{k}": count / num_groups for k, count in enumerate(hist)},
    }


def reward_metrics(groups: list[Group]) -> dict[str, float]:
    """This rank's scoring metrics, averaged over the tickets its groups came from."""
    by_ticket = {g.ticket: g.reward_metrics for g in groups}
    keys = {k for m in by_ticket.values() for k in m if k != "reward/mean"}
    return {k: sum(m.get(k, 0.0) for m in by_ticket.values()) / len(by_ticket) for k in sorted(keys)}


class Utilisation:
    """Fraction of each step's wall time that rollouts were generating and that the trainer was training."""

    def __init__(self, p: Parts):
        self.p = p
        self.restart()

    def restart(self) -> None:
        self.t0, self.busy0 = time.perf_counter(), self.p.fleet.busy.read()

    def read(self, train_s: float) -> dict[str, float]:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        out = {
            "rollout/utilisation": (self.p.fleet.busy.read() - self.busy0) / wall,
            "train/utilisation": train_s / wall,
            "rollout/server_restarts": float(self.p.fleet.restarts),
            "rollout/resubmits": float(self.p.fleet.resubmits),
            "timing/step": wall,
        }
        self.restart()
        return out


# ---------------------------------------------------------------------------------------------- weights


class Publisher:
    """Hands each new policy version to the rollout engines.

    `publish(version)` saves the weights (they must be copied before the next step changes them) and returns;
    the push to the servers runs in the background, one version after another, and advances the clock when
    every server holds the version. Versions live in `weights/v<N>/`; the three newest stay on disk (a server
    restarted by the watchdog loads the newest). The embedded engine gets the state dict in memory.
    """

    def __init__(self, cfg: Config, p: Parts, clock: PolicyClock, generated: Watermark, *, on_error):
        self.cfg, self.p, self.clock, self.generated = cfg, p, clock, generated
        self.on_error = on_error
        """Awaited with the exception when a background push fails for good (it stops the trainer)."""
        self.last_sync_s = 0.0
        """Seconds the latest completed push took (save excluded)."""
        self._task: asyncio.Task | None = None

    async def connect(self) -> None:
        """Wait for the servers, and hand a resumed run's weights to servers it did not start."""
        fleet = self.p.fleet
        if fleet.http:
            await fleet.engine.wait_healthy()
        if fleet.latest is not None and not fleet.servers:
            path, version = fleet.latest
            await fleet.publish(WeightSource(path=path), version)

    async def publish(self, version: int) -> None:
        if self.p.fleet.http and self.p.fleet.weight_sync is None:
            path = self.p.weights_dir / f"v{version}"
            await asyncio.to_thread(self._save, path)
            source = WeightSource(path=path)
        else:  # in memory: the embedded engine, or a broadcast over NCCL/gloo (collective under FSDP2)
            source = WeightSource(state_dict=await asyncio.to_thread(self._gather))
        previous = self._task
        self._task = asyncio.create_task(self._push(previous, source, version), name=f"publish-{version}")
        if self.cfg.rollout.max_lag == 0:
            await self.flush()  # synchronous: nothing to overlap with

    def _gather(self) -> dict:
        state = full_state_dict(self.p.model)
        dtype = self.cfg.rollout.sglang.weight_sync.dtype
        if self.p.fleet.weight_sync is not None and dtype is not None:
            state = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in state.items()}
        return state

    def _save(self, path: Path) -> None:
        """Rank 0 writes the version (every rank takes part in gathering it); all wait until it is complete."""
        save_hf_checkpoint(self.p.model, self.p.tokenizer, path, is_main=self.p.dist.is_main)
        barrier()

    async def _push(self, previous: asyncio.Task | None, source: WeightSource, version: int) -> None:
        if previous is not None:
            await previous
        if self.cfg.rollout.exact_lag:
            await self.generated.wait_for(publish_gate(version, self.cfg.rollout.max_lag))
        t0 = time.perf_counter()
        try:
            await self.p.fleet.publish(source, version)
        except Exception as exc:
            await self.on_error(exc)  # rollouts wait for this version: without it nothing would move again
            raise
        self.last_sync_s = time.perf_counter() - t0
        await self.clock.advance(version)
        if source.path is not None and self.p.dist.is_main:
            # Versions older than the last three are no longer loaded by any rank's servers, nor restarted from.
            for old in self.p.weights_dir.glob("v*"):
                if old.name[1:].isdigit() and int(old.name[1:]) < version - 2:
                    shutil.rmtree(old, ignore_errors=True)

    async def flush(self) -> None:
        if self._task is not None:
            await self._task

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


# ---------------------------------------------------------------------------------------------- records


async def checkpoint(
    cfg: Config, p: Parts, evaluator: Evaluator, step: int, counters: dict, *, evaluated: bool
) -> None:
    """A complete training checkpoint, registered in MLflow as a model version, and old ones pruned."""
    root = cfg.run.path / "checkpoints"
    accuracy = evaluator.history[-1]["eval/accuracy"] if evaluated else None
    state = {
        "step": step,
        "policy_version": step,
        "data_cursor": step * cfg.rollout.prompts_per_step,
        "mlflow_run_id": p.tracker.run_id,
        "eval_accuracy": accuracy,
        "counters": counters,
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


def _any_rank(p: Parts, flag: bool) -> bool:
    """True on every rank when it is true on one (ranks must agree on when to stop)."""
    return bool(p.reducer.max_(torch.tensor([float(flag)])).item())


def _append_history(cfg: Config, p: Parts, metrics: dict) -> None:
    if p.dist.is_main:
        with open(cfg.run.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")


def _read_history(cfg: Config, upto: int) -> list[dict]:
    """The per-step metrics of the steps a resumed run already did (later ones were lost with the crash)."""
    path = cfg.run.path / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = {int(r["step"]): r for r in rows if int(r["step"]) <= upto}  # a step redone after the crash: last wins
    path.write_text("".join(json.dumps(kept[s]) + "\n" for s in sorted(kept)))
    return [kept[s] for s in sorted(kept)]


def finish(
    cfg: Config, p: Parts, evaluator: Evaluator, history: list[dict], counters: dict, last: int, wall_s: float
) -> dict:
    """summary.json, the plot, and their MLflow artifacts (the last checkpoint is already written)."""
    before, after = evaluator.results[0], evaluator.results[last]
    gain, gain_se = paired_gain(before["sampled"], after["sampled"])
    lags = [h["rollout/policy_lag/mean"] for h in history]
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
        "steps": last,
        "max_lag": cfg.rollout.max_lag,
        "mean_policy_lag": sum(lags) / len(lags) if lags else 0.0,
        "dropped_groups": int(history[-1]["buffer/dropped_groups"]) if history else 0,
        "skipped_steps": int(sum(h["train/skipped"] for h in history)),
        "train_samples": int(counters["samples"]),
        "samples_per_s": counters["samples"] / max(counters["train_wall_s"], 1e-9),
        "rollout_utilisation": _mean(history, "rollout/utilisation"),
        "train_utilisation": _mean(history, "train/utilisation"),
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
        plot_run(history, evaluator.history, plot_path, title=title)
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


def _mean(history: list[dict], key: str) -> float:
    values = [h[key] for h in history if key in h]
    return sum(values) / len(values) if values else 0.0


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
        f"{summary['steps']} steps, {summary['samples_per_s']:.0f} samples/s (max_lag {summary['max_lag']}, "
        f"mean lag {summary['mean_policy_lag']:.2f}, {summary['dropped_groups']} groups dropped), "
        f"wall {summary['wall_s']:.0f} s",
        f"rollout busy {100 * summary['rollout_utilisation']:.0f}% / train busy "
        f"{100 * summary['train_utilisation']:.0f}% of step time",
        f"MLflow run {summary['mlflow_run_id']} in {summary['tracking_uri']}",
    ]
