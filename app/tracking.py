"""MLflow tracking: one run per training run, params + resolved config + per-step metrics + artifacts.

Default store: a SQLite file and an artifact folder beside the run directory (`runs/mlflow.db`,
`runs/mlartifacts/` for runs under `runs/`), shared by every run there, so a run needs no server and one model
registry holds the checkpoints of all of them; `$MLFLOW_TRACKING_URI` or any `tracking.uri` (an MLflow
server, another SQLite file) works the same.
Only rank 0 tracks; other ranks get a `Tracker` whose methods do nothing (`enabled=False`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from app.config import Config, TrackingConfig, flatten, to_yaml

# `import mlflow` takes 2-4 s: do it once, lazily, and only on the rank that tracks.
_mlflow = None


def _import_mlflow():
    global _mlflow
    if _mlflow is None:
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        import mlflow

        _mlflow = mlflow
    return _mlflow


DEFAULT_RUNS_ROOT = Path("runs")
"""Where run directories live by default (`run.dir` empty: runs/<run.name>)."""


def default_tracking_uri(runs_root: Path = DEFAULT_RUNS_ROOT) -> str:
    """The store every command uses unless told otherwise: $MLFLOW_TRACKING_URI, else the SQLite file
    `<runs_root>/mlflow.db`. One store for all runs under a root, so the model registry spans runs and
    `trustbatch models`, `serve` and `eval` find every version without being told where a run was."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(Path(runs_root) / 'mlflow.db').resolve()}"


class Tracker:
    """A thin wrapper over one active MLflow run."""

    def __init__(self, cfg: TrackingConfig, run_dir: Path, *, run_name: str, enabled: bool = True):
        self.enabled = enabled
        self.run_id: str | None = None
        # The default store sits beside the run directory (runs/mlflow.db for runs/<name>), shared by its siblings.
        self.tracking_uri = cfg.uri or default_tracking_uri(run_dir.parent)
        self._cfg = cfg
        if not enabled:
            return
        mlflow = _import_mlflow()
        mlflow.set_tracking_uri(self.tracking_uri)
        experiment = mlflow.get_experiment_by_name(cfg.experiment)
        if experiment is None:
            # A local store keeps artifacts beside the database, inside the run directory.
            location = None if cfg.uri else (run_dir.parent / "mlartifacts").resolve().as_uri()
            experiment_id = mlflow.create_experiment(cfg.experiment, artifact_location=location)
        else:
            experiment_id = experiment.experiment_id
        self._run = mlflow.start_run(experiment_id=experiment_id, run_name=run_name)
        self.run_id = self._run.info.run_id

    def log_config(self, config: Config) -> None:
        if not self.enabled:
            return
        mlflow = _import_mlflow()
        params = {k: ("" if v is None else str(v))[:6000] for k, v in flatten(config).items()}
        items = list(params.items())
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            mlflow.log_params(dict(items[i : i + 100]))
        mlflow.log_text(to_yaml(config), "config.yaml")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        clean = {}
        for k, v in metrics.items():
            v = float(v)
            if math.isfinite(v):
                # MLflow metric names allow / . - _ and spaces; ours are already namespaced with '/'.
                clean[k] = v
        if clean:
            _import_mlflow().log_metrics(clean, step=step)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if not self.enabled:
            return
        mlflow = _import_mlflow()
        if path.is_dir():
            mlflow.log_artifacts(str(path), artifact_path=artifact_path)
        else:
            mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        if self.enabled and self.run_id is not None:
            _import_mlflow().end_run(status=status)
