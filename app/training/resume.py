"""Where a training run starts: step 0 of a new run, or the last complete checkpoint of an interrupted one.

`find_resume(cfg)` reads ``cfg.resume`` (a run directory, or the MLflow run id of one), lists its complete
checkpoints, checks every one (a checkpoint marked complete can still be damaged), and returns the newest usable
one with its state.json; the run then continues in that directory and MLflow run (app/training/setup.py restores
the weights, optimizer, schedule and data position). Damaged checkpoints are named in a warning and moved aside
(`set_aside`), never deleted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from app.config import Config, ConfigError
from trainer.checkpoint import checkpoint_problem, list_checkpoints

log = logging.getLogger("trustbatch")


@dataclass
class Resume:
    """Where a run starts: step 0 of a new run, or the last complete checkpoint of an interrupted one."""

    step: int = 0
    """Optimizer steps already taken (= the policy version of the weights the run starts from)."""
    run_dir: Path | None = None
    """The interrupted run's directory: the resumed run writes there."""
    checkpoint: Path | None = None
    state: dict = field(default_factory=dict)
    """The checkpoint's state.json (empty for a new run)."""
    damaged: list[tuple[Path, str]] = field(default_factory=list)
    """Checkpoints marked complete that cannot be resumed from, with why; `setup` moves them aside."""


def resume_run(cfg: Config) -> tuple[Config, Resume]:
    """`find_resume`, and the config writing to the interrupted run's directory when it resumes one."""
    resume = find_resume(cfg)
    if resume.run_dir is not None and resume.run_dir.resolve() != cfg.run.path.resolve():
        log.info("resume: writing to the interrupted run's directory %s", resume.run_dir)
        cfg = replace(cfg, run=replace(cfg.run, dir=str(resume.run_dir)))
    return cfg, resume


def find_resume(cfg: Config) -> Resume:
    """The checkpoint `cfg.resume` points at (a run directory or an MLflow run id), or a fresh start."""
    if not cfg.resume:
        return Resume()
    run_dir = Path(cfg.resume)
    if not run_dir.is_dir():
        run_dir = _run_dir_of_mlflow_run(cfg, cfg.resume)
    root = run_dir / "checkpoints"
    found = list_checkpoints(root)
    if not found:
        raise ConfigError(
            f"resume={cfg.resume}: no complete checkpoint under {root} (the run was "
            "interrupted before its first checkpoint, or checkpoint.every=0); start it again without resume"
        )
    # Every kept checkpoint is checked, not only the newest: the loop reads each one's state.json later.
    steps = {path: step for step, path in found}
    problems = {path: checkpoint_problem(path) for _, path in found}
    damaged = [(path, problem) for path, problem in problems.items() if problem is not None]
    usable = [path for _, path in found if problems[path] is None]
    if not usable:
        listed = "; ".join(f"{path}: {problem}" for path, problem in damaged)
        raise ConfigError(
            f"resume={cfg.resume}: no checkpoint under {root} can be resumed from ({listed}); restore one from a "
            "backup, or start the run again without resume"
        )
    checkpoint = usable[-1]
    for path, problem in damaged:
        log.warning(
            "resume: checkpoint %s is marked complete but damaged (%s); resuming from %s instead%s",
            path,
            problem,
            checkpoint.name,
            " (it is newer: its steps are redone)" if steps[path] > steps[checkpoint] else "",
        )
    state = json.loads((checkpoint / "state.json").read_text())
    return Resume(
        step=int(state["step"]), run_dir=run_dir, checkpoint=checkpoint, state=state, damaged=damaged
    )


def set_aside(damaged: list[tuple[Path, str]]) -> None:
    """Rename damaged checkpoints to `step-N.damaged` (kept for inspection): no longer listed, pruned or
    resumed from, and a later checkpoint of the same step gets the name back."""
    for path, _ in damaged:
        target = path.with_name(f"{path.name}.damaged")
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}.damaged{n}")
        path.rename(target)
        log.warning("resume: moved the damaged checkpoint %s to %s", path, target.name)


def _run_dir_of_mlflow_run(cfg: Config, run_id: str) -> Path:
    from mlflow.exceptions import MlflowException

    from app.tracking import mlflow_client

    uri = cfg.tracking_uri
    try:
        run = mlflow_client(uri).get_run(run_id)
    except MlflowException as exc:
        raise ConfigError(
            f"resume={run_id}: not a directory, and not a run in the MLflow store {uri} ({exc.message}); "
            "give the run directory (e.g. resume=runs/quickstart) or the run id shown at the end of training"
        ) from None
    run_dir = run.data.tags.get("trustbatch.run_dir")
    if not run_dir or not Path(run_dir).is_dir():
        raise ConfigError(f"resume={run_id}: MLflow run found, but its run directory {run_dir!r} is gone")
    return Path(run_dir)
