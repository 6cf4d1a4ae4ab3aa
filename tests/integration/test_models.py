"""Model references against a real MLflow registry (SQLite in a temp dir) and `trustbatch models`.

Covered: every reference form resolves to a loadable HF directory without writing into the store's artifact
folder; each unknown name, alias, version, run or artifact says what exists; the cache is reused for a
registered version; the version listing (tags, aliases) and the CLI table. Not covered: a remote tracking
server (the same client calls; nothing here can reach one).
"""

from __future__ import annotations

import pytest

import app.models
from app.models import ModelRefError, fetch, list_versions, lookup, resolve_model
from trainer.model import load_model

from .model_refs import CHECKPOINTS, make_registry, snapshot, trustbatch


@pytest.fixture(scope="module")
def registry(tmp_path_factory, tiny_model_dir):
    return make_registry(tmp_path_factory.getbasetemp() / "registry", tiny_model_dir)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _same_weights(a, b) -> bool:
    model_a, _ = load_model(str(a))
    model_b, _ = load_model(str(b))
    state_b = model_b.state_dict()
    return all((value == state_b[key]).all() for key, value in model_a.state_dict().items())


@pytest.mark.parametrize(
    "form",
    [
        "models:/{name}@best",
        "models:/{name}@latest",
        "models:/{name}/1",
        "models:/{name}/latest",
        "runs:/{run_id}/checkpoints/step-000002",
    ],
)
def test_each_reference_form_resolves_to_a_loadable_copy(registry, tiny_model_dir, tmp_path, form):
    ref = form.format(name=registry.name, run_id=registry.run_id)
    before = snapshot(registry.artifact_root)
    path = resolve_model(ref, tracking_uri=registry.uri, dst=tmp_path / "model")
    assert path == tmp_path / "model"
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in tiny_model_dir.iterdir())
    assert _same_weights(path, tiny_model_dir)
    assert snapshot(registry.artifact_root) == before  # the store's own files were never touched


def test_best_is_the_alias_and_latest_the_newest_version(registry):
    best = lookup(f"models:/{registry.name}@best", tracking_uri=registry.uri)
    latest = lookup(f"models:/{registry.name}@latest", tracking_uri=registry.uri)
    assert (best.version, latest.version) == (registry.versions["best"], registry.versions["latest"])
    assert best.run_id == registry.run_id and best.tags["step"] == str(CHECKPOINTS[0][0])
    assert best.uri.endswith("checkpoints/step-000001") and latest.uri.endswith("checkpoints/step-000002")


def test_a_local_directory_is_used_in_place(tiny_model_dir):
    assert resolve_model(str(tiny_model_dir), tracking_uri="sqlite:////nonexistent/mlflow.db", dst=None) == (
        tiny_model_dir.resolve()
    )


def test_a_registered_version_is_cached_and_reused(registry, cache):
    ref = f"models:/{registry.name}/{registry.versions['best']}"
    first = resolve_model(ref, tracking_uri=registry.uri, dst=None)
    assert cache in first.parents
    marker = first / "config.json"
    stamp = marker.stat().st_mtime_ns
    assert resolve_model(ref, tracking_uri=registry.uri, dst=None) == first
    assert marker.stat().st_mtime_ns == stamp  # not downloaded again
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_a_version_cached_by_another_process_meanwhile_is_kept(registry, cache, monkeypatch):
    # Two commands fetch the same version at once; the first to finish may already be loading its copy, so the
    # second keeps that copy instead of deleting it and moving its own in.
    source = lookup(f"models:/{registry.name}/{registry.versions['latest']}", tracking_uri=registry.uri)
    download, inodes = app.models._download, []

    def racing(source, staging, tracking_uri):
        local = download(source, staging, tracking_uri)
        if not inodes:  # while this download finishes, another process completes the same version
            inodes.append(None)
            other = fetch(source, tracking_uri=tracking_uri)
            inodes[0] = (other / "config.json").stat().st_ino
        return local

    monkeypatch.setattr(app.models, "_download", racing)
    path = fetch(source, tracking_uri=registry.uri)
    assert (path / "config.json").stat().st_ino == inodes[0]  # the other process's file, never replaced
    assert (path / app.models.COMPLETE_MARKER).is_file()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


@pytest.mark.parametrize(
    ("form", "fragments"),
    [
        ("models:/nope@best", ["no registered model named 'nope'", "{name}"]),
        ("models:/{name}@worst", ["no alias 'worst'", "@best -> version 1", "@latest (the newest version)"]),
        ("models:/{name}/9", ["no version 9", "[1, 2]"]),
        ("models:/{name}/first", ["is not a number"]),
        ("models:/{name}", ["malformed", "models:/NAME@ALIAS"]),
        ("runs:/0123456789abcdef0123456789abcdef/x", ["no run with id"]),
        (
            "runs:/{run_id}/checkpoints/step-000009",
            ["no artifact", "checkpoints/step-000001", "checkpoints/step-000002"],
        ),
        ("runs:/{run_id}", ["malformed"]),
        ("no/such/dir", ["neither an existing directory nor a model reference"]),
        ("", ["empty model reference"]),
    ],
)
def test_unresolvable_references_say_what_exists(registry, tmp_path, form, fragments):
    ref = form.format(name=registry.name, run_id=registry.run_id)
    with pytest.raises(ModelRefError) as err:
        resolve_model(ref, tracking_uri=registry.uri, dst=tmp_path / "model")
    for fragment in fragments:
        assert fragment.format(name=registry.name) in str(err.value)
    assert not (tmp_path / "model").exists()


def test_a_directory_that_is_not_a_model_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelRefError, match="not a Hugging Face model directory.*config.json.*notes.txt"):
        resolve_model(str(tmp_path), tracking_uri="sqlite:////nonexistent/mlflow.db", dst=None)


def test_a_missing_store_is_not_created(tmp_path):
    db = tmp_path / "nowhere" / "mlflow.db"
    with pytest.raises(ModelRefError, match="no MLflow store at"):
        resolve_model("models:/x@best", tracking_uri=f"sqlite:///{db}", dst=None)
    assert not db.exists()


def test_a_non_empty_destination_is_refused(registry, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep.txt").write_text("mine")
    with pytest.raises(ModelRefError, match="not empty"):
        resolve_model(f"models:/{registry.name}@best", tracking_uri=registry.uri, dst=tmp_path / "model")
    assert (tmp_path / "model" / "keep.txt").read_text() == "mine"


def test_list_versions_shows_tags_and_aliases(registry):
    rows = list_versions(None, registry.uri)
    assert [(r.name, r.version) for r in rows] == [(registry.name, 2), (registry.name, 1)]  # newest first
    by_version = {str(r.version): r for r in rows}
    assert by_version[registry.versions["best"]].aliases == ["best"]
    assert by_version[registry.versions["latest"]].aliases == ["latest"]
    for (step, accuracy), version in zip(CHECKPOINTS, ("1", "2"), strict=True):
        row = by_version[version]
        assert row.tags["step"] == str(step) and float(row.tags["eval_accuracy"]) == accuracy
        assert row.run_id == registry.run_id
    with pytest.raises(ModelRefError, match=f"registered models: \\['{registry.name}'\\]"):
        list_versions("nope", registry.uri)


def test_models_command_prints_the_table(registry):
    out = trustbatch("models", "--tracking-uri", registry.uri)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if registry.name in line and "│" in line]
    assert len(lines) == len(CHECKPOINTS)
    assert "@best" in out.stdout and "@latest" in out.stdout and registry.run_id in out.stdout
    assert "50.00%" in out.stdout and "25.00%" in out.stdout  # eval_accuracy tags 0.5 and 0.25
    print(out.stdout)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["models", "nope"], "no registered model named 'nope'"),
        (["models", "--tracking-uri", "sqlite:////nonexistent/dir/mlflow.db"], "no MLflow store at"),
    ],
)
def test_models_command_bad_input_exits_2(registry, args, fragment):
    if "--tracking-uri" not in args:
        args = [*args, "--tracking-uri", registry.uri]
    out = trustbatch(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert fragment in out.stderr and "Traceback" not in out.stderr + out.stdout
