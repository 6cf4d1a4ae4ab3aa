"""Model references: what `trustbatch serve`, `eval` and `models` accept, turned into a local HF directory.

A reference is one of
- ``models:/NAME@ALIAS`` — the version of registered model NAME that ALIAS points at (training sets ``best``);
  ``@latest`` is the newest version: MLflow reserves the alias name ``latest`` (``set_registered_model_alias``
  refuses it), so it is never stored and means, as in MLflow's ``models:/NAME/latest``, the highest version;
- ``models:/NAME/VERSION`` — one version by number (or ``latest``);
- ``runs:/RUN_ID/PATH`` — an artifact directory of an MLflow run (e.g. ``runs:/<id>/checkpoints/step-000100``);
- a local directory written by ``save_pretrained`` (config.json + weights + tokenizer files), used in place.

The store is any MLflow tracking URI; ``app.tracking.default_tracking_uri()`` ($MLFLOW_TRACKING_URI, else
``sqlite:///runs/mlflow.db``) unless told otherwise. Everything goes through one ``MlflowClient`` bound to that
URI: ``mlflow.artifacts.download_artifacts("models:/...")`` would look the name up in the *global* registry
(a stray ``mlflow.db`` in the current directory), so registry references are resolved to the version's source
URI here and that URI is downloaded.

Downloads always go to an explicit directory (without ``dst_path`` a local store hands back the original
artifact directory, which must never be written into): ``dst`` when given, else a cache under
``$TRUSTBATCH_CACHE_DIR`` (default ``$XDG_CACHE_HOME/trustbatch`` or ``~/.cache/trustbatch``). A registered
version is immutable, so a complete cached copy is reused; a ``runs:/`` artifact can be overwritten, so it is
fetched again each time. A download lands in a temporary sibling and is renamed into place, so an interrupted
one never leaves a half directory under the final name.

Errors are ``ModelRefError`` (a ValueError) naming what was asked, what exists (model names, aliases, versions,
a run's artifacts) and the fix. Not covered: hub ids (download with ``hf download`` and pass the directory),
MLflow "logged models" (``models:/m-<id>``) and stage names (``models:/NAME/Production``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal

from app.data.cache import default_cache_dir  # noqa: F401 - where models are cached; imported from here too

MODEL_FILES = ("config.json",)
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
COMPLETE_MARKER = ".trustbatch-complete"
LATEST = "latest"
"""Not an alias (MLflow reserves the name): ``@latest`` / ``/latest`` mean the highest version."""
VERSION_TAGS = ("step", "policy_version", "eval_accuracy", "run_id")
"""Tags the training loop sets on each registered checkpoint version (app/tracking.py)."""

_FORMS = (
    "models:/NAME@ALIAS (e.g. models:/quickstart@best), models:/NAME/VERSION (e.g. models:/quickstart/3), "
    "runs:/RUN_ID/PATH (e.g. runs:/<run id>/checkpoints/step-000100) or a local model directory"
)


class ModelRefError(ValueError):
    """A model reference that cannot be resolved; the message says what exists and how to fix it."""


@dataclass(frozen=True)
class ModelSource:
    """What a reference points at, before anything is downloaded."""

    ref: str
    kind: Literal["registry", "run", "path"]
    uri: str
    """Where the files are: the version's source URI, ``runs:/ID/PATH``, or the local directory."""
    name: str | None = None
    version: str | None = None
    alias: str | None = None
    run_id: str | None = None
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """One line for logs and banners, e.g. ``models:/tiny@best (version 3 of tiny, run 1a2b...)``."""
        if self.kind == "registry":
            return f"{self.ref} (version {self.version} of {self.name}, run {self.run_id or '-'})"
        return self.ref


# ---------------------------------------------------------------------------------------------- references


_MODELS = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>[^/@]+))$")
_RUNS = re.compile(r"^runs:/(?P<run_id>[^/]+)/(?P<path>.+)$")


def lookup(ref: str, *, tracking_uri: str) -> ModelSource:
    """Check a reference against the store (or the file system) and say what it points at; no download."""
    ref = ref.strip()
    if not ref:
        raise ModelRefError(f"empty model reference; give one of {_FORMS}")
    if ref.startswith("models:"):
        match = _MODELS.match(ref)
        if not match:
            raise ModelRefError(f"model reference {ref!r} is malformed; registry references are {_FORMS}")
        return _lookup_registry(ref, match["name"], match["alias"], match["version"], tracking_uri)
    if ref.startswith("runs:"):
        match = _RUNS.match(ref)
        if not match:
            raise ModelRefError(f"run reference {ref!r} is malformed; write runs:/RUN_ID/PATH ({_FORMS})")
        return _lookup_run(ref, match["run_id"], match["path"].strip("/"), tracking_uri)
    path = Path(ref).expanduser()
    if not path.exists():
        raise ModelRefError(
            f"{ref!r} is neither an existing directory nor a model reference; give one of {_FORMS}"
        )
    check_hf_directory(path, ref)
    return ModelSource(ref=ref, kind="path", uri=str(path.resolve()))


def check_hf_directory(path: Path, what: str) -> None:
    """ModelRefError unless ``path`` is a Hugging Face model directory (config.json + weights)."""
    if not path.is_dir():
        raise ModelRefError(f"{what!r} is a file, not a directory; give a Hugging Face model directory")
    missing = [name for name in MODEL_FILES if not (path / name).is_file()]
    has_weights = any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS)
    if missing or not has_weights:
        found = sorted(p.name for p in path.iterdir())[:10]
        lacks = missing + ([] if has_weights else ["weights (*.safetensors)"])
        raise ModelRefError(
            f"{what!r} is not a Hugging Face model directory: it has no {' and no '.join(lacks)} "
            f"(it holds {found or 'nothing'}). Point at a directory written by save_pretrained "
            "(config.json + *.safetensors + tokenizer files), e.g. a run's checkpoints/<step> directory"
        )


def _client(tracking_uri: str):
    """An MlflowClient on ``tracking_uri`` (also its registry); refuses to create a SQLite store by accident."""
    from app.tracking import sqlite_path

    if (db := sqlite_path(tracking_uri)) is not None:
        if not db.is_file():
            raise ModelRefError(
                f"no MLflow store at {db} (tracking URI {tracking_uri}): train a model first "
                "(trustbatch train ...), or pass --tracking-uri / set MLFLOW_TRACKING_URI to the store that "
                "holds your runs"
            )
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from app.tracking import mlflow_client

    return mlflow_client(tracking_uri, registry_uri=tracking_uri)


def _not_found(exc: Exception) -> bool:
    code = getattr(exc, "error_code", "")
    return code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE") or "not found" in str(exc)


def _registered_names(client) -> list[str]:
    return sorted(m.name for m in _all_registered_models(client))


def _all_registered_models(client) -> list:
    models, token = [], None
    while True:
        page = client.search_registered_models(max_results=1000, page_token=token)
        models.extend(page)
        token = page.token
        if not token:
            return models


def _all_versions(client, name: str) -> list:
    versions, token = [], None
    escaped = name.replace("'", "\\'")
    while True:
        page = client.search_model_versions(f"name='{escaped}'", max_results=10000, page_token=token)
        versions.extend(page)
        token = page.token
        if not token:
            return sorted(versions, key=lambda mv: int(mv.version))


def _lookup_registry(
    ref: str, name: str, alias: str | None, version: str | None, tracking_uri: str
) -> ModelSource:
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        registered = client.get_registered_model(name)
    except MlflowException as exc:
        if not _not_found(exc):
            raise ModelRefError(f"{ref}: the MLflow store at {tracking_uri} answered: {exc}") from None
        names = _registered_names(client)
        raise ModelRefError(
            f"{ref}: no registered model named {name!r} in {tracking_uri}; registered models: "
            f"{names or 'none yet (training registers its checkpoints)'}. See them with `trustbatch models`"
        ) from None
    aliases = dict(registered.aliases or {})
    if (alias or "").lower() == LATEST or (version or "").lower() == LATEST:
        numbers = [int(mv.version) for mv in _all_versions(client, name)]
        if not numbers:
            raise ModelRefError(f"{ref}: model {name!r} has no versions yet")
        alias = LATEST if alias is not None else None
        version = str(max(numbers))
    elif alias is not None:
        if alias not in aliases:
            known = ", ".join(f"@{a} -> version {v}" for a, v in sorted(aliases.items()))
            known = ", ".join(filter(None, [known, "@latest (the newest version)"]))
            raise ModelRefError(
                f"{ref}: model {name!r} has no alias {alias!r}; its aliases: {known}. "
                f"Use one of them or a version number (models:/{name}/VERSION)"
            )
        version = str(aliases[alias])
    if not str(version).isdigit():
        raise ModelRefError(
            f"{ref}: version {version!r} is not a number; write models:/{name}/<number> or models:/{name}@<alias>"
        )
    try:
        mv = client.get_model_version(name, str(version))
    except MlflowException as exc:
        if not _not_found(exc):
            raise ModelRefError(f"{ref}: the MLflow store at {tracking_uri} answered: {exc}") from None
        numbers = [mv.version for mv in _all_versions(client, name)]
        raise ModelRefError(
            f"{ref}: model {name!r} has no version {version}; its versions: {numbers or 'none'}"
        ) from None
    source = client.get_model_version_download_uri(name, str(mv.version))
    return ModelSource(
        ref=ref,
        kind="registry",
        uri=source,
        name=name,
        version=str(mv.version),
        alias=alias,
        run_id=mv.run_id or mv.tags.get("run_id"),
        tags=dict(mv.tags or {}),
    )


def _lookup_run(ref: str, run_id: str, path: str, tracking_uri: str) -> ModelSource:
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        client.get_run(run_id)
    except MlflowException as exc:
        if not _not_found(exc):
            raise ModelRefError(f"{ref}: the MLflow store at {tracking_uri} answered: {exc}") from None
        raise ModelRefError(
            f"{ref}: no run with id {run_id!r} in {tracking_uri}; copy a run id from `trustbatch models` "
            "(run id column) or the MLflow UI"
        ) from None
    if not client.list_artifacts(run_id, path):
        parent = path.rpartition("/")[0]
        siblings = [f.path for f in client.list_artifacts(run_id, parent or None)]
        raise ModelRefError(
            f"{ref}: run {run_id} has no artifact {path!r}; "
            f"{'under ' + repr(parent) + ' it has' if parent else 'its artifacts are'}: {siblings or 'none'}"
        )
    return ModelSource(ref=ref, kind="run", uri=f"runs:/{run_id}/{path}", run_id=run_id)


# ---------------------------------------------------------------------------------------------- download


def _cache_path(source: ModelSource, tracking_uri: str) -> Path:
    store = hashlib.sha256(tracking_uri.encode()).hexdigest()[:12]  # the same name in two stores differs
    if source.kind == "registry":
        leaf = Path(_safe(source.name)) / f"v{source.version}"
    else:
        leaf = Path("runs") / _safe(source.run_id) / _safe(source.uri.split("/", 2)[2])
    return default_cache_dir() / "models" / store / leaf


def _safe(text: str | None) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text or "_")


def resolve_model(ref: str, *, tracking_uri: str, dst: Path | None = None) -> Path:
    """A local HF directory for ``ref`` (see the module docstring for the forms and the cache).

    ``dst``: where a registry or run reference is downloaded (it must not exist yet, or be an empty
    directory); None uses the cache. A local directory is returned as it is, never copied.
    """
    return fetch(lookup(ref, tracking_uri=tracking_uri), tracking_uri=tracking_uri, dst=dst)


def fetch(source: ModelSource, *, tracking_uri: str, dst: Path | None = None) -> Path:
    """Download what ``lookup`` found (unless it is a local directory); returns the HF directory."""
    if source.kind == "path":
        return Path(source.uri)
    if dst is not None:
        dst = Path(dst)
        if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
            raise ModelRefError(f"dst {str(dst)!r} already exists and is not empty; give a new directory")
        reuse = False
    else:
        dst = _cache_path(source, tracking_uri)
        reuse = source.kind == "registry"  # a registered version never changes; a run artifact may
        if reuse and (dst / COMPLETE_MARKER).is_file():
            return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        local = _download(source, staging, tracking_uri)
        check_hf_directory(local, source.ref)
        if reuse:
            if (dst / COMPLETE_MARKER).is_file():  # another process finished the same version meanwhile
                return dst  # and may be loading it: keep its copy (this one is dropped below)
            (local / COMPLETE_MARKER).write_text(f"{source.label}\n")
        if dst.exists():
            if dst.is_dir() and not any(dst.iterdir()):
                dst.rmdir()
            else:
                shutil.rmtree(dst)  # only ever a cache entry: an explicit dst was checked to be empty
        os.replace(local, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dst


def _download(source: ModelSource, staging: Path, tracking_uri: str) -> Path:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    try:
        if source.kind == "run":
            path = source.uri.split("/", 2)[2]  # runs:/<id>/<path>
            local = mlflow.artifacts.download_artifacts(
                run_id=source.run_id, artifact_path=path, dst_path=str(staging), tracking_uri=tracking_uri
            )
        else:
            local = mlflow.artifacts.download_artifacts(
                artifact_uri=source.uri, dst_path=str(staging), tracking_uri=tracking_uri
            )
    except (MlflowException, OSError) as exc:
        raise ModelRefError(
            f"{source.ref}: downloading its files from {source.uri} failed: {exc}. Check that the artifact "
            "store is reachable from here (for a local store: that the artifact folder was not moved)"
        ) from None
    local_path = Path(local)
    if not local_path.is_dir():
        raise ModelRefError(f"{source.ref}: {source.uri} is a single file, not a model directory")
    return local_path


# ---------------------------------------------------------------------------------------------- listing


@dataclass
class VersionRow:
    """One registered model version as `trustbatch models` shows it."""

    name: str
    version: int
    aliases: list[str]
    tags: dict[str, str]
    run_id: str | None
    created: datetime
    source: str


def list_versions(name: str | None, tracking_uri: str) -> list[VersionRow]:
    """Every version of every registered model (or of ``name``), by name then newest version first."""
    client = _client(tracking_uri)
    models = {m.name: m for m in _all_registered_models(client)}
    if name is not None and name not in models:
        raise ModelRefError(
            f"no registered model named {name!r} in {tracking_uri}; registered models: "
            f"{sorted(models) or 'none yet (training registers its checkpoints)'}"
        )
    rows = []
    for model_name in sorted(models) if name is None else [name]:
        by_version: dict[str, list[str]] = {}
        for alias, version in (models[model_name].aliases or {}).items():
            by_version.setdefault(str(version), []).append(alias)
        versions = _all_versions(client, model_name)
        if versions:  # shown like an alias: models:/NAME@latest resolves to it
            by_version.setdefault(str(versions[-1].version), []).append(LATEST)
        for mv in reversed(versions):
            rows.append(
                VersionRow(
                    name=model_name,
                    version=int(mv.version),
                    aliases=sorted(by_version.get(str(mv.version), [])),
                    tags=dict(mv.tags or {}),
                    run_id=mv.run_id or (mv.tags or {}).get("run_id"),
                    created=datetime.fromtimestamp(mv.creation_timestamp / 1000),
                    source=mv.source,
                )
            )
    return rows


def _accuracy(text: str | None) -> str:
    if text is None:
        return "-"
    try:
        value = float(text)
    except ValueError:
        return text
    return f"{100 * value:.2f}%" if 0 <= value <= 1 else text


def versions_table(rows: list[VersionRow], tracking_uri: str):
    """A rich Table of ``rows`` (what `trustbatch models` prints)."""
    from rich.table import Table

    table = Table(title=f"Registered models in {tracking_uri}", title_justify="left")
    for column, justify in (
        ("model", "left"),
        ("version", "right"),
        ("aliases", "left"),
        ("step", "right"),
        ("policy version", "right"),
        ("eval accuracy", "right"),
        ("run id", "left"),
        ("created", "left"),
    ):
        table.add_column(column, justify=justify, no_wrap=column in ("run id", "model"))
    for row in rows:
        table.add_row(
            row.name,
            str(row.version),
            " ".join(f"@{a}" for a in row.aliases) or "-",
            row.tags.get("step", "-"),
            row.tags.get("policy_version", "-"),
            _accuracy(row.tags.get("eval_accuracy")),
            row.run_id or "-",
            row.created.strftime("%Y-%m-%d %H:%M"),
        )
    if rows:
        first = rows[0]
        has_best = any(row.name == first.name and "best" in row.aliases for row in rows)
        ref = f"models:/{first.name}@{'best' if has_best else LATEST}"
        table.caption = f"serve one: trustbatch serve {ref}   evaluate: trustbatch eval {ref} --k 8"
        table.caption_justify = "left"
    return table
