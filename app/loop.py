"""The training loop: generate → score → advantages → train_step → push weights → log.

This file is the architecture. One optimizer step, synchronously (max_lag = 0):
  1. take `rollout.prompts_per_step` prompts (every rank draws the same list and keeps its slice),
  2. the rollout engine samples `rollout.group_size` completions of each, with behaviour logprobs,
  3. the reward runner scores them (verifiers routed by each row's task, in a process pool),
  4. group-relative advantages (zero-variance groups dropped), a padded TrainBatch, one `train_step`,
  5. the new weights go to the engine with the new policy version; metrics go to MLflow.
Held-out evaluation runs before the first step, every `eval.every` steps and after the last.
It runs in one process or under `torchrun` (FSDP2, gloo on CPU); only rank 0 writes files and tracks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from app.bootstrap import ensure_model
from app.config import Config, check_trainable, to_yaml
from app.data import PromptRow, load_split
from app.eval import EvalResult, evaluate, paired_gain
from app.plots import plot_run
from app.rollout.base import Completion, RolloutEngine, SamplingParams, WeightSource
from app.rollout.batching import build_train_batch
from app.rollout.embedded import EmbeddedEngine
from app.rollout.launcher import LocalServerProcess
from app.rollout.sglang import connect
from app.scoring import rewards_with_sandbox, score_texts
from app.tracking import Tracker
from rewards import Score, check_tasks
from rewards.runner import RewardRunner
from trainer.advantages import group_advantages, informative_groups
from trainer.checkpoint import save_hf_checkpoint
from trainer.distributed import (
    DistInfo,
    Reducer,
    barrier,
    full_state_dict,
    init_distributed,
    shard_model,
)
from trainer.model import encode_prompt, load_model
from trainer.optim import build_optimizer
from trainer.step import TrainBatch, train_step

log = logging.getLogger("trustbatch")


class PromptSampler:
    """Seeded epochs over the training prompts; `cursor` is the data position (for resumption)."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.cursor = size, seed, 0

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            epoch, offset = divmod(self.cursor, self.size)
            order = list(range(self.size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            n = min(k - len(out), self.size - offset)
            out += order[offset : offset + n]
            self.cursor += n
        return out


@dataclass
class Prompts:
    rows: list[PromptRow]
    ids: list[list[int]]


@dataclass
class Parts:
    """Everything the loop drives, built once by `setup`."""

    dist: DistInfo
    reducer: Reducer
    model_dir: Path
    model: torch.nn.Module
    tokenizer: object
    engine: RolloutEngine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    runner: RewardRunner
    tracker: Tracker
    train: Prompts
    eval: Prompts
    sampling: SamplingParams
    aio: asyncio.Runner
    """One event loop for the whole run: HTTP engines keep connections and semaphores bound to it."""
    servers: list[LocalServerProcess]
    weights_dir: Path
    """Where HTTP engines load each new policy version from (update_weights_from_disk)."""

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.aio.run(self.engine.generate(prompts, params))

    def close(self) -> None:
        if not isinstance(self.engine, EmbeddedEngine):
            self.aio.run(self.engine.close())
        for server in self.servers:
            server.stop()
        self.aio.close()
        self.runner.close()


def make_engine(
    cfg: Config, model, tokenizer, model_dir: Path, dist: DistInfo, aio: asyncio.Runner
) -> tuple[RolloutEngine, list[LocalServerProcess]]:
    """The configured rollout engine; `local` first starts this rank's CPU rollout server."""
    r = cfg.rollout
    if r.engine == "embedded":
        engine = EmbeddedEngine(
            model,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            max_batch_size=r.max_batch_size,
        )
        return engine, []
    servers, client_cfg = [], r.sglang
    if r.engine == "local":
        server = LocalServerProcess(
            model_dir,
            max_batch_size=r.max_batch_size,
            log_path=cfg.run.path / f"rollout-server-rank{dist.rank}.log",
        )
        servers.append(server)
        client_cfg = replace(
            client_cfg, urls=[server.start()], health_timeout_s=min(client_cfg.health_timeout_s, 180.0)
        )
        log.info(
            "rank %d: started the CPU rollout server at %s (log %s)", dist.rank, server.url, server.log_path
        )
    try:
        return aio.run(connect(client_cfg)), servers
    except BaseException:
        for server in servers:
            server.stop()
        raise


def setup(cfg: Config) -> Parts:
    check_trainable(cfg)
    dist = init_distributed()
    reducer = dist.reducer()
    torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    if dist.is_main:
        cfg.run.path.mkdir(parents=True, exist_ok=True)
        (cfg.run.path / "config.yaml").write_text(to_yaml(cfg))

    model_dir = ensure_model(cfg.model, cfg.data, is_main=dist.is_main, barrier=barrier)
    model, tokenizer = load_model(str(model_dir), dtype=cfg.model.dtype)
    train_rows = load_split(cfg.data, "train")
    eval_rows = load_split(cfg.data, "eval")[: cfg.eval.num_prompts]
    check_tasks(cfg.rewards, {row.task for row in train_rows + eval_rows})

    def prompts(rows: list[PromptRow]) -> Prompts:
        return Prompts(rows, [encode_prompt(tokenizer, row.prompt, row.messages) for row in rows])

    # Generation ends at EOS, and at the chat template's end-of-turn token when the tokenizer has one.
    stop = {tokenizer.eos_token_id} | {
        tokenizer.get_vocab()[t] for t in ("<|im_end|>",) if t in tokenizer.get_vocab()
    }
    aio = asyncio.Runner()
    engine, servers = make_engine(cfg, model, tokenizer, model_dir, dist, aio)
    if dist.world_size > 1:
        shard_model(model)
    model.train()
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.run.steps)
    tracker = Tracker(cfg.tracking, cfg.run.path, run_name=cfg.run.name, enabled=dist.is_main)
    tracker.log_config(cfg)
    r = cfg.rollout
    return Parts(
        dist=dist,
        reducer=reducer,
        model_dir=model_dir,
        model=model,
        tokenizer=tokenizer,
        engine=engine,
        optimizer=optimizer,
        scheduler=scheduler,
        runner=RewardRunner(rewards_with_sandbox(cfg.rewards, cfg.sandbox)),
        tracker=tracker,
        train=prompts(train_rows),
        eval=prompts(eval_rows),
        sampling=SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            n=r.group_size,
            stop_token_ids=tuple(sorted(stop)),
        ),
        aio=aio,
        servers=servers,
        weights_dir=cfg.run.path / "weights" / f"rank{dist.rank}",
    )


def rollout(p: Parts, chosen: list[int], seed: int) -> tuple[list[Completion], list[Score], dict]:
    """Generate `group_size` completions of each chosen prompt (prompt-major) and score them."""
    completions = p.generate([p.train.ids[i] for i in chosen], replace(p.sampling, seed=seed))
    rows = [p.train.rows[i] for i in chosen for _ in range(p.sampling.n)]
    scores, reward_metrics = score_texts(p.runner, rows, [p.decode(c.output_ids) for c in completions])
    return completions, scores, reward_metrics


def to_train_batch(
    cfg: Config, p: Parts, completions: list[Completion], scores: list[Score]
) -> tuple[TrainBatch, torch.Tensor, dict]:
    """Group advantages → the padded TrainBatch of the groups worth training on."""
    group_size = cfg.rollout.group_size
    rewards = torch.tensor([s.reward for s in scores], dtype=torch.float32).view(-1, group_size)
    advantages, stats = group_advantages(rewards, scale_by_std=cfg.advantage.scale_by_std)
    keep = list(range(rewards.shape[0]))
    if cfg.advantage.drop_zero_variance_groups:
        # A rank with no informative group keeps one (advantage 0) so it still joins the step's collectives.
        keep = informative_groups(rewards).nonzero().flatten().tolist() or [0]
    kept = [completions[g * group_size + j] for g in keep for j in range(group_size)]
    batch = build_train_batch(
        kept,
        advantages[keep].flatten().tolist(),
        pad_id=p.tokenizer.pad_token_id,
        temperature=cfg.rollout.temperature,
    )
    return batch, rewards, stats


def rollout_metrics(
    p: Parts,
    completions: list[Completion],
    scores: list[Score],
    rewards: torch.Tensor,
    stats: dict,
    batch: TrainBatch,
    trainer_version: int,
) -> dict[str, float]:
    """Rollout statistics summed over ranks, so every number is global.

    Policy lag = trainer version (optimizer steps taken before this one) − the version that generated the
    completion; 0 throughout a synchronous run, and the check that the engine really holds the pushed weights.
    """
    lags = [trainer_version - c.policy_version for c in completions]
    lag_max = p.reducer.max_(torch.tensor([max(lags)], dtype=torch.float64)).item()
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
        ],
        dtype=torch.float64,
    )
    reward, correct, n, length, zero_var, truncated, trained, lag = p.reducer.sum_(sums).tolist()
    return {
        "reward/mean": reward / n,
        "reward/correct": correct / n,
        "rollout/samples": n,
        "rollout/response_len/mean": length / n,
        "rollout/truncated_frac": truncated / n,
        "rollout/trained_frac": trained / n,
        "advantage/zero_variance_groups": zero_var,
        "rollout/policy_lag/mean": lag / n,
        "rollout/policy_lag/max": lag_max,
    }


class Evaluator:
    """Held-out sampled pass@1 at the training temperature (+ greedy), the same prompts and seed each time."""

    def __init__(self, cfg: Config, p: Parts):
        self.cfg, self.p = cfg, p
        self.results: dict[int, dict[str, EvalResult]] = {}
        self.history: list[dict[str, float]] = []

    def __call__(self, step: int) -> dict[str, float]:
        cfg, p, t0 = self.cfg, self.p, time.perf_counter()
        base = replace(p.sampling, seed=cfg.run.seed + 17)
        runs = {"sampled": replace(base, n=cfg.eval.samples_per_prompt)}
        if cfg.eval.greedy:
            runs["greedy"] = replace(base, n=1, temperature=0.0, top_p=1.0)
        self.results[step] = {
            name: evaluate(p.generate, p.eval.rows, p.eval.ids, p.decode, p.runner, params, p.reducer)
            for name, params in runs.items()
        }
        sampled = self.results[step]["sampled"]
        out = {
            "step": step,
            "eval/accuracy": sampled.accuracy,
            "eval/accuracy_se": sampled.stderr,
            "eval/samples": sampled.samples,
        }
        if "greedy" in self.results[step]:
            out["eval/greedy_accuracy"] = self.results[step]["greedy"].accuracy
        out["timing/eval"] = time.perf_counter() - t0
        p.tracker.log_metrics(out, step=step)
        self.history.append(out)
        return out


def push_weights(p: Parts, version: int) -> None:
    """Hand the trainer's weights to the engine as policy `version`: in memory, or through a directory."""
    if isinstance(p.engine, EmbeddedEngine):
        source = WeightSource(state_dict=full_state_dict(p.model))
    else:  # every rank writes its own copy for its own server (saving gathers the full weights on all ranks)
        source = WeightSource(path=save_hf_checkpoint(p.model, p.tokenizer, p.weights_dir, is_main=True))
    p.aio.run(p.engine.update_weights(source, version=version))


def run(cfg: Config) -> dict:
    t_start = time.perf_counter()
    p = setup(cfg)
    try:
        return train(cfg, p, t_start)
    finally:
        p.close()


def train(cfg: Config, p: Parts, t_start: float) -> dict:
    evaluator = Evaluator(cfg, p)
    first = evaluator(0)
    if p.dist.is_main:
        log.info(
            "step 0: held-out sampled pass@1 %.2f%% ± %.2f, greedy %.2f%%",
            100 * first["eval/accuracy"],
            100 * first["eval/accuracy_se"],
            100 * first.get("eval/greedy_accuracy", float("nan")),
        )

    sampler = PromptSampler(len(p.train.rows), cfg.run.seed)
    history: list[dict[str, float]] = []
    bar = tqdm(range(1, cfg.run.steps + 1), desc="train", disable=not p.dist.is_main, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        chosen = sampler.take(cfg.rollout.prompts_per_step)[p.dist.rank :: p.dist.world_size]
        completions, scores, reward_metrics = rollout(
            p, chosen, seed=cfg.run.seed * 100_003 + step * 64 + p.dist.rank
        )
        t1 = time.perf_counter()
        batch, rewards, stats = to_train_batch(cfg, p, completions, scores)
        step_metrics = train_step(
            p.model, p.optimizer, batch, cfg.objective, p.reducer, cfg.trainer, scheduler=p.scheduler
        )
        t2 = time.perf_counter()
        push_weights(p, version=step)
        t3 = time.perf_counter()

        metrics = {
            "step": step,
            **rollout_metrics(p, completions, scores, rewards, stats, batch, trainer_version=step - 1),
            **{k: v for k, v in reward_metrics.items() if k != "reward/mean"},
            **step_metrics,
            "timing/rollout": t1 - t0,
            "timing/train": t2 - t1,
            "timing/weight_sync": t3 - t2,
            "timing/step": t3 - t0,
        }
        metrics["throughput/samples_per_s"] = metrics["rollout/samples"] / metrics["timing/step"]
        history.append(metrics)
        p.tracker.log_metrics(metrics, step=step)
        if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.run.steps:
            evaluator(step)
        bar.set_postfix(
            reward=f"{metrics['reward/mean']:.3f}",
            acc=f"{100 * evaluator.history[-1]['eval/accuracy']:.1f}",
            ess=f"{metrics['loss/ess']:.3f}",
            sps=f"{metrics['throughput/samples_per_s']:.0f}",
        )
    bar.close()
    evaluator(cfg.run.steps)
    return finish(cfg, p, evaluator, history, wall_s=time.perf_counter() - t_start)


def finish(cfg: Config, p: Parts, evaluator: Evaluator, history: list[dict], wall_s: float) -> dict:
    """Final checkpoint, summary.json, the plot, and their MLflow artifacts."""
    checkpoint_dir = cfg.run.path / "checkpoints" / "final"
    save_hf_checkpoint(p.model, p.tokenizer, checkpoint_dir, is_main=p.dist.is_main)
    before, after = evaluator.results[0], evaluator.results[cfg.run.steps]
    gain, gain_se = paired_gain(before["sampled"], after["sampled"])
    train_wall = sum(h["timing/step"] for h in history)
    samples = sum(h["rollout/samples"] for h in history)
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
        "steps": cfg.run.steps,
        "skipped_steps": int(sum(h["train/skipped"] for h in history)),
        "train_samples": int(samples),
        "samples_per_s": samples / train_wall,
        "wall_s": wall_s,
        "train_wall_s": train_wall,
        "world_size": p.dist.world_size,
        "model_dir": str(p.model_dir),
        "checkpoint_dir": str(checkpoint_dir),
        "mlflow_run_id": p.tracker.run_id,
        "tracking_uri": p.tracker.tracking_uri,
    }
    if p.dist.is_main:
        plot_path = cfg.run.path / "training.png"
        plot_run(
            history,
            evaluator.history,
            plot_path,
            title=f"{cfg.run.name}: {cfg.objective.name}, lr {cfg.optim.lr:g}",
        )
        (cfg.run.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        p.tracker.log_metrics(
            {
                "summary/accuracy_gain": gain,
                "summary/accuracy_gain_se": gain_se,
                "summary/samples_per_s": summary["samples_per_s"],
            },
            step=cfg.run.steps,
        )
        p.tracker.log_artifact(plot_path)
        p.tracker.log_artifact(cfg.run.path / "summary.json")
        if cfg.tracking.log_model:
            p.tracker.log_artifact(checkpoint_dir, artifact_path="model")
    p.tracker.finish()
    return summary


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
        f"{summary['steps']} steps, {summary['samples_per_s']:.0f} samples/s, wall {summary['wall_s']:.0f} s",
        f"MLflow run {summary['mlflow_run_id']} in {summary['tracking_uri']}",
    ]
