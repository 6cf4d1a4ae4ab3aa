"""app/training/lag.py: the lag bound under rollout.max_lag=auto moves as its rule says, and a fixed one never."""

import math

import pytest

from app.training.lag import PATIENCE, LagBound


def test_a_fixed_bound_never_moves():
    bound = LagBound(3)
    assert not bound.auto
    assert [bound.observe(e) for e in (0.1, 0.99, 0.99, 0.99, 0.99, 0.2)] == [3] * 6
    assert bound.changes == 0


def test_the_bound_rises_after_patience_steps_above_the_floor_and_stops_at_the_limit():
    bound = LagBound(None, min_ess=0.9, limit=2)
    assert bound.auto and bound.value == 0  # a new run starts synchronous
    seen = [bound.observe(0.95) for _ in range(3 * PATIENCE)]
    assert seen == [0] * (PATIENCE - 1) + [1] * PATIENCE + [2] * (PATIENCE + 1)  # never above limit 2
    assert bound.changes == 2


def test_a_step_below_the_floor_lowers_the_bound_at_once_and_restarts_the_count():
    bound = LagBound(None, min_ess=0.9, limit=8, start=3)
    assert bound.observe(0.89) == 2
    assert bound.observe(0.5) == 1
    # The count of good steps restarted: PATIENCE - 1 good steps are not enough, one bad step resets it.
    assert [bound.observe(0.95) for _ in range(PATIENCE - 1)] == [1] * (PATIENCE - 1)
    assert bound.observe(0.1) == 0
    assert bound.observe(0.1) == 0  # never below 0
    assert [bound.observe(0.95) for _ in range(PATIENCE)][-1] == 1
    assert bound.changes == 4


def test_the_floor_itself_counts_as_good_and_a_skipped_step_changes_nothing():
    bound = LagBound(None, min_ess=0.9, limit=8)
    for _ in range(PATIENCE - 1):
        bound.observe(0.9)
    assert bound.observe(math.nan) == 0  # a skipped step: neither good nor bad
    assert bound.observe(0.9) == 1


def test_a_resumed_bound_is_clamped_into_range():
    assert LagBound(None, limit=4, start=7).value == 4
    assert LagBound(None, limit=4, start=-2).value == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [({"fixed": -1}, "fixed lag"), ({"fixed": None, "min_ess": 0.0}, "min_ess"), ({"fixed": None, "limit": -1}, "limit")],
)
def test_bad_arguments_are_refused(kwargs, message):
    fixed = kwargs.pop("fixed")
    with pytest.raises(ValueError, match=message):
        LagBound(fixed, **kwargs)


def test_steps_measured_under_another_bound_are_read_for_what_they_measured():
    bound = LagBound(None, min_ess=0.9, limit=8, start=3)
    # A bad step at bound 3 drops it to 2; the bad steps still in flight from bound 3 do not drop it again.
    assert bound.observe(0.5, issued_under=3) == 2
    assert [bound.observe(0.5, issued_under=3) for _ in range(3)] == [2, 2, 2]
    # A bad step measured at the current bound (or below it) does.
    assert bound.observe(0.5, issued_under=2) == 1
    # After a raise, good steps from the old bound do not count toward the next raise...
    for _ in range(PATIENCE):
        bound.observe(0.95, issued_under=1)
    assert bound.value == 2
    assert [bound.observe(0.95, issued_under=1) for _ in range(2 * PATIENCE)] == [2] * (2 * PATIENCE)
    # ...only steps measured at the new bound do, and a bad old-bound step still lowers it.
    assert [bound.observe(0.95, issued_under=2) for _ in range(PATIENCE)][-1] == 3
    assert bound.observe(0.5, issued_under=2) == 2
