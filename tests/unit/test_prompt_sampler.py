"""The training prompt order (app/training/sampler.py) and rollout.skip_decided, the online filter."""

from __future__ import annotations

import pytest

from app.config import load_config
from app.training.sampler import PromptSampler


def test_epochs_are_seeded_permutations_and_resumable():
    a = PromptSampler(10, seed=3)
    first = a.take(4) + a.take(6)
    assert sorted(first) == list(range(10))
    second = a.take(10)
    assert sorted(second) == list(range(10)) and second != first
    resumed = PromptSampler(10, seed=3, cursor=4)
    assert resumed.take(16) == first[4:] + second


def test_off_by_default_nothing_is_skipped():
    s = PromptSampler(6, seed=0)
    for i in range(6):
        s.decided(i, True)
    assert sorted(s.take(6)) == list(range(6)) and s.skipped == 0


def test_decided_prompts_are_passed_over_their_next_draws():
    s = PromptSampler(8, seed=1, skip_decided=2)
    epoch0 = s.take(8)
    decided = set(epoch0[:3])  # all right / all wrong: passed over in the next two epochs
    for i in epoch0:
        s.decided(i, i in decided)
    epoch1 = s.take(5)
    assert set(epoch1) == set(range(8)) - decided and s.skipped == 3
    epoch2 = s.take(5)
    assert set(epoch2) == set(range(8)) - decided and s.skipped == 6
    assert set(s.take(8)) == set(range(8))  # after two passes each is drawn again
    # A mixed group clears the record at once.
    s.decided(epoch0[0], True)
    s.decided(epoch0[0], False)
    assert epoch0[0] in s.take(8)


def test_all_decided_still_yields_prompts():
    s = PromptSampler(4, seed=0, skip_decided=100)
    for i in range(4):
        s.decided(i, True)
    assert len(s.take(4)) == 4  # at most one epoch of passes per take


def test_config_validates_skip_decided():
    with pytest.raises(Exception, match=r"rollout\.skip_decided=-1 must be an integer >= 0"):
        load_config(None, ["rollout.skip_decided=-1"])
