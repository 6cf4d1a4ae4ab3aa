"""Unit tests of trainer/advantages.py with hand-derived values."""

import math

import pytest
import torch

from trainer.advantages import AdvantageConfig, group_advantages


def test_mean_centred_per_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    advantages, stats = group_advantages(rewards)
    # means 0.5 and 0.75
    assert torch.allclose(advantages, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]))
    assert stats["advantage/zero_variance_groups"] == 0.0
    assert stats["advantage/zero_variance_frac"] == 0.0
    # mean |A| = (4·0.5 + 3·0.25 + 0.75) / 8 = 3.5 / 8
    assert stats["advantage/mean_abs"] == pytest.approx(3.5 / 8)


def test_scale_by_std_uses_the_sample_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    advantages, _ = group_advantages(rewards, scale_by_std=True, eps=0.0)
    # centred (0.5, −0.5, −0.5, 0.5); sample std = sqrt(4·0.25 / 3) = 1/sqrt(3)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5]]) * math.sqrt(3.0)
    assert torch.allclose(advantages, expected)


def test_scale_by_std_adds_eps():
    rewards = torch.tensor([[2.0, 0.0]])
    advantages, _ = group_advantages(rewards, scale_by_std=True, eps=0.5)
    # centred (1, −1); sample std = sqrt(2 / 1) = sqrt(2)
    assert torch.allclose(advantages, torch.tensor([[1.0, -1.0]]) / (math.sqrt(2.0) + 0.5))


@pytest.mark.parametrize("scale_by_std", [False, True])
def test_zero_variance_groups_get_exactly_zero(scale_by_std):
    # 0.1 three times: the float mean is not exactly 0.1, the advantage still is exactly 0.
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 0.2], [0.0, 0.0, 0.0]], dtype=torch.float64)
    advantages, stats = group_advantages(rewards, scale_by_std=scale_by_std)
    assert torch.count_nonzero(advantages[0]) == 0 and torch.count_nonzero(advantages[2]) == 0
    assert torch.count_nonzero(advantages[1]) == 3
    assert stats["advantage/zero_variance_groups"] == 2.0
    assert stats["advantage/zero_variance_frac"] == pytest.approx(2 / 3)
    assert advantages.dtype == torch.float64


def test_group_of_one_is_zero_variance():
    advantages, stats = group_advantages(torch.tensor([[3.0], [1.0]]), scale_by_std=True)
    assert torch.equal(advantages, torch.zeros(2, 1))
    assert stats["advantage/zero_variance_groups"] == 2.0


def test_integer_rewards_become_float():
    advantages, _ = group_advantages(torch.tensor([[1, 0]]))
    assert advantages.dtype == torch.float32
    assert advantages.tolist() == [[0.5, -0.5]]


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"\[num_groups, group_size\]"):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages(torch.tensor([[1.0, math.nan]]))


def test_advantage_config_default():
    assert AdvantageConfig().scale_by_std is False


def test_informative_groups_marks_groups_with_different_rewards():
    from trainer.advantages import informative_groups

    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.25]])
    assert informative_groups(rewards).tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match="num_groups"):
        informative_groups(torch.zeros(3))
