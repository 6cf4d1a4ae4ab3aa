"""DriftWatch: truncation and length drifting while ESS stays near 1 warn once, in the log and in MLflow."""

from mlflow.tracking import MlflowClient

from app.tracking import Tracker, TrackingConfig
from app.training.signals import DriftWatch


def _step(truncated: float, length: float, ess: float = 0.999) -> dict[str, float]:
    return {"rollout/truncated_frac": truncated, "rollout/response_len/mean": length, "loss/ess": ess}


def test_a_steady_run_never_fires():
    watch = DriftWatch(window=3)
    for step in range(1, 40):
        assert watch.observe(step, _step(0.02 + 0.01 * (step % 2), 30 + step % 5)) == []
    assert watch.fired == {}


def test_truncation_that_climbs_while_ess_stays_near_one_fires_once():
    watch = DriftWatch(window=3)
    fired = []
    for step in range(1, 21):
        truncated = 0.0 if step <= 6 else min(1.0, 0.15 * (step - 6))
        fired += [(step, name, message) for name, message in watch.observe(step, _step(truncated, 40.0))]
    # Steps 7-9 average 0.30 against 0.0 early: the first window past the rise of 0.25.
    assert [(step, name) for step, name, _ in fired] == [(9, "truncation")]
    assert "rollout/truncated_frac moved from 0 " in fired[0][2] and "ESS is 0.999" in fired[0][2]
    assert watch.fired == {"truncation": 9}


def test_length_that_halves_fires_and_a_low_ess_holds_it_back():
    watch = DriftWatch(window=2)
    steps = [_step(0.0, 60.0)] * 4 + [_step(0.0, 25.0, ess=0.6)] * 3 + [_step(0.0, 25.0)] * 2
    fired = [(i, name) for i, metrics in enumerate(steps, 1) for name, _ in watch.observe(i, metrics)]
    # While ESS is 0.6 it is ESS's own business (steps 5-7); the first step back near 1 fires.
    assert fired == [(8, "length")]


def test_set_tag_records_the_message_on_the_run(tmp_path):
    tracker = Tracker(TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlflow.db'}"), tmp_path / "run", run_name="t")
    tracker.set_tag("trustbatch.signal.truncation", "step 9: moved " + "x" * 9000)
    run = MlflowClient(tracking_uri=tracker.tracking_uri).get_run(tracker.run_id)
    assert run.data.tags["trustbatch.signal.truncation"].startswith("step 9: moved xx")
    assert len(run.data.tags["trustbatch.signal.truncation"]) == 8000
