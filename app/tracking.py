"""MLflow tracking: one run per training run, params + resolved config + per-step metrics + artifacts.

Default store: a SQLite file and an artifact folder inside the run directory, so a run needs no server and
the directory is self-contained; any `tracking.uri` (an MLflow server, another SQLite file) works the same.
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


def default_tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


class Tracker:
    """A thin wrapper over one active MLflow run."""

    def __init__(self, cfg: TrackingConfig, run_dir: Path, *, run_name: str, enabled: bool = True):
        self.enabled = enabled
        self.run_id: str | None = None
        self.tracking_uri = cfg.uri or default_tracking_uri(run_dir)
        self._cfg = cfg
        if not enabled:
            return
        mlflow = _import_mlflow()
        mlflow.set_tracking_uri(self.tracking_uri)
        experiment = mlflow.get_experiment_by_name(cfg.experiment)
        if experiment is None:
            # A local store keeps artifacts beside the database, inside the run directory.
            location = None if cfg.uri else (run_dir / "mlartifacts").resolve().as_uri()
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
