"""The reward runner: routing, weights, metrics, and failure isolation in-process and in the process pool."""


import pytest

from rewards import RewardsConfig, VerifierInput, VerifierSpec
from rewards.runner import RewardRunner

HOSTILE = "tests.fixtures.plugins.hostile_verifiers:make_hostile"
WORDS = "tests.fixtures.plugins.my_verifier:make_verifier"


def sample(completion, reference=None, task=None):
    return VerifierInput("prompt", completion, reference, {"task": task} if task else {})


def mixed_config(**kw):
    return RewardsConfig(
        verifiers=[
            VerifierSpec(name="math", tasks=["math"], params={"timeout_s": 2.0}),
            VerifierSpec(name="format", weight=0.5, tasks=["math"], params={"pattern": r"\\boxed"}),
            VerifierSpec(name=WORDS, tasks=["length"], params={"target": 2}, label="words"),
        ],
        **kw,
    )


# ---------------------------------------------------------------- in-process (num_workers=0)


@pytest.fixture(scope="module")
def local():
    with RewardRunner(mixed_config(num_workers=0)) as runner:
        yield runner


def test_routes_by_task_with_weighted_sum_and_breakdown(local):
    scores, metrics = local.score(
        [sample("\\boxed{4}", "4", "math"), sample("4", "4", "math"), sample("two words", None, "length")]
    )
    assert [s.reward for s in scores] == [1.5, 1.0, 1.0]
    assert scores[0].breakdown["math"]["extracted"] == "4" and scores[0].breakdown["format"]["reward"] == 1.0
    assert set(scores[2].breakdown) == {"words"}
    assert scores[1].correct is True  # the task's first verifier (math) decides, not format
    assert metrics["reward/mean"] == pytest.approx(3.5 / 3)
    assert metrics["reward/math/mean"] == 1.0 and metrics["reward/format/mean"] == 0.5
    assert metrics["reward/math/correct"] == 1.0 and metrics["reward/words/correct"] == 1.0
    assert metrics["reward/error_rate"] == 0.0 and metrics["reward/timeout_rate"] == 0.0


def test_explicit_tasks_override_metadata(local):
    scores, _ = local.score([sample("two words", None, "math")], tasks=["length"])
    assert scores[0].reward == 1.0 and "words" in scores[0].breakdown


def test_unknown_or_missing_task_is_a_clear_error(local):
    with pytest.raises(ValueError, match=r"task 'poetry'.*score tasks \['math', 'length'\]"):
        local.score([sample("x", None, "poetry")])
    with pytest.raises(ValueError, match="has no task"):
        local.score([sample("x")])
    with pytest.raises(ValueError, match="2 inputs but 1 tasks"):
        local.score([sample("x"), sample("y")], tasks=["math"])


def test_single_task_config_needs_no_task():
    with RewardRunner(RewardsConfig(num_workers=0)) as runner:
        scores, _ = runner.score([sample("\\boxed{2}", "2")])
    assert scores[0].correct is True


def test_in_process_failures_become_error_scores():
    cfg = RewardsConfig(
        verifiers=[VerifierSpec(name=HOSTILE, tasks=["t"])], num_workers=0, timeout_s=0.2, error_reward=-1.0
    )
    with RewardRunner(cfg) as runner:
        scores, metrics = runner.score([sample(a) for a in ["ok", "raise", "sleep", "nan", "not-a-score"]])
    assert [s.reward for s in scores] == [1.0, -1.0, -1.0, -1.0, -1.0]
    assert scores[0].error is None
    assert "RuntimeError: verifier bug" in scores[1].error
    assert "timeout" in scores[2].error
    assert "non-finite" in scores[3].error and "not a Score" in scores[4].error
    assert metrics["reward/error_rate"] == pytest.approx(0.8) and metrics[
        "reward/timeout_rate"
    ] == pytest.approx(0.2)


def test_bad_params_fail_at_start_up_naming_the_verifier():
    cfg = RewardsConfig(verifiers=[VerifierSpec(name="math", params={"extraction": ["nope"]})], num_workers=0)
    with pytest.raises(ValueError, match=r"rewards\.verifiers\[0\] \('math'\): bad params"):
        RewardRunner(cfg)


# ---------------------------------------------------------------- process pool


@pytest.fixture(scope="module")
def hostile_pool():
    cfg = RewardsConfig(
        verifiers=[VerifierSpec(name=HOSTILE, tasks=["t"])], num_workers=2, timeout_s=0.5, kill_grace_s=0.3
    )
    with RewardRunner(cfg) as runner:
        yield runner


def test_pool_keeps_order_and_isolates_exceptions_and_python_hangs(hostile_pool):
    actions = ["ok", "raise", "ok", "sleep", "ok", "nan"] * 3
    scores, metrics = hostile_pool.score([sample(a) for a in actions])
    for action, score in zip(actions, scores, strict=True):
        assert (score.error is None) == (action == "ok"), (action, score)
    assert all("timeout" in s.error for a, s in zip(actions, scores, strict=True) if a == "sleep")
    assert metrics["reward/timeout_rate"] == pytest.approx(3 / 18)
    assert metrics["reward/worker_restarts"] == 0.0  # the in-worker alarm handled the sleeps


def test_pool_kills_and_replaces_a_worker_the_alarm_cannot_stop(hostile_pool):
    hostile_pool.score([sample("ok")] * 4)  # workers are up
    pids = set(hostile_pool.worker_pids())
    scores, metrics = hostile_pool.score([sample(a) for a in ["ok", "block", "ok", "ok", "ok", "ok"]])
    assert scores[1].error.startswith("make_hostile: timeout") and "worker was killed" in scores[1].error
    assert all(s.error is None and s.reward == 1.0 for i, s in enumerate(scores) if i != 1)
    assert metrics["reward/worker_restarts"] == 1.0 and metrics["reward/timeout_rate"] == pytest.approx(1 / 6)
    assert len(pids & set(hostile_pool.worker_pids())) == 1


def test_pool_replaces_a_crashed_worker(hostile_pool):
    scores, metrics = hostile_pool.score([sample(a) for a in ["ok", "ok", "exit", "ok", "ok", "ok"]])
    assert "worker process died (exit code 7)" in scores[2].error
    assert all(s.error is None for i, s in enumerate(scores) if i != 2)
    assert metrics["reward/worker_restarts"] == 1.0 and metrics["reward/error_rate"] == pytest.approx(1 / 6)
    scores, _ = hostile_pool.score([sample("ok")] * 8)  # and the pool still works
    assert all(s.reward == 1.0 for s in scores)


def test_math_in_the_pool_matches_in_process_and_hangs_are_contained():
    batch = [sample(f"\\boxed{{{k % 7}}}", str(k % 5), "math") for k in range(64)]
    batch.append(sample("\\boxed{9^{9^{9^{9}}}}", "5", "math"))
    pooled = mixed_config(num_workers=1, timeout_s=0.5)
    # The math verifier's own limit (30 s) is longer than the runner's (0.5 s): the runner's limit wins.
    pooled.verifiers[0].params = {"timeout_s": 30.0}
    with RewardRunner(pooled) as pool, RewardRunner(mixed_config(num_workers=0)) as local:
        got, metrics = pool.score(batch)
        want, local_metrics = local.score(batch[:-1])
    assert local_metrics["reward/timeout_rate"] == 0.0
    assert [s.reward for s in got[:-1]] == [s.reward for s in want]
    assert got[-1].error.startswith("math: timeout") and got[-1].reward == 0.0
    assert metrics["reward/timeout_rate"] == pytest.approx(1 / 65)


def test_close_stops_the_workers():
    runner = RewardRunner(RewardsConfig(verifiers=[VerifierSpec(name=HOSTILE, tasks=["t"])], num_workers=1))
    runner.score([sample("ok")])
    processes = [w.process for w in runner._workers]
    runner.close()
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(RuntimeError, match="after close"):
        runner.score([sample("ok")])


def test_unpicklable_factory_fails_at_start_up_with_the_fix():
    from rewards import register
    from rewards.registry import REGISTRY

    def local_factory():
        return lambda s: None

    register("test_local_factory")(local_factory)
    try:
        cfg = RewardsConfig(verifiers=[VerifierSpec(name="test_local_factory", tasks=["t"])], num_workers=1)
        with pytest.raises(ValueError, match="module level in an importable module"):
            RewardRunner(cfg)
    finally:
        REGISTRY.pop("test_local_factory")
