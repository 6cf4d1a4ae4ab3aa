"""The supervised steps, `fit`: seeded epochs of batches, `sft_step` on each, the held-out loss, progress.

`trustbatch sft` (app/training/sft.py) and the tiny model's warm start (app/training/bootstrap.py) both run it;
the algorithm of one step (loss, micro-batches, FSDP2 scaling) is trainer/sft.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from app.training.sampler import PromptSampler
from trainer.distributed import LocalReducer, Reducer
from trainer.sft import Example, held_out_loss, plan_sft_step, sft_step


@dataclass
class FitSettings:
    """What `fit` needs beyond the model and the data (`trustbatch sft`: ``sft``, ``trainer`` and ``run``)."""

    steps: int
    batch_size: int
    micro_batch_size: int
    max_grad_norm: float
    compute_dtype: str = "float32"
    seed: int = 0
    eval_every: int = 0
    time_limit_s: float = 0.0
    label: str = "sft"
    show_progress: bool = True
    stop: Callable[[], bool] = lambda: False
    """Asked after each step: True makes it the last (checkpointed, with `trustbatch sft`'s checkpoint.on_stop)."""


StepHook = Callable[[int, dict[str, float]], None]


def fit(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    pad_id: int,
    train: list[Example],
    held_out: list[Example],
    settings: FitSettings,
    *,
    start: int = 0,
    reducer: Reducer | None = None,
    rank: int = 0,
    on_step: StepHook = lambda step, metrics: None,
    on_checkpoint: Callable[[int, bool], None] = lambda step, last: None,
) -> dict[str, float]:
    """Supervised steps ``start + 1 .. settings.steps`` over ``train``; returns the last step's metrics.

    Each step takes the next ``batch_size`` examples of the seeded epochs (rank r of W trains examples r, r+W,
    ...) and runs `sft_step`. The held-out loss is measured before the first step, every ``eval_every`` steps and
    after the last (``sft/held_out_loss``). ``on_step`` gets every step's metrics; ``on_checkpoint(step, last)``
    is called after each step (it decides whether to save). Stops early after the step that passes
    ``time_limit_s`` of wall time (0: no limit).
    """
    reducer = reducer or LocalReducer()
    world = reducer.world_size
    sampler = PromptSampler(len(train), settings.seed, cursor=start * settings.batch_size)

    def evaluate() -> float:
        return held_out_loss(model, held_out[rank::world], settings.micro_batch_size, pad_id, reducer,
                             compute_dtype=settings.compute_dtype)  # fmt: skip

    metrics: dict[str, float] = {}
    if held_out and start == 0:
        on_step(0, {"sft/held_out_loss": evaluate()})
    model.train()
    total = settings.steps - start
    bar = tqdm(total=total, desc=settings.label, disable=not settings.show_progress or rank != 0,
               dynamic_ncols=True, unit="step")  # fmt: skip
    t0, tokens_seen = time.perf_counter(), 0
    step = start
    try:
        while step < settings.steps:
            step += 1
            chosen = sampler.take(settings.batch_size)
            plan = plan_sft_step([train[i] for i in chosen[rank::world]], settings.micro_batch_size, pad_id, reducer)
            t_step = time.perf_counter()
            metrics = sft_step(model, optimizer, plan, max_grad_norm=settings.max_grad_norm, reducer=reducer,
                               scheduler=scheduler, compute_dtype=settings.compute_dtype)  # fmt: skip
            elapsed = time.perf_counter() - t_step
            tokens = float(reducer.sum_(torch.tensor([float(plan.tokens)], dtype=torch.float64)).item())
            tokens_seen += int(tokens)
            metrics.update({
                "sft/tokens": tokens,
                "sft/target_tokens": plan.num_targets,
                "sft/padding_fraction": 1.0 - plan.tokens / max(plan.padded_tokens, 1),
                "sft/epoch": sampler.cursor / len(train),
                "perf/tokens_per_s": tokens / max(elapsed, 1e-9),
            })  # fmt: skip
            stopping = settings.stop()
            last = step == settings.steps or stopping or (
                settings.time_limit_s > 0 and time.perf_counter() - t0 > settings.time_limit_s
            )
            if held_out and not stopping and (last or (settings.eval_every and step % settings.eval_every == 0)):
                metrics["sft/held_out_loss"] = evaluate()
                model.train()
            on_step(step, metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['sft/loss']:.3f}", tok_s=f"{tokens_seen / (time.perf_counter() - t0):.0f}")
            on_checkpoint(step, last)
            if stopping:
                metrics["sft/stopped"] = 1.0
            if last:
                break
    finally:
        bar.close()
    metrics["sft/steps_done"] = float(step)
    return metrics
