"""The training loop: generate → score → advantages → train_step → push weights → log.

This file is the architecture. One optimizer step, synchronously (max_lag = 0):
  1. take `rollout.prompts_per_step` prompts (every rank the same list, each keeps its slice),
  2. the rollout engine samples `rollout.group_size` completions of each, with behaviour logprobs,
  3. the reward runner scores them (verifiers routed by each row's task, in a process pool),
  4. group-relative advantages, a padded TrainBatch, and one `train_step` (ESS objective by default),
  5. the new weights go to the engine with the new policy version, metrics go to MLflow.
Held-out evaluation runs before the first step, every `eval.every` steps and after the last.
Runs in one process or under `torchrun` (FSDP2, gloo on CPU); only rank 0 writes files and tracks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from app.bootstrap import ensure_model
from app.config import Config, check_trainable, to_yaml
from app.data import PromptRow, load_split
from app.eval import EvalResult, evaluate, paired_gain
from app.plots import plot_run
from app.rollout.base import SamplingParams, WeightSource
from app.rollout.batching import build_train_batch
from app.rollout.embedded import EmbeddedEngine
from app.tracking import Tracker
from rewards import VerifierInput, check_tasks
from rewards.runner import RewardRunner
from trainer.advantages import group_advantages, informative_groups
from trainer.checkpoint import save_hf_checkpoint
from trainer.distributed import (
    LocalReducer,
    ProcessGroupReducer,
    barrier,
    full_state_dict,
    init_distributed,
    shard_model,
)
from trainer.model import encode_prompt, load_model
from trainer.optim import build_optimizer
from trainer.step import train_step

log = logging.getLogger("trustbatch")


class PromptSampler:
    """Seeded epochs over the training prompts; the cursor is the data position for resumption."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.cursor = size, seed, 0

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            epoch, offset = divmod(self.cursor, self.size)
            order = list(range(self.size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            n = min(k - len(out), self.size - offset)
            out += order[offset : offset + n]
            self.cursor += n
        return out


def _verifier_inputs(rows: list[PromptRow], texts: list[str]) -> tuple[list[VerifierInput], list[str]]:
    inputs = [
        VerifierInput(
            prompt=row.prompt or "",
            completion=text,
            reference=row.answer if row.answer is not None else row.tests,
            metadata={**row.metadata, "task": row.task},
        )
        for row, text in zip(rows, texts, strict=True)
    ]
    return inputs, [row.task for row in rows]


def run(cfg: Config) -> dict:
    check_trainable(cfg)
    dist = init_distributed()
    reducer = ProcessGroupReducer() if dist.world_size > 1 else LocalReducer()
    is_main = dist.rank == 0
    torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    run_dir = cfg.run.path
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    t_start = time.perf_counter()

    # --- set-up: model, data, engine, optimizer, rewards, tracking ------------------------------------
    model_dir = ensure_model(cfg.model, cfg.data, is_main=is_main, barrier=barrier)
    model, tokenizer = load_model(str(model_dir), dtype=cfg.model.dtype)
    train_rows, eval_rows = load_split(cfg.data, "train"), load_split(cfg.data, "eval")
    eval_rows = eval_rows[: cfg.eval.num_prompts]
    check_tasks(cfg.rewards, {r.task for r in train_rows + eval_rows})
    train_ids = [encode_prompt(tokenizer, r.prompt, r.messages) for r in train_rows]
    eval_ids = [encode_prompt(tokenizer, r.prompt, r.messages) for r in eval_rows]
    stop_ids = tuple(sorted({tokenizer.eos_token_id, *(tokenizer.convert_tokens_to_ids(t) for t in
                                                      ("<|im_end|>",) if t in tokenizer.get_vocab())}))
    engine = EmbeddedEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            max_batch_size=cfg.rollout.max_batch_size)
    if dist.world_size > 1:
        shard_model(model)
    model.train()
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.run.steps)
    runner = RewardRunner(cfg.rewards)
    tracker = Tracker(cfg.tracking, run_dir, run_name=cfg.run.name, enabled=is_main)
    tracker.log_config(cfg)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    r = cfg.rollout
    sample_params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                   n=r.group_size, stop_token_ids=stop_ids)

    def run_eval(step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        common = dict(max_new_tokens=r.max_new_tokens, stop_token_ids=stop_ids, seed=cfg.run.seed + 17)
        sampled = evaluate(engine, eval_rows, eval_ids, decode, runner, SamplingParams(
            temperature=r.temperature, top_p=r.top_p, n=cfg.eval.samples_per_prompt, **common), reducer)
        out: dict[str, float] = {"step": step, "eval/accuracy": sampled.accuracy,
                                 "eval/accuracy_se": sampled.stderr, "eval/samples": sampled.samples}
        results[step] = {"sampled": sampled}
        if cfg.eval.greedy:
            greedy = evaluate(engine, eval_rows, eval_ids, decode, runner,
                              SamplingParams(temperature=0.0, n=1, **common), reducer)
            out["eval/greedy_accuracy"] = greedy.accuracy
            results[step]["greedy"] = greedy
        out["timing/eval"] = time.perf_counter() - t0
        tracker.log_metrics(out, step=step)
        evals.append(out)
        return out

    results: dict[int, dict[str, EvalResult]] = {}
    evals: list[dict[str, float]] = []
    history: list[dict[str, float]] = []
    first = run_eval(0)
    if is_main:
        log.info("step 0: held-out accuracy %.2f%% ± %.2f (greedy %.2f%%)", 100 * first["eval/accuracy"],
                 100 * first["eval/accuracy_se"], 100 * first.get("eval/greedy_accuracy", float("nan")))

    # --- the loop ----------------------------------------------------------------------------------------
    sampler = PromptSampler(len(train_rows), cfg.run.seed)
    bar = tqdm(range(1, cfg.run.steps + 1), desc="train", disable=not is_main, dynamic_ncols=True)
    train_wall, train_samples, skipped = 0.0, 0, 0
    for step in bar:
        t0 = time.perf_counter()
        chosen = sampler.take(r.prompts_per_step)[dist.rank :: dist.world_size]
        completions = asyncio.run(engine.generate(
            [train_ids[i] for i in chosen],
            replace(sample_params, seed=cfg.run.seed * 100_003 + step * 64 + dist.rank)))
        t_rollout = time.perf_counter()

        rows = [train_rows[i] for i in chosen for _ in range(r.group_size)]
        inputs, tasks = _verifier_inputs(rows, [decode(c.output_ids) for c in completions])
        scores, reward_metrics = runner.score(inputs, tasks)
        rewards = torch.tensor([s.reward for s in scores], dtype=torch.float32).view(-1, r.group_size)
        advantages, adv_stats = group_advantages(rewards, scale_by_std=cfg.advantage.scale_by_std)
        keep = list(range(len(chosen)))
        if cfg.advantage.drop_zero_variance_groups:
            # Zero-advantage groups carry no signal; a rank keeps one if it has nothing else, so that
            # every rank still runs the step's collectives.
            keep = informative_groups(rewards).nonzero().flatten().tolist() or [0]
        t_reward = time.perf_counter()

        kept = [completions[g * r.group_size + j] for g in keep for j in range(r.group_size)]
        batch = build_train_batch(kept, advantages[keep].flatten().tolist(), pad_id=tokenizer.pad_token_id,
                                  temperature=r.temperature)
        step_metrics = train_step(model, optimizer, batch, cfg.objective, reducer, cfg.trainer,
                                  scheduler=scheduler)
        t_train = time.perf_counter()
        asyncio.run(engine.update_weights(WeightSource(state_dict=full_state_dict(model)), version=step))
        t_sync = time.perf_counter()

        # Rollout statistics are summed over ranks so every number is global.
        local = torch.tensor([
            float(rewards.sum()), float(sum(bool(s.correct) for s in scores)), float(len(scores)),
            float(sum(len(c.output_ids) for c in completions)), float(adv_stats["advantage/zero_variance_groups"]),
            float(sum(c.finish_reason == "length" for c in completions)), float(len(kept)),
        ], dtype=torch.float64)
        reducer.sum_(local)
        n = local[2].item()
        wall = t_sync - t0
        train_wall += wall
        train_samples += int(n)
        skipped += int(step_metrics.get("train/skipped", 0))
        metrics = {
            "step": step,
            "reward/mean": local[0].item() / n,
            "reward/correct": local[1].item() / n,
            "rollout/response_len/mean": local[3].item() / n,
            "rollout/truncated_frac": local[5].item() / n,
            "advantage/zero_variance_groups": local[4].item(),
            "rollout/trained_frac": local[6].item() / n,
            **{k: v for k, v in reward_metrics.items() if k != "reward/mean"},
            **step_metrics,
            "throughput/samples_per_s": n / wall,
            "timing/rollout": t_rollout - t0,
            "timing/reward": t_reward - t_rollout,
            "timing/train": t_train - t_reward,
            "timing/weight_sync": t_sync - t_train,
            "timing/step": wall,
        }
        history.append(metrics)
        tracker.log_metrics(metrics, step=step)
        if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.run.steps:
            run_eval(step)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{100 * evals[-1]['eval/accuracy']:.1f}",
                        ess=f"{metrics.get('loss/ess', float('nan')):.3f}", sps=f"{n / wall:.0f}")
    bar.close()
    last = run_eval(cfg.run.steps)

    # --- results: checkpoint, summary, plot --------------------------------------------------------------
    checkpoint_dir = run_dir / "checkpoints" / "final"
    save_hf_checkpoint(model, tokenizer, checkpoint_dir, is_main=is_main)
    gain, gain_se = paired_gain(results[0]["sampled"], results[cfg.run.steps]["sampled"])
    summary = {
        "initial_accuracy": first["eval/accuracy"],
        "final_accuracy": last["eval/accuracy"],
        "initial_accuracy_se": first["eval/accuracy_se"],
        "final_accuracy_se": last["eval/accuracy_se"],
        "accuracy_gain": gain,
        "accuracy_gain_se": gain_se,
        "eval_prompts": len(eval_rows),
        "eval_samples": results[0]["sampled"].samples,
        "initial_greedy_accuracy": first.get("eval/greedy_accuracy"),
        "final_greedy_accuracy": last.get("eval/greedy_accuracy"),
        "steps": cfg.run.steps,
        "skipped_steps": skipped,
        "train_samples": train_samples,
        "samples_per_s": train_samples / train_wall,
        "wall_s": time.perf_counter() - t_start,
        "train_wall_s": train_wall,
        "world_size": dist.world_size,
        "model_dir": str(model_dir),
        "checkpoint_dir": str(checkpoint_dir),
        "mlflow_run_id": tracker.run_id,
        "tracking_uri": tracker.tracking_uri,
    }
    if is_main:
        plot_path = run_dir / "training.png"
        plot_run(history, evals, plot_path, title=f"{cfg.run.name}: {cfg.objective.name}, lr {cfg.optim.lr:g}")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        tracker.log_metrics({"summary/accuracy_gain": gain, "summary/accuracy_gain_se": gain_se,
                             "summary/samples_per_s": summary["samples_per_s"]}, step=cfg.run.steps)
        tracker.log_artifact(plot_path)
        tracker.log_artifact(run_dir / "summary.json")
        if cfg.tracking.log_model:
            tracker.log_artifact(checkpoint_dir, artifact_path="model")
    tracker.finish()
    runner.close()
    return summary


def summary_lines(summary: dict) -> list[str]:
    """What `trustbatch train` prints at the end."""
    pct = lambda x: "n/a" if x is None else f"{100 * x:.2f}%"  # noqa: E731
    z = summary["accuracy_gain"] / summary["accuracy_gain_se"] if summary["accuracy_gain_se"] else float("nan")
    return [
        f"held-out sampled pass@1: {pct(summary['initial_accuracy'])} → {pct(summary['final_accuracy'])}"
        f"  (gain {100 * summary['accuracy_gain']:+.2f} ± {100 * summary['accuracy_gain_se']:.2f} points,"
        f" {z:.1f} SE; {summary['eval_samples']} samples each)",
        f"held-out greedy accuracy: {pct(summary['initial_greedy_accuracy'])} → "
        f"{pct(summary['final_greedy_accuracy'])}",
        f"{summary['steps']} steps, {summary['samples_per_s']:.0f} samples/s, wall {summary['wall_s']:.0f} s",
        f"MLflow run {summary['mlflow_run_id']} in {summary['tracking_uri']}",
    ]
