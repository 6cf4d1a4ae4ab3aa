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
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# `import mlflow` takes 2-4 s: do it once, lazily, and only on the rank that tracks.
_mlflow = None


def _import_mlflow():
    global _mlflow
    if _mlflow is None:
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        import mlflow

        _mlflow = mlflow
    return _mlflow


NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""run.name and tracking.registered_model: a directory name under runs/ and a valid MLflow registered-model name
(no '/', ':' or '..' path parts), so neither the run directory nor the model registration can fail or escape."""


def check_name(key: str, value: str) -> None:
    if not NAME_PATTERN.fullmatch(value):
        raise ValueError(
            f"{key}={value!r} is not a valid name: use 1-100 letters, digits, '.', '_' or '-', starting with a "
            f"letter or digit (it names the run directory under runs/ and the MLflow registered model), "
            f"e.g. {key}={re.sub(r'[^A-Za-z0-9._-]+', '-', value).strip('.-_') or 'run'}"
        )


@dataclass
class TrackingConfig:
    """Where and how a run is tracked (config section ``tracking``)."""

    uri: str = ""
    """MLflow tracking URI. Empty: $MLFLOW_TRACKING_URI, else a SQLite store beside the run directory
    (runs/mlflow.db, artifacts in runs/mlartifacts), shared by every run under runs/."""
    experiment: str = "trustbatch"
    """MLflow experiment name."""
    log_model: bool = True
    """Log every checkpoint's HF weights as run artifacts and register each as a new version of
    tracking.registered_model (alias `best`; `latest` is MLflow's own name for the newest version)."""
    registered_model: str = ""
    """Name of the registered model that checkpoints become versions of. Empty: run.name."""

    def __post_init__(self) -> None:
        if self.registered_model:
            check_name("tracking.registered_model", self.registered_model)


def writable_dir_problem(path: Path) -> str | None:
    """Why files cannot be created in directory `path` (created later if missing), or None.

    Probes the directory itself, or its nearest existing ancestor, by creating and removing a file there: the
    only check that holds for root and for filesystems such as /proc, where permission bits say writable.
    """
    path = Path(path).expanduser().absolute()
    probe = path
    try:
        while not probe.exists():
            if probe.parent == probe:
                return f"no existing parent directory of {path}"
            probe = probe.parent
        if not probe.is_dir():
            return f"{probe} is a file, not a directory"
    except OSError as exc:  # stat refused (a directory this user cannot search)
        return f"cannot look at {probe}: {exc.strerror or exc}"
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".trustbatch-write-test-")
    except OSError as exc:
        return f"cannot create files in {probe}: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(name)
    return None


DEFAULT_RUNS_ROOT = Path("runs")
"""Where run directories live by default (`run.dir` empty: runs/<run.name>)."""


def default_tracking_uri(runs_root: Path = DEFAULT_RUNS_ROOT) -> str:
    """The store every command uses unless told otherwise: $MLFLOW_TRACKING_URI, else the SQLite file
    `<runs_root>/mlflow.db`. One store for all runs under a root, so the model registry spans runs and
    `trustbatch models`, `serve` and `eval` find every version without being told where a run was."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(Path(runs_root) / 'mlflow.db').resolve()}"


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI; None for any other store."""
    prefix = "sqlite:///"
    return Path(tracking_uri[len(prefix) :]) if tracking_uri.startswith(prefix) else None


_BUILTIN_SCHEMES = (
    *("file", "http", "https", "databricks", "databricks-uc", "uc"),
    *("sqlite", "postgresql", "mysql", "mssql"),
)
"""Schemes MLflow's own tracking stores serve (a database scheme may carry a driver: postgresql+psycopg2)."""


def store_problem(tracking_uri: str) -> str | None:
    """Why MLflow could not use ``tracking_uri`` (an unknown scheme; a local store in a directory that cannot be
    written), or None. Quick and bounded, without importing MLflow: a SQLite file in an unwritable directory makes
    MLflow retry for minutes instead of failing."""
    from urllib.parse import urlparse

    scheme = urlparse(tracking_uri).scheme.split("+")[0].lower()
    if len(scheme) == 1:  # a Windows drive letter: a local path
        scheme = ""
    known = set(_BUILTIN_SCHEMES) | _plugin_schemes()
    if scheme and scheme not in known:
        return (
            f"its scheme {scheme!r} is not a tracking store MLflow knows (known: {', '.join(sorted(known))})"
        )
    db = sqlite_path(tracking_uri)
    if scheme == "sqlite" and db is None:
        return "a SQLite URI needs three slashes before the path: sqlite:///relative/path.db or sqlite:////abs/path.db"
    if db is not None:
        try:
            if db.exists() and not db.is_file():
                return f"{db} is not a file"
        except OSError as exc:  # stat refused (a directory this user cannot search)
            return f"cannot look at {db}: {exc.strerror or exc}"
        problem = writable_dir_problem(db.parent)
        if problem:
            return f"the SQLite file {db} cannot be created or written ({problem})"
        return None
    if scheme in ("", "file"):
        local = Path(urlparse(tracking_uri).path if scheme == "file" else tracking_uri)
        problem = writable_dir_problem(local)
        if problem:
            return f"the file store {local} cannot be created or written ({problem})"
    return None


def _plugin_schemes() -> set[str]:
    """Schemes that installed MLflow plugins register (entry points of group mlflow.tracking_store)."""
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group="mlflow.tracking_store")}


_STORE_FILES: dict[str, tuple[int, int]] = {}
"""The SQLite file (device, inode) each store URI had when this process last used it."""


def _identity(db: Path) -> tuple[int, int] | None:
    try:
        st = db.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _drop_engines(db: Path) -> None:
    """Dispose of the SQLAlchemy engines MLflow's stores keep (per class, by URI) for the file ``db``."""
    from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as RegistryStore
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as TrackingStore

    for store in (TrackingStore, RegistryStore):
        engines = getattr(store, "_engine_map", None)
        if not isinstance(engines, dict):
            continue
        for uri in [u for u in engines if sqlite_path(u) is not None and sqlite_path(u).resolve() == db.resolve()]:
            engines.pop(uri).dispose()


def mlflow_client(tracking_uri: str, registry_uri: str | None = None):
    """``MlflowClient`` for ``tracking_uri``, safe where its SQLite file was replaced since this process used it.

    MLflow keeps one store per URI for the life of the process (an lru_cache), connected to the file it first
    opened. Remove a run directory's store and use the same path again in the same process (a notebook, a test
    suite) and that store writes to the deleted file: "attempt to write a readonly database". When the file at a
    known URI is no longer the one seen before, MLflow's cached stores are dropped first."""
    from mlflow.tracking import MlflowClient

    db = sqlite_path(tracking_uri)
    if db is not None:
        key = str(db.resolve())
        seen = _STORE_FILES.get(key)
        if seen is not None and seen != _identity(db):
            from mlflow.tracking._model_registry.registry import ModelRegistryStoreRegistry
            from mlflow.tracking._tracking_service.registry import TrackingStoreRegistry

            TrackingStoreRegistry._get_store_with_resolved_uri.cache_clear()
            ModelRegistryStoreRegistry._get_store_with_resolved_uri.cache_clear()
            _drop_engines(db)
            del _STORE_FILES[key]
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri)
    if db is not None:
        client.search_experiments(max_results=1)  # opens (creates) the file, so that its identity is the store's
        if (now := _identity(db)) is not None:
            _STORE_FILES[str(db.resolve())] = now
    return client


def ensure_experiment(client, name: str, tracking_uri: str) -> str:
    """The id of experiment ``name``, created if missing. A SQLite store keeps its artifacts in ``mlartifacts/``
    beside the database file (the run directories' parent by default), never in the current directory."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    db = sqlite_path(tracking_uri)
    location = (db.resolve().parent / "mlartifacts").as_uri() if db is not None else None
    return client.create_experiment(name, artifact_location=location)


class Tracker:
    """One MLflow run, written through ``MlflowClient`` with an explicit run id.

    The client API (not ``mlflow.log_*``) because MLflow's active run is per thread, and the loop logs from
    worker threads (evaluation, checkpoints). Only rank 0 tracks; other ranks get a Tracker whose methods do
    nothing (``enabled=False``).
    """

    def __init__(
        self,
        cfg: TrackingConfig,
        run_dir: Path | None,
        *,
        run_name: str,
        enabled: bool = True,
        resume_run_id: str | None = None,
        tags: dict[str, str] | None = None,
    ):
        """Start a new MLflow run in experiment ``cfg.experiment`` with ``tags``, or continue run
        ``resume_run_id`` (its metrics then go on from where they stopped: the caller logs at the steps that
        follow the checkpoint). ``run_dir`` None: a run without a directory (`trustbatch eval`), tracked in
        ``cfg.uri`` or the default store."""
        self.enabled = enabled
        self.run_id: str | None = None
        self._resumed = bool(resume_run_id)  # params are immutable in MLflow: a resumed run keeps its own
        # The default store sits beside the run directory (runs/mlflow.db for runs/<name>), shared by its siblings.
        self.tracking_uri = cfg.uri or (
            default_tracking_uri(run_dir.parent) if run_dir else default_tracking_uri()
        )
        if not enabled:
            return
        _import_mlflow()
        db = sqlite_path(self.tracking_uri)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)  # store_problem checked that it can be created
        self.client = mlflow_client(self.tracking_uri)
        if resume_run_id:
            run = self.client.get_run(resume_run_id)
            self.client.update_run(resume_run_id, status="RUNNING")
        else:
            experiment_id = ensure_experiment(self.client, cfg.experiment, self.tracking_uri)
            run_tags = {**(tags or {}), "mlflow.runName": run_name}
            if run_dir is not None:
                run_tags["trustbatch.run_dir"] = str(run_dir.resolve())
            run = self.client.create_run(experiment_id, run_name=run_name, tags=run_tags)
        self.run_id = run.info.run_id
        self.artifact_uri = run.info.artifact_uri

    def log_config(self, params: dict[str, object], yaml_text: str) -> None:
        """A new run's flattened config as params and its resolved YAML as ``config.yaml`` (a resumed run keeps
        its own: MLflow params are immutable)."""
        if not self.enabled or self._resumed:
            return
        self.log_params(params)
        self.client.log_text(self.run_id, yaml_text, "config.yaml")

    def log_params(self, params: dict[str, object]) -> None:
        """Params as strings (None as empty), each cut to MLflow's 6000 characters."""
        if not self.enabled or self._resumed:
            return
        from mlflow.entities import Param

        items = [Param(k, ("" if v is None else str(v))[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_text(self, text: str, artifact_file: str) -> None:
        """``text`` as the run artifact ``artifact_file`` (a path inside the run's artifacts)."""
        if self.enabled:
            self.client.log_text(self.run_id, text, artifact_file)

    def set_tag(self, key: str, value: str) -> None:
        """Set one tag on the run (MLflow caps a tag value at 8000 characters)."""
        if self.enabled:
            self.client.set_tag(self.run_id, key, value[:8000])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        clean = []
        for k, v in metrics.items():
            v = float(v)
            if math.isfinite(v):
                # MLflow metric names allow / . - _ and spaces; ours are already namespaced with '/'.
                clean.append(Metric(k, v, now, step))
        for i in range(0, len(clean), 1000):  # MLflow caps a batch at 1000 metrics
            self.client.log_batch(self.run_id, metrics=clean[i : i + 1000])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if not self.enabled:
            return
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path=artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path=artifact_path)

    def register_checkpoint(
        self,
        model_dir: Path,
        *,
        name: str,
        step: int,
        policy_version: int,
        eval_accuracy: float | None,
        max_lag: int | None = None,
    ) -> str | None:
        """Log an HF checkpoint directory as run artifacts and register it as a new version of model ``name``.

        Tags: step, policy_version, eval_accuracy (when the checkpoint was evaluated), max_lag (the lag bound in
        force, when given), run_id. Alias ``best``
        when its eval_accuracy beats every other version of ``name`` that has one. ``latest`` needs no alias:
        MLflow reserves that name for the newest version (``models:/NAME/latest``; `trustbatch serve` also
        accepts ``models:/NAME@latest``). Returns the version number (None when tracking is off on this rank).
        """
        if not self.enabled:
            return None
        from mlflow.exceptions import MlflowException

        artifact_path = f"checkpoints/step-{step:06d}"
        self.log_artifact(model_dir, artifact_path=artifact_path)
        try:
            self.client.get_registered_model(name)
        except MlflowException:
            self.client.create_registered_model(
                name, description="Checkpoints of trustbatch RL runs (HF format: safetensors + config + tokenizer)."
            )
        tags = {"step": str(step), "policy_version": str(policy_version), "run_id": self.run_id}
        if eval_accuracy is not None:
            tags["eval_accuracy"] = f"{eval_accuracy:.6f}"
        if max_lag is not None:
            tags["max_lag"] = str(max_lag)
        source = f"{self.artifact_uri}/{artifact_path}"
        version = str(self.client.create_model_version(name, source=source, run_id=self.run_id, tags=tags).version)
        if eval_accuracy is not None and eval_accuracy > self._best_accuracy(name, exclude=version):
            self.client.set_registered_model_alias(name, "best", version)
        return version

    def _best_accuracy(self, name: str, *, exclude: str) -> float:
        best = float("-inf")
        for mv in self.client.search_model_versions(f"name='{name}'"):
            if str(mv.version) != exclude and "eval_accuracy" in mv.tags:
                best = max(best, float(mv.tags["eval_accuracy"]))
        return best

    def finish(self, status: str = "FINISHED") -> None:
        if self.enabled and self.run_id is not None:
            self.client.set_terminated(self.run_id, status=status)
