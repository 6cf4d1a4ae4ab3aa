"""Trajectory: parallel per-token arrays grown only by `append`; what the trainer and the verifier get from it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.rollout.base import Completion
from app.rollout.trajectory import STATUSES, Trajectory, completion_text, trajectory_metrics
from app.training.batching import build_train_batch

# One step of an episode: the model's tokens (with logprobs and the version that sampled them) or a tool's.
model_piece = st.tuples(
    st.just(True),
    st.lists(st.integers(0, 500), min_size=0, max_size=12),
    st.integers(0, 6),  # policy version: a trajectory may span weight updates
)
tool_piece = st.tuples(st.just(False), st.lists(st.integers(0, 500), min_size=0, max_size=12), st.just(-1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(model_piece, tool_piece), min_size=1, max_size=12))
def test_every_array_grows_with_the_ids_whatever_the_appends(pieces):
    trajectory = Trajectory([1, 2, 3])
    expected_ids, expected_mask, turn = [], [], 0
    for sampled, ids, version in pieces:
        logprobs = [-0.5 - 0.01 * i for i in range(len(ids))] if sampled else None
        trajectory.append(ids, sampled=sampled, turn=turn, version=version, logprobs=logprobs)
        expected_ids += ids
        expected_mask += [sampled] * len(ids)
        if not sampled:
            turn += 1  # the next model turn follows a tool's output
        n = len(trajectory)
        assert n == len(trajectory.loss_mask) == len(trajectory.logprobs) == len(trajectory.versions) == len(trajectory.turns)
    assert trajectory.ids == expected_ids and trajectory.loss_mask == expected_mask
    assert all(v == -1 for v, m in zip(trajectory.versions, trajectory.loss_mask, strict=True) if not m)
    assert all(lp == 0.0 for lp, m in zip(trajectory.logprobs, trajectory.loss_mask, strict=True) if not m)
    assert trajectory.turns == sorted(trajectory.turns)  # turns never go back
    sampled_versions = [v for v, m in zip(trajectory.versions, trajectory.loss_mask, strict=True) if m]
    assert trajectory.oldest_version(99) == (min(sampled_versions) if sampled_versions else 99)
    trajectory.status = "answered"
    completion = trajectory.to_completion()
    assert len(completion.output_ids) == len(completion.output_logprobs) == len(completion.output_mask)
    assert len(completion.output_versions) == len(completion.output_turns) == len(completion.output_ids)
    # The segments put every token back in order, each run of one origin.
    assert [t for ids, _ in trajectory.segments() for t in ids] == expected_ids


def test_a_trajectory_spanning_a_weight_update_keeps_each_tokens_version_and_counts_the_oldest():
    trajectory = Trajectory([7])
    trajectory.append([10, 11], sampled=True, turn=0, version=4, logprobs=[-0.1, -0.2])
    trajectory.append([12, 13, 14], sampled=False, turn=0)
    trajectory.append([15], sampled=True, turn=1, version=5, logprobs=[-0.3])  # after the update to version 5
    trajectory.status = "answered"
    completion = trajectory.to_completion()
    assert completion.output_versions == [4, 4, -1, -1, -1, 5]
    assert completion.policy_version == 4  # the lag bound counts the oldest token
    assert completion.output_turns == [0, 0, 0, 0, 0, 1]
    batch = build_train_batch([completion], [1.0], pad_id=0, temperature=1.0)
    assert batch.loss_mask[0].tolist() == [False, True, True, False, False, False, True]
    assert batch.old_logprobs[0, 1:3].tolist() == pytest.approx([-0.1, -0.2]) and batch.old_logprobs[0, 6] == pytest.approx(-0.3)
    assert batch.turns[0].tolist() == [-1, 0, 0, 0, 0, 0, 1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sampled=True, turn=0, version=1), "need as many logprobs"),
        (dict(sampled=True, turn=0, version=1, logprobs=[-1.0]), "need as many logprobs"),
        (dict(sampled=True, turn=0, version=-1, logprobs=[-1.0, -1.0]), "policy version"),
        (dict(sampled=False, turn=0, logprobs=[-1.0, -1.0]), "no behaviour logprobs"),
        (dict(sampled=False, turn=-1), "goes back"),
    ],
)
def test_append_refuses_inconsistent_pieces(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Trajectory([1]).append([5, 6], **kwargs)
    trajectory = Trajectory([1])
    trajectory.append([5], sampled=False, turn=2)
    with pytest.raises(ValueError, match="goes back"):
        trajectory.append([6], sampled=False, turn=1)
    assert len(trajectory) == 1  # a refused append adds nothing


def test_the_verifier_reads_the_models_text_and_never_the_tools():
    """A tool's output can print a boxed answer; only what the model wrote counts."""
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731 - a codepoint tokenizer
    trajectory = Trajectory([1])
    trajectory.append([ord(c) for c in "code"], sampled=True, turn=0, version=0, logprobs=[-1.0] * 4)
    trajectory.append([ord(c) for c in "\\boxed{7}"], sampled=False, turn=0)
    trajectory.append([ord(c) for c in "done"], sampled=True, turn=1, version=0, logprobs=[-1.0] * 4)
    trajectory.status = "answered"
    assert completion_text(trajectory.to_completion(), decode) == "codedone"
    # A trajectory left out of training (drop_void_turns) is still read the same way.
    assert completion_text(trajectory.to_completion(train=False), decode) == "codedone"
    plain = Completion([1], [ord("x")], [-1.0], "stop", 0)
    assert completion_text(plain, decode) == "x"


def test_trajectory_metrics_count_statuses_calls_and_void_turns():
    completions = []
    for status, calls, void in [("answered", ["ok"], 0), ("max_turns", ["ok", "error"], 0), ("budget", [], 1)]:
        t = Trajectory([1])
        t.append([5], sampled=True, turn=0, version=0, logprobs=[-1.0])
        t.status, t.void_turns, t.wall_s, t.tool_wait_s, t.requests = status, void, 2.0, 1.0, 3
        t.tool_calls = [{"turn": 0, "tool": "python", "status": s, "tokens": 3, "cut": False} for s in calls]
        completions.append(t.to_completion(train=not void))
    metrics = trajectory_metrics([*completions, Completion([1], [2], [-1.0], "stop", 0)])
    assert set(f"rollout/status/{s}" for s in STATUSES) <= set(metrics)
    assert metrics["rollout/status/answered"] == metrics["rollout/status/max_turns"] == pytest.approx(1 / 3)
    assert metrics["tools/calls_per_trajectory"] == 1.0 and metrics["tools/error_rate"] == pytest.approx(1 / 3)
    assert metrics["rollout/void_turn_rate"] == pytest.approx(1 / 3) == metrics["rollout/dropped_void_frac"]
    assert metrics["tools/wait_frac"] == 0.5 and metrics["rollout/requests_per_trajectory"] == 3
    assert trajectory_metrics([Completion([1], [2], [-1.0], "stop", 0)]) == {}
    assert all(math.isfinite(v) for v in metrics.values())
