"""`trustbatch sft`: supervised fine-tuning with the config, data, checkpoints and tracking of `train`.

One run, read top to bottom in `run_sft`:

1. start-up checks before any model is loaded: the config's paths, the rows (`completion`, or a last assistant
   turn: app/data/rows.py), and a resumed run's checkpoint (``resume=``, app/training/resume.py);
2. the model (`model.path`: a directory, a hub id, or a registered ``models:/NAME@ALIAS``), its examples
   tokenized with the reply masked from the model's own chat template (app/data/sft.py), FSDP2 under torchrun,
   the optimizer of ``optim.*``;
3. the steps (`fit`): ``sft.batch_size`` examples per step in seeded epochs, this rank's share sorted by length
   into micro-batches of ``trainer.micro_batch_size`` (trainer/sft.py); a progress bar with the loss, tokens/s
   and time left; the held-out loss before the first step, every ``sft.eval_every`` steps and after the last;
   a checkpoint every ``checkpoint.every`` steps and after the last, each registered as a version of MLflow
   model ``tracking.registered_model`` (default: ``run.name``);
4. after the last step, with ``sft.verify``, the held-out prompts sampled from the saved model and scored by the
   run's verifiers, through the evaluation `train` and `eval` use (app/evaluation/command.py): sampled pass@1,
   greedy accuracy and the answer rate, logged and tagged on the model version;
5. ``summary.json`` in the run directory, and the model reference that `train` takes as ``model.path``.

The steps are app/training/sft_loop.py's `fit`, which the tiny model's warm start (`model.bootstrap`,
app/training/bootstrap.py) runs too.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import replace
from pathlib import Path

from app.config import Config, ConfigError, check_trainable, flatten, to_yaml
from app.data import load_split
from app.data.prepare import ModelText
from app.data.sft import Examples, tokenize_examples
from app.evaluation.command import evaluate_model
from app.evaluation.run import EvalResult
from app.stopping import Stopped, Stopping
from app.tooling import tool_format
from app.tracking import Tracker
from app.training.bootstrap import ensure_model
from app.training.resume import resume_run
from app.training.setup import make_trainable, restore, start_process
from app.training.sft_loop import FitSettings, fit
from trainer.checkpoint import prune_checkpoints, save_checkpoint, step_dir
from trainer.distributed import DistInfo, Reducer, barrier
from trainer.model import load_model

log = logging.getLogger("trustbatch")


# ---------------------------------------------------------------------------------------------- the command


def run_sft(cfg: Config) -> dict:
    """`trustbatch sft CONFIG`: see the module docstring. Returns the summary (also written to summary.json)."""
    t_start = time.perf_counter()
    state = {"finish_step": False}

    def first(signum: int) -> None:
        if cfg.checkpoint.on_stop and state.get("fitting"):
            state.update(finish_step=True, signum=signum)  # the step in progress finishes and is checkpointed (sft_loop `stop`)
            return
        raise Stopped(signum, f"stopped {state.get('where', 'at start-up')}")

    waiting = ("finishing the step in progress and checkpointing it (checkpoint.on_stop)" if cfg.checkpoint.on_stop
               else "leaving the step in progress unfinished; resume= continues from the last complete checkpoint")
    with Stopping("sft", waiting=waiting, on_first=first).installed():
        return _run_sft(cfg, t_start, state)


def _run_sft(cfg: Config, t_start: float, state: dict) -> dict:
    cfg, resume = resume_run(cfg)
    if resume.checkpoint is not None and resume.state.get("kind") != "sft":
        raise ConfigError(f"resume={cfg.resume}: {resume.checkpoint} is a checkpoint of `train`, not of `sft`")
    check_trainable(cfg)
    train_rows = load_split(cfg.data, "train", "sft")
    eval_rows = load_split(cfg.data, "eval", "sft")[: cfg.sft.num_eval]

    dist = start_process(cfg, resume)
    reducer = dist.reducer()
    model_dir = ensure_model(cfg.model, cfg.data, is_main=dist.is_main, barrier=barrier, tracking_uri=cfg.tracking_uri)
    model, tokenizer = load_model(str(model_dir), dtype=cfg.model.dtype)
    text = ModelText.from_model(model, tokenizer, str(model_dir))
    # Tool-use transcripts (rows of a task with tools): the tools' outputs are context, not targets.
    transcripts = tool_format(cfg.rollout.tool_format, tokenizer, str(model_dir)) if cfg.tools else None
    tool_tasks = frozenset(task for spec in cfg.tools for task in spec.tasks)
    common = dict(on_long=cfg.sft.on_long, transcripts=transcripts, tool_tasks=tool_tasks)
    train = tokenize_examples(train_rows, text, source_key="data.train", source=cfg.data.describe("train"), **common)
    held = tokenize_examples(eval_rows, text, source_key="data.eval", source=cfg.data.describe("eval"), **common)
    total_steps = cfg.sft.total_steps(len(train.examples))
    log.info(
        "sft: %d examples (%d target tokens, %.0f per example; %d dropped as too long), %d held-out; %d steps of "
        "%d examples (%.2f epochs)",
        len(train.examples), train.target_tokens, train.target_tokens / len(train.examples), train.dropped,
        len(held.examples), total_steps, cfg.sft.batch_size, total_steps * cfg.sft.batch_size / len(train.examples),
    )  # fmt: skip

    optimizer, scheduler = make_trainable(model, cfg, dist, total_steps)
    if resume.checkpoint is not None:
        restore(cfg, resume, model, optimizer, scheduler, dist.rank)
    tracker = Tracker(cfg.tracking, cfg.run.path, run_name=cfg.run.name, enabled=dist.is_main,
                      resume_run_id=resume.state.get("mlflow_run_id"), tags={"trustbatch.command": "sft"})  # fmt: skip
    try:
        tracker.log_config(flatten(cfg), to_yaml(cfg))
        tracker.log_metrics({
            "data/train_examples": float(len(train.examples)), "data/eval_examples": float(len(held.examples)),
            "sft/dropped_long/train": float(train.dropped), "sft/dropped_long/eval": float(held.dropped),
        }, step=resume.step)  # fmt: skip
        summary = _train(cfg, dist, reducer, model, tokenizer, optimizer, scheduler, train, held, tracker,
                         resume.step, total_steps, model_dir, t_start, state)  # fmt: skip
    except Stopped:
        tracker.finish("KILLED")
        raise
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish()
    return summary


def _train(cfg, dist: DistInfo, reducer: Reducer, model, tokenizer, optimizer, scheduler, train: Examples,
           held: Examples, tracker: Tracker, start: int, total_steps: int, model_dir: Path, t_start: float,
           state: dict) -> dict:  # fmt: skip
    root = cfg.run.path / "checkpoints"
    history: list[dict] = []
    saved: dict[str, object] = {}

    def on_step(step: int, metrics: dict[str, float]) -> None:
        tracker.log_metrics(metrics, step)
        history.append({"step": step, **metrics})

    def on_checkpoint(step: int, last: bool) -> None:
        if not (last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0)):
            return
        losses = [h["sft/held_out_loss"] for h in history if h["step"] == step and "sft/held_out_loss" in h]
        state = {"kind": "sft", "step": step, "policy_version": step, "data_cursor": step * cfg.sft.batch_size,
                 "mlflow_run_id": tracker.run_id, "eval_accuracy": None,
                 "held_out_loss": losses[-1] if losses else None}  # fmt: skip
        path = save_checkpoint(step_dir(root, step), model=model, tokenizer=tokenizer, optimizer=optimizer,
                               scheduler=scheduler, state=state, config_yaml=to_yaml(cfg), rank=dist.rank,
                               world_size=dist.world_size)  # fmt: skip
        saved.update(step=step, path=path)
        if dist.is_main:
            if cfg.tracking.log_model:
                saved["version"] = tracker.register_checkpoint(
                    path / "model", name=registered_name(cfg), step=step, policy_version=step, eval_accuracy=None
                )
            prune_checkpoints(root, keep_last=cfg.checkpoint.keep_last)
            log.info("step %d: checkpoint %s%s", step, path,
                     f" (model version {saved['version']})" if saved.get("version") else "")  # fmt: skip

    settings = FitSettings(
        steps=total_steps, batch_size=cfg.sft.batch_size, micro_batch_size=cfg.trainer.micro_batch_size,
        max_grad_norm=cfg.trainer.max_grad_norm, compute_dtype=cfg.trainer.compute_dtype, seed=cfg.run.seed,
        eval_every=cfg.sft.eval_every,
        time_limit_s=cfg.run.time_limit_s, label=f"sft {cfg.run.name}", stop=lambda: state["finish_step"],
    )  # fmt: skip
    t_fit = time.perf_counter()
    state.update(fitting=True, where="during a step (resume= continues from the last complete checkpoint)")
    fit(model, optimizer, scheduler, tokenizer.pad_token_id, train.examples, held.examples, settings,
        start=start, reducer=reducer, rank=dist.rank, on_step=on_step, on_checkpoint=on_checkpoint)  # fmt: skip
    state.update(fitting=False, where="during the evaluation after the last step (its checkpoint is complete)")
    if state["finish_step"]:
        raise Stopped(state["signum"], f"stopped after step {saved.get('step', start)}, checkpointed")
    fit_s = time.perf_counter() - t_fit
    barrier()
    if not dist.is_main:
        return {}
    step = int(saved.get("step", start))
    model_path = Path(saved["path"]) / "model" if "path" in saved else model_dir
    trained = [h for h in history if "sft/loss" in h]
    losses = [h["sft/held_out_loss"] for h in history if "sft/held_out_loss" in h]
    summary: dict = {
        "command": "sft",
        "steps": step,
        "examples": len(train.examples),
        "epochs": step * cfg.sft.batch_size / len(train.examples),
        "train_loss_first": trained[0]["sft/loss"] if trained else None,
        "train_loss_last": trained[-1]["sft/loss"] if trained else None,
        "held_out_loss_first": losses[0] if losses else None,
        "held_out_loss_last": losses[-1] if losses else None,
        "tokens_per_s": sum(h["sft/tokens"] for h in trained) / fit_s if trained else None,
        "padding_fraction": (sum(h["sft/padding_fraction"] for h in trained) / len(trained)) if trained else None,
        "train_s": fit_s,
        "model_dir": str(model_path),
        "model_version": saved.get("version"),
        "model_ref": (f"models:/{registered_name(cfg)}/{saved['version']}" if saved.get("version") else str(model_path)),
        "mlflow_run_id": tracker.run_id,
        "tracking_uri": cfg.tracking_uri,
    }  # fmt: skip
    if cfg.sft.verify:
        summary.update(verify(cfg, model_path, tracker, step, saved.get("version")))
    summary["wall_s"] = time.perf_counter() - t_start
    (cfg.run.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    tracker.log_artifact(cfg.run.path / "summary.json")
    return summary


def registered_name(cfg: Config) -> str:
    return cfg.tracking.registered_model or cfg.run.name


def verify(cfg: Config, model_path: Path, tracker: Tracker, step: int, version: object) -> dict:
    """Sample and score the held-out prompts with the fine-tuned model: sampled (``eval.*``) and, with
    ``eval.greedy``, greedy; the metrics go to MLflow and the model version's tags."""
    eval_rows = load_split(cfg.data, "eval", "sft")[: cfg.eval.num_prompts]
    if any(r.answer is None and r.tests is None for r in eval_rows):
        log.warning("sft.verify: data.eval has rows without an answer or tests; no verifier accuracy is measured")
        return {}
    out: dict = {}
    runs = {"sampled": cfg}
    if cfg.eval.greedy:
        runs["greedy"] = replace(cfg, eval=replace(cfg.eval, temperature=0.0, samples_per_prompt=1, k=1))
    for name, run_cfg in runs.items():
        result: EvalResult = evaluate_model(str(model_path), run_cfg.eval_job, tracking_uri=cfg.tracking_uri,
                                            engine=cfg.rollout.engine, label=f"sft eval ({name})")  # fmt: skip
        out[f"{name}_accuracy"] = result.accuracy
        out[f"{name}_accuracy_se"] = result.stderr
        out[f"{name}_answer_rate"] = result.answer_rate
        out[f"{name}_truncated_rate"] = result.truncated_rate
        out["eval_prompts"] = len(result.correct)
    prefix = {"sampled": "eval/", "greedy": "eval/greedy_"}
    tracker.log_metrics(
        {f"{prefix[n]}{k}": out[f"{n}_{k}"] for n in runs for k in ("accuracy", "answer_rate")
         if out.get(f"{n}_{k}") is not None}, step)  # fmt: skip
    if version is not None and tracker.enabled:
        name = registered_name(cfg)
        tracker.client.set_model_version_tag(name, str(version), "eval_accuracy", f"{out['sampled_accuracy']:.6f}")
        if "greedy_accuracy" in out:
            tracker.client.set_model_version_tag(name, str(version), "greedy_accuracy", f"{out['greedy_accuracy']:.6f}")
    return out


def summary_lines(s: dict) -> list[str]:
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.2f}%"

    lines = [
        f"sft: {s['steps']} steps ({s['epochs']:.2f} epochs of {s['examples']} examples) in {s['train_s']:.0f} s, "
        f"{s['tokens_per_s']:.0f} tokens/s, padding {pct(s['padding_fraction'])}"
        if s.get("tokens_per_s") is not None else f"sft: {s['steps']} steps",
        f"sft: held-out loss {s['held_out_loss_first']:.4f} -> {s['held_out_loss_last']:.4f}"
        if s.get("held_out_loss_first") is not None else "sft: no held-out loss",
    ]  # fmt: skip
    if "sampled_accuracy" in s:
        se = s["sampled_accuracy_se"]
        lines.append(
            f"sft: held-out ({s['eval_prompts']} prompts) sampled pass@1 {pct(s['sampled_accuracy'])}"
            + (f" ± {100 * se:.2f}" if se is not None and math.isfinite(se) else "")
            + (f", greedy {pct(s['greedy_accuracy'])}" if "greedy_accuracy" in s else "")
            + f", answer rate {pct(s['sampled_answer_rate'])}"
        )
    lines.append(f"sft: model {s['model_ref']} (train it with model.path={s['model_ref']})")
    return lines
