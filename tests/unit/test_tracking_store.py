"""A store whose SQLite file was removed and made again at the same path, in the same process (a notebook, a
test suite reusing a directory): MLflow's per-URI caches would write to the deleted file; `mlflow_client` drops
them (app/tracking.py)."""

import shutil

from app.tracking import ensure_experiment, mlflow_client


def test_a_store_removed_and_made_again_at_the_same_path_takes_new_runs(tmp_path):
    root = tmp_path / "runs"
    uri = f"sqlite:///{root / 'mlflow.db'}"
    for attempt in range(3):
        root.mkdir()
        client = mlflow_client(uri)
        run = client.create_run(ensure_experiment(client, "exp", uri))
        client.log_metric(run.info.run_id, "x", float(attempt))
        assert [r.info.run_id for r in client.search_runs([ensure_experiment(client, "exp", uri)])] == [run.info.run_id]
        shutil.rmtree(root)
