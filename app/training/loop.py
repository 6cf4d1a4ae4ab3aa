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
waits for the weights of step t - 1 (app/training/buffer.py). `rollout.max_lag = auto` moves the bound after
every step from the step's ESS (app/training/lag.py). Held-out evaluation runs before the first step, every
`eval.every` steps and after the last. Under `torchrun` every rank runs both tasks on its share of each
ticket; collectives happen only in the train task, in the same order on every rank. Only rank 0 writes files.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from app.config import Config, ConfigError
from app.rollout.fleet import PublishHooks
from app.rollout.trajectory import completion_text, trajectory_metrics
from app.scoring import score_texts
from app.stopping import DaemonThreads, Stopped, Stopping
from app.training.batching import build_train_batch
from app.training.buffer import PolicyClock, StalenessBuffer, Versioned, Watermark, publish_gate, ticket_gate
from app.training.lag import LagBound
from app.training.records import (
    Group,
    History,
    Ticket,
    Utilisation,
    checkpoint,
    checkpoint_state,
    finish,
    rate,
    step_metrics,
)  # fmt: skip
from app.training.resume import resume_run
from app.training.sampler import MixtureSampler, PromptSampler
from app.training.setup import Parts, setup
from app.training.signals import DriftWatch
from trainer.advantages import group_advantages, informative_groups
from trainer.step import TrainBatch, train_step

log = logging.getLogger("trustbatch")

STOP_GRACE_S = 3.0
"""A run stopped by a signal gives each server it started this long between SIGTERM and SIGKILL."""


def run(cfg: Config) -> dict:
    t_start = time.perf_counter()
    cfg, resume = resume_run(cfg)
    if resume.state.get("kind") == "sft":
        raise ConfigError(
            f"resume={cfg.resume}: {resume.checkpoint} is a checkpoint of `trustbatch sft`; resume it with "
            f"`trustbatch sft`, or train from it with model.path={resume.checkpoint / 'model'}"
        )
    stopping = Stopping("train", waiting="stopping the start-up", on_first=_raise_stopped)
    with stopping.installed():  # until the loop runs: a signal during start-up stops it at once
        p = setup(cfg, resume)
    try:
        return asyncio.run(train(p, t_start))
    except Stopped:
        p.tracker.finish("KILLED")  # a resumed run sets it RUNNING again
        raise
    except BaseException:
        p.tracker.finish("FAILED")
        raise
    finally:
        p.close()


def _raise_stopped(signum: int) -> None:
    raise Stopped(signum)


async def train(p: Parts, t_start: float) -> dict:
    cfg, r, start = p.cfg, p.cfg.rollout, p.resume.step
    per_rank = len(range(p.dist.rank, r.prompts_per_step, p.dist.world_size))
    clock = PolicyClock(start)
    buffer: StalenessBuffer[Group] = StalenessBuffer(r.lag_limit, capacity=(r.lag_limit + 1) * max(per_rank, 1))
    lag = LagBound(
        None if r.auto_lag else int(r.max_lag), min_ess=r.min_ess, limit=r.lag_limit,
        start=p.resume.state.get("max_lag_in_force", 0),
    )  # fmt: skip
    generated = Watermark(start)
    history = History(
        cfg.run.path, p.tracker, p.reducer, is_main=p.dist.is_main, time_limit_s=cfg.run.time_limit_s,
        resumed_at=start, counters=p.resume.state.get("counters"),
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    threads = DaemonThreads()  # a stopped run never waits for a blocking call to return (app/stopping.py)
    loop.set_default_executor(threads)
    state = {"step": start, "checkpoint": p.resume.checkpoint, "finish_step": False}
    stopping = Stopping("train", waiting=lambda: _waiting_for(cfg, state), on_first=lambda signum: _stop(
        cfg, state, threads, main), kill=p.kill)  # fmt: skip
    main = asyncio.current_task()
    stopping.install_in_loop(loop)

    def generate_blocking(prompts, params, progress, tasks):  # for evaluation, which runs in a worker thread
        sampled = p.fleet.generate(prompts, params, progress=progress) if p.tools is None else p.tools.generate(
            prompts, params, tasks, progress=progress)  # fmt: skip
        return asyncio.run_coroutine_threadsafe(sampled, loop).result()

    async def evaluate(step: int) -> dict[str, float]:
        await p.fleet.flush()  # the engines hold the weights of `step`
        return await asyncio.to_thread(p.held_out, step, generate_blocking)

    producer: asyncio.Task | None = None
    try:
        await p.fleet.connect(publish_hooks(cfg, clock, generated, buffer), p.policy.model, version=start)
        sampler = p.sampler(cursor=start * r.prompts_per_step)  # seeded epochs, or a weighted mixture of sources
        producer = asyncio.create_task(produce(p, clock, buffer, generated, lag, sampler, first_ticket=start + 1))
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
        meter, drift = Utilisation(p.fleet), DriftWatch()
        last = start
        for step in bar:
            state["step"] = step
            metrics = await train_one_step(p, buffer, step, per_rank)
            # A skipped step's ESS says nothing (a diverged model's NaN ratios even read as ESS 1).
            ess = float("nan") if metrics["train/skipped"] else metrics["loss/ess"]
            metrics["rollout/lag_bound"] = float(lag.observe(ess, issued_under=int(metrics["rollout/max_lag"])))
            metrics.update(meter.read(metrics["timing/train"], metrics["rollout/samples"]))
            if r.skip_decided:
                metrics["rollout/skipped_prompts"] = float(p.reducer.sum_(torch.tensor([float(sampler.skipped)])).item())
            for name, message in drift.observe(step, metrics):  # what ESS cannot see (app/training/signals.py)
                metrics[f"signals/{name}"] = 1.0
                if p.dist.is_main:
                    log.warning("%s", message)
                p.tracker.set_tag(f"trustbatch.signal.{name}", message)
            history.add(step, metrics)
            last = step
            out_of_time = history.out_of_time()
            stop = state["finish_step"]  # a signal under checkpoint.on_stop: this step is the last, checkpointed
            final = step == cfg.run.steps or out_of_time
            evaluated = (final or bool(cfg.eval.every and step % cfg.eval.every == 0)) and not stop
            if evaluated:
                await evaluate(step)
            if final or stop or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                saved = checkpoint_state(
                    cfg, p.tracker, p.held_out, history, step, evaluated=evaluated, lag_in_force=lag.value
                )
                await checkpoint(cfg, p.policy, p.tracker, p.dist, saved)
                state["checkpoint"] = cfg.run.path / "checkpoints" / f"step-{step:06d}"
            if stop:
                raise Stopped(stopping.signum or signal.SIGINT, f"stopped after step {step}, checkpointed")
            meter.restart()  # evaluation and checkpointing are not part of the next step's wall time
            bar.set_postfix(
                reward=f"{metrics['reward/mean']:.3f}",
                acc=f"{100 * p.held_out.history[-1]['eval/accuracy']:.1f}",
                ess=f"{metrics['loss/ess']:.3f}",
                lag=f"{metrics['rollout/policy_lag/mean']:.1f}",
                sps=rate(metrics["throughput/samples_per_s"]),
            )
            if out_of_time:
                log.info("run.time_limit_s=%g reached after step %d", cfg.run.time_limit_s, step)
                break
        bar.close()
    except asyncio.CancelledError:
        if stopping.requested:  # the first signal cancelled the loop: the run stops here (run() marks it KILLED)
            raise Stopped(stopping.signum, f"stopped during step {state['step']}") from None
        raise
    finally:
        if producer is not None:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
        # A push still in flight is cancelled; a stopped run gives its servers STOP_GRACE_S, not minutes.
        await p.fleet.close(grace_s=STOP_GRACE_S if stopping.requested else None)
        stopping.remove_from_loop(loop)
    return finish(
        cfg, p.held_out, history, last, wall_s=time.perf_counter() - t_start, tracker=p.tracker, fleet=p.fleet,
        dist=p.dist, model_dir=p.policy.model_dir, resumed_from=start,
    )  # fmt: skip


def _waiting_for(cfg: Config, state: dict) -> str:
    resume = state["checkpoint"] or "the start (no checkpoint yet)"
    if cfg.checkpoint.on_stop:
        return f"finishing step {state['step']} and checkpointing it (checkpoint.on_stop), then stopping the rollout servers and reward workers"
    return (f"leaving step {state['step']} unfinished, stopping the rollout servers and reward workers (a few "
            f"seconds); resume= continues from {resume}")  # fmt: skip


def _stop(cfg: Config, state: dict, threads: DaemonThreads, main: asyncio.Task | None) -> None:
    """The first signal: under checkpoint.on_stop the step in progress finishes and is checkpointed; else the loop
    is cancelled now, and the blocking call in progress is left to its thread."""
    if cfg.checkpoint.on_stop:
        state["finish_step"] = True
        return
    threads.abandon()
    if main is not None:
        main.cancel()


# ---------------------------------------------------------------------------------------------- produce


async def produce(
    p: Parts,
    clock: PolicyClock,
    buffer: StalenessBuffer[Group],
    generated: Watermark,
    lag: LagBound,
    sampler: PromptSampler | MixtureSampler,
    *,
    first_ticket: int,
) -> None:
    """Issue ticket after ticket as the lag bound allows; each generates, scores and queues its groups.

    Tickets run concurrently (at most max_lag + 1 at a time, by the clock), and queue their groups in ticket
    order. Runs until cancelled; a ticket that fails for good closes the buffer with its error, which stops
    the trainer.
    """
    cfg = p.cfg
    finished: set[int] = set()
    queued_before: asyncio.Future | None = None
    tasks: set[asyncio.Task] = set()

    async def one_ticket(
        ticket: int, bound: int, chosen: list[int], turn: asyncio.Future | None, mine: asyncio.Future
    ):
        try:
            completions = await p.rollouts(
                [p.train.ids[i] for i in chosen],
                replace(p.sampling, seed=cfg.run.seed * 100_003 + ticket * 64 + p.dist.rank),
                [p.train.rows[i].task for i in chosen],
            )
            finished.add(ticket)
            while generated.value + 1 in finished:  # the watermark: every ticket up to it has generated
                await generated.advance(generated.value + 1)
            rows = [p.train.rows[i] for i in chosen for _ in range(p.sampling.n)]
            texts = [completion_text(c, p.text.decode) for c in completions]  # a tool's output is not the answer
            scores, scoring = await asyncio.to_thread(score_texts, p.runner, rows, texts)
            n, record = p.sampling.n, Ticket(ticket, {**scoring, **trajectory_metrics(completions)}, lag_bound=bound)
            groups = [
                Group(record, completions[k * n : (k + 1) * n], scores[k * n : (k + 1) * n])
                for k in range(len(chosen))
            ]
            for index, group in zip(chosen, groups, strict=True):
                sampler.decided(index, len({s.reward for s in group.scores}) == 1)
            if turn is not None:
                await turn  # queue after the previous ticket, so the trainer sees tickets in order
            await buffer.put([Versioned(g, g.version) for g in groups])
            mine.set_result(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the trainer must hear of it
            await buffer.close(exc)
            raise

    try:
        ticket = first_ticket
        while True:
            bound = lag.value  # the bound this ticket is issued under (a later change does not move its gate)
            await clock.wait_for(ticket_gate(ticket, bound))
            chosen = sampler.take(cfg.rollout.prompts_per_step)[p.dist.rank :: p.dist.world_size]
            mine = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(
                one_ticket(ticket, bound, chosen, queued_before, mine), name=f"ticket-{ticket}"
            )
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            queued_before, ticket = mine, ticket + 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------------------------------- train


async def train_one_step(
    p: Parts, buffer: StalenessBuffer[Group], step: int, per_rank: int
) -> dict[str, float]:
    cfg, t0 = p.cfg, time.perf_counter()
    taken = await buffer.take(per_rank, trainer_version=step - 1)
    t1 = time.perf_counter()
    groups = [item.item for item in taken]
    lags = [step - 1 - item.version for item in taken]
    batch, rewards, stats = to_train_batch(p, groups, lags)
    every = cfg.trainer.grad_diagnostics_every
    trained = await asyncio.to_thread(
        train_step, p.policy.model, p.policy.optimizer, batch, cfg.objective, p.reducer, cfg.trainer,
        scheduler=p.policy.scheduler, diagnose=bool(every and step % every == 0), reference=p.policy.reference,
    )
    t2 = time.perf_counter()
    await p.fleet.publish(p.policy.model, step)  # the push to the engines goes on in the background
    t3 = time.perf_counter()
    metrics = {
        "step": step,
        **step_metrics(
            groups, lags, rewards, stats, batch,
            reducer=p.reducer, lag_limit=cfg.rollout.lag_limit,
        ),  # fmt: skip
        **trained,
        "buffer/dropped_groups": float(buffer.stats.dropped),
        "buffer/size": float(len(buffer)),
        "timing/wait_rollout": t1 - t0,
        "timing/train": t2 - t1,
        # Prompt + completion tokens of the trained sequences per second of train_step (this rank's share; with
        # trainer.share_prompts each group's prompt runs once, so fewer tokens pass through the model).
        "perf/train_tokens_per_s": float(batch.attention_mask.sum()) / max(t2 - t1, 1e-9),
        "timing/weight_save": t3 - t2,
        "timing/weight_sync": p.fleet.last_sync_s,
    }
    if p.fleet.check is not None and p.fleet.check.last_gap is not None:
        # The latest verified version's largest engine-trainer gap on the probe text (app/rollout/probe.py).
        metrics["weights/probe_gap"] = p.fleet.check.last_gap
        metrics["weights/check_retries"] = float(p.fleet.check_retries)
    return metrics


def to_train_batch(p: Parts, groups: list[Group], lags: list[int]) -> tuple[TrainBatch, torch.Tensor, dict]:
    """Group advantages → the padded TrainBatch of the groups worth training on; rows of groups at policy lag
    0 are marked `fresh` (their ratios measure the engine's mismatch alone)."""
    cfg = p.cfg
    rewards = torch.tensor([[s.reward for s in g.scores] for g in groups], dtype=torch.float32)
    advantages, stats = group_advantages(rewards, scale_by_std=cfg.advantage.scale_by_std)
    keep = list(range(rewards.shape[0]))
    if cfg.advantage.drop_zero_variance_groups:
        # A rank with no informative group keeps one (advantage 0) so it still joins the step's collectives.
        keep = informative_groups(rewards).nonzero().flatten().tolist() or [0]
    batch = build_train_batch(
        [c for g in keep for c in groups[g].completions],
        advantages[keep].flatten().tolist(),
        pad_id=p.text.tokenizer.pad_token_id,
        temperature=cfg.rollout.temperature,
    )
    fresh = torch.tensor([lags[g] == 0 for g in keep for _ in groups[g].completions], dtype=torch.bool)
    return replace(batch, fresh=fresh), rewards, stats


# ---------------------------------------------------------------------------------------------- weights


def publish_hooks(cfg: Config, clock: PolicyClock, generated: Watermark, buffer: StalenessBuffer) -> PublishHooks:
    """How the fleet's publication (app/rollout/fleet.py) meets the loop: a version every engine holds advances
    the clock; under exact_lag a push waits for the generated-watermark; a failed push closes the buffer."""
    r = cfg.rollout
    gate = (lambda version: generated.wait_for(publish_gate(version, r.max_lag))) if r.exact_lag else None
    return PublishHooks(held=clock.advance, failed=buffer.close, gate=gate)
