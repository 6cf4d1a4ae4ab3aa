"""Unit tests of trainer/objective.py: hand-derived values, gradient flow, padding, ESS edge cases, config.

The shared 1x3 example (values derived by hand in `_example`):
    ℓ − b = (ln 2, 0, −ln 2)  →  r = (2, 1, 0.5),  A = (1, −2, 3),  ℓ = (−1, −2, −3)
    Σr = 3.5, Σr² = 4 + 1 + 0.25 = 5.25, n = 3  →  ESS = 3.5² / (3 · 5.25) = 12.25 / 15.75 = 7/9
    k3 kl = (ℓ−b) + exp(b−ℓ) − 1 = (ln2 − 0.5, 0, 1 − ln2), Σ kl = 0.5
"""

import math

import pytest
import torch

from trainer.objective import (
    LOSSES,
    ObjectiveConfig,
    ess_from_sums,
    ess_partial_sums,
    ess_per_sequence,
    importance_ratio,
    policy_objective,
    register_loss,
    valid_token_mask,
)

LN2 = math.log(2.0)


def _example(requires_grad=True):
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=requires_grad)
    old_logprobs = torch.tensor([[-1.0 - LN2, -2.0, -3.0 + LN2]])
    advantages = torch.tensor([[1.0, -2.0, 3.0]])
    loss_mask = torch.ones(1, 3, dtype=torch.bool)
    return logprobs, old_logprobs, advantages, loss_mask


def _grad(loss, logprobs):
    (grad,) = torch.autograd.grad(loss, logprobs)
    return grad


# ---------------------------------------------------------------------------------------------- ESS sums


def test_ess_partial_sums_hand_values():
    ratio = torch.tensor([[2.0, 1.0, 0.5], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True], [False, False, False]])
    sums = ess_partial_sums(ratio, mask)
    assert sums.dtype == torch.float64 and sums.shape == (3,)
    assert sums.tolist() == [3.5, 5.25, 3.0]
    assert ess_from_sums(sums) == pytest.approx(7 / 9)


def test_importance_ratio_hand_values():
    logprobs = torch.tensor([[0.0, LN2, 0.0, 5.0]])
    old = torch.tensor([[LN2, 0.0, -100.0, math.nan]])
    mask = torch.tensor([[True, True, True, False]])
    ratio = importance_ratio(logprobs, old, mask, max_log_ratio=20.0)
    # (0.5, 2, e^20 after the clamp of 100, 1 on the padded NaN)
    expected = torch.tensor([[0.5, 2.0, math.exp(20.0), 1.0]])
    assert ratio.dtype == torch.float32 and torch.allclose(ratio, expected, rtol=1e-6)


def test_ess_partial_sums_are_detached():
    ratio = torch.tensor([[2.0, 1.0]], requires_grad=True)
    assert not ess_partial_sums(ratio, torch.ones(1, 2, dtype=torch.bool)).requires_grad


def test_ess_uniform_ratios_is_one():
    sums = ess_partial_sums(torch.full((2, 4), 1.7), torch.ones(2, 4, dtype=torch.bool))
    assert ess_from_sums(sums) == 1.0


def test_ess_one_dominant_ratio_is_about_one_over_n():
    # r = (1e6, 1e-6, 1e-6, 1e-6): (Σr)² / (4 Σr²) = 1/4 up to ~1e-12.
    ratio = torch.tensor([[1e6, 1e-6, 1e-6, 1e-6]])
    ess = ess_from_sums(ess_partial_sums(ratio, torch.ones(1, 4, dtype=torch.bool)))
    assert ess == pytest.approx(0.25, rel=1e-6)


@pytest.mark.parametrize(
    "sums",
    [
        torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64),  # no valid tokens
        torch.tensor([math.inf, 1.0, 3.0], dtype=torch.float64),
        torch.tensor([1.0, math.nan, 3.0], dtype=torch.float64),
        torch.tensor([0.0, 0.0, 3.0], dtype=torch.float64),  # Σr² == 0
    ],
    ids=["n=0", "inf", "nan", "zero-square-sum"],
)
def test_ess_degenerate_sums_give_one(sums):
    assert ess_from_sums(sums) == 1.0


def test_ess_no_valid_tokens_is_one():
    sums = ess_partial_sums(torch.tensor([[5.0, 0.1]]), torch.zeros(1, 2, dtype=torch.bool))
    assert sums.tolist() == [0.0, 0.0, 0.0]
    assert ess_from_sums(sums) == 1.0


def test_ess_split_partial_sums_equal_whole_batch():
    ratio = torch.tensor([[2.0, 1.0, 0.5, 3.0], [0.25, 4.0, 1.5, 7.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, True]])
    whole = ess_partial_sums(ratio, mask)
    rows = ess_partial_sums(ratio[:1], mask[:1]) + ess_partial_sums(ratio[1:], mask[1:])
    cols = ess_partial_sums(ratio[:, :2], mask[:, :2]) + ess_partial_sums(ratio[:, 2:], mask[:, 2:])
    assert torch.equal(rows, whole) and torch.equal(cols, whole)
    assert ess_from_sums(rows) == ess_from_sums(whole)
    # Hand value: r = (2, 1, 0.5, 0.25, 4, 7): Σr = 14.75, Σr² = 4+1+0.25+0.0625+16+49 = 70.3125, n = 6.
    assert ess_from_sums(whole) == pytest.approx(14.75**2 / (6 * 70.3125))


# ------------------------------------------------------------------------------------- closed-form values


def test_ess_objective_hand_values():
    logprobs, old, adv, mask = _example()
    loss, metrics = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(), num_tokens=3)
    # ρ = clamp(r, 0, 7/9) = (7/9, 7/9, 0.5); −ρ·ℓ·A = (7/9, −28/9, 4.5), sum 13/6.
    # (1 − ESS)·Σkl = (2/9)·0.5 = 1/9.  loss = (13/6 + 1/9) / 3 = 41/54.
    assert loss.item() == pytest.approx(41 / 54, abs=1e-6)
    assert metrics["loss/total"].item() == pytest.approx(41 / 54, abs=1e-6)
    assert metrics["loss/policy"].item() == pytest.approx(13 / 18, abs=1e-6)
    assert metrics["loss/kl_behaviour"].item() == pytest.approx(1 / 6, abs=1e-6)
    assert metrics["loss/ess"].item() == pytest.approx(7 / 9, abs=1e-6)
    assert metrics["loss/clipfrac"].item() == pytest.approx(2 / 3)  # r = 2 and r = 1 exceed 7/9
    assert metrics["loss/ratio/mean"].item() == pytest.approx(3.5 / 3, abs=1e-6)
    assert metrics["loss/ratio/max"].item() == pytest.approx(2.0, abs=1e-6)
    assert "loss/entropy" not in metrics and "loss/ref_kl" not in metrics
    assert all(v.ndim == 0 and not v.requires_grad for v in metrics.values())


def test_ess_objective_uses_the_passed_ess_and_global_num_tokens():
    logprobs, old, adv, mask = _example()
    loss, metrics = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(), num_tokens=6, ess=0.5)
    # ρ = (0.5, 0.5, 0.5); −ρ·ℓ·A = (0.5, −2, 4.5), sum 3; (1 − 0.5)·0.5 = 0.25; loss = 3.25 / 6.
    assert loss.item() == pytest.approx(3.25 / 6, abs=1e-6)
    assert metrics["loss/ess"].item() == 0.5
    assert metrics["loss/clipfrac"].item() == pytest.approx(2 / 6)


def test_ppo_clip_hand_values():
    logprobs, old, adv, mask = _example()
    cfg = ObjectiveConfig(name="ppo_clip", clip_low=0.2, clip_high=0.28)
    loss, metrics = policy_objective(logprobs, old, adv, mask, cfg, num_tokens=3)
    # token 1: min(2·1, 1.28·1) = 1.28 (clipped, active)  → −1.28
    # token 2: min(1·−2, 1·−2) = −2                       →  2
    # token 3: min(0.5·3, 0.8·3) = 1.5 (unclipped wins)   → −1.5
    assert loss.item() == pytest.approx((-1.28 + 2 - 1.5) / 3, abs=1e-6)
    assert metrics["loss/clipfrac"].item() == pytest.approx(1 / 3)
    # d/dℓ of −r·A is −r·A on unclipped tokens, 0 on the clipped one: (0, 2, −1.5) / 3.
    assert torch.allclose(_grad(loss, logprobs), torch.tensor([[0.0, 2 / 3, -0.5]]), atol=1e-6)


def test_ppo_clip_negative_advantage_clipped_low():
    # r = 0.5 < 1 − 0.2 with A = −1: min(−0.5, −0.8) = −0.8 (clipped, active) → loss 0.8, no gradient.
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    old = torch.tensor([[-1.0 + LN2]])
    cfg = ObjectiveConfig(name="ppo_clip")
    loss, metrics = policy_objective(
        logprobs, old, torch.tensor([[-1.0]]), torch.ones(1, 1, dtype=torch.bool), cfg, num_tokens=1
    )
    assert loss.item() == pytest.approx(0.8, abs=1e-6)
    assert metrics["loss/clipfrac"].item() == 1.0
    assert _grad(loss, logprobs).item() == 0.0


def test_reinforce_hand_values():
    logprobs, old, adv, mask = _example()
    loss, metrics = policy_objective(
        logprobs, old, adv, mask, ObjectiveConfig(name="reinforce"), num_tokens=3
    )
    # −Σ ℓ·A = −(−1 + 4 − 9) = 6 → 2; gradient −A / N, whatever the ratios.
    assert loss.item() == pytest.approx(2.0)
    assert metrics["loss/clipfrac"].item() == 0.0
    assert torch.allclose(_grad(loss, logprobs), torch.tensor([[-1 / 3, 2 / 3, -1.0]]))


def test_entropy_bonus_and_ref_kl_penalty():
    logprobs, old, adv, mask = _example()
    entropy = torch.tensor([[0.5, 1.0, 1.5]])
    ref = torch.tensor([[-1.0, -2.0 - LN2, -3.0]])  # k3 kl_ref = (0, ln2 − 0.5, 0)
    cfg = ObjectiveConfig(name="reinforce", entropy_coef=0.1, ref_kl_coef=0.5)
    loss, metrics = policy_objective(
        logprobs, old, adv, mask, cfg, num_tokens=3, ref_logprobs=ref, entropy=entropy
    )
    # [6 − 0.1·3 + 0.5·(ln2 − 0.5)] / 3
    assert loss.item() == pytest.approx((6 - 0.3 + 0.5 * (LN2 - 0.5)) / 3, abs=1e-6)
    assert metrics["loss/entropy"].item() == pytest.approx(1.0)
    assert metrics["loss/ref_kl"].item() == pytest.approx((LN2 - 0.5) / 3, abs=1e-6)
    # The ref-KL gradient is β·(1 − exp(ref − ℓ)) = 0.5·(1 − 0.5) on token 2, on top of −A.
    expected = torch.tensor([[-1.0, 2.0 + 0.25, -3.0]]) / 3
    assert torch.allclose(_grad(loss, logprobs), expected, atol=1e-6)


def test_entropy_metric_without_coefficient_leaves_loss_unchanged():
    logprobs, old, adv, mask = _example()
    loss, metrics = policy_objective(
        logprobs, old, adv, mask, ObjectiveConfig(name="reinforce"), num_tokens=3, entropy=torch.ones(1, 3)
    )
    assert loss.item() == pytest.approx(2.0)
    assert metrics["loss/entropy"].item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("cfg", "missing"),
    [(ObjectiveConfig(entropy_coef=0.01), "entropy"), (ObjectiveConfig(ref_kl_coef=0.1), "ref_logprobs")],
)
def test_coefficient_without_its_tensor_raises(cfg, missing):
    logprobs, old, adv, mask = _example()
    with pytest.raises(ValueError, match=missing):
        policy_objective(logprobs, old, adv, mask, cfg, num_tokens=3)


# ---------------------------------------------------------------------------------------- gradient flow


def test_ess_capped_weight_carries_no_gradient():
    logprobs, old, adv, mask = _example()
    # ESS = 1 passed in: the KL term has weight 0, so d loss / dℓ = −ρ·A / N with ρ = min(r, 1) = (1, 1, 0.5).
    loss, _ = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(), num_tokens=3, ess=1.0)
    assert torch.allclose(_grad(loss, logprobs), torch.tensor([[-1.0, 2.0, -1.5]]) / 3, atol=1e-6)


def test_ess_gradient_includes_the_trust_region_term():
    logprobs, old, adv, mask = _example()
    loss, _ = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(), num_tokens=3, ess=0.8)
    # policy: −ρ·A with ρ = (0.8, 0.8, 0.5) → (−0.8, 1.6, −1.5)
    # KL: (1 − 0.8)·(1 − exp(b − ℓ)) = 0.2·(1 − 1/r) = (0.1, 0, −0.2)
    expected = torch.tensor([[-0.8 + 0.1, 1.6, -1.5 - 0.2]]) / 3
    assert torch.allclose(_grad(loss, logprobs), expected, atol=1e-6)


def test_fresh_data_ess_equals_reinforce_and_kl_vanishes():
    logprobs = torch.tensor([[-0.5, -1.5, -0.25], [-2.0, -0.75, -1.0]], requires_grad=True)
    old = logprobs.detach().clone()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    ess_loss, ess_metrics = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(), num_tokens=5)
    rf_loss, _ = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(name="reinforce"), num_tokens=5)
    assert ess_metrics["loss/ess"].item() == 1.0
    assert ess_metrics["loss/kl_behaviour"].item() == 0.0
    # −Σ ℓ·A = −(−2.25 + 1.375) = 0.875 → / 5
    assert ess_loss.item() == pytest.approx(0.875 / 5) and rf_loss.item() == pytest.approx(0.875 / 5)
    assert torch.equal(_grad(ess_loss, logprobs), _grad(rf_loss, logprobs))


def test_ppo_clip_gradient_equals_reinforce_on_policy():
    logprobs = torch.tensor([[-0.5, -1.5, -0.25]], requires_grad=True)
    old = logprobs.detach().clone()
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    ppo, _ = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(name="ppo_clip"), num_tokens=3)
    rf, _ = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(name="reinforce"), num_tokens=3)
    assert torch.allclose(_grad(ppo, logprobs), _grad(rf, logprobs))


# ----------------------------------------------------------------------------- padding and bad behaviour


@pytest.mark.parametrize("name", ["ess", "ppo_clip", "reinforce"])
def test_padding_invariance(name):
    cfg = ObjectiveConfig(name=name, entropy_coef=0.1, ref_kl_coef=0.2)
    base = {
        "logprobs": torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -1.5]]),
        "old_logprobs": torch.tensor([[-1.7, -2.0, -2.3], [-0.9, -0.1, -1.5]]),
        "advantages": torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]),
        "ref_logprobs": torch.tensor([[-1.2, -1.8, -3.1], [-0.4, -0.3, -1.2]]),
        "entropy": torch.tensor([[0.3, 0.6, 0.9], [1.2, 0.2, 0.4]]),
    }
    mask = torch.tensor([[True, True, True], [True, True, False]])
    garbage = [math.nan, math.inf, -math.inf, 1e30]

    padded = {}
    for key, value in base.items():
        big = torch.empty(3, 5)
        big.view(-1).copy_(torch.tensor(garbage * 4)[:15])
        big[:2, :3] = torch.where(mask, value, math.nan)  # the masked slot inside the block is garbage too
        padded[key] = big
    padded_mask = torch.zeros(3, 5, dtype=torch.bool)
    padded_mask[:2, :3] = mask

    small_lp = base.pop("logprobs").requires_grad_()
    big_lp = padded.pop("logprobs").requires_grad_()
    loss, metrics = policy_objective(small_lp, **base, loss_mask=mask, cfg=cfg, num_tokens=5)
    big_loss, big_metrics = policy_objective(big_lp, **padded, loss_mask=padded_mask, cfg=cfg, num_tokens=5)

    assert torch.isfinite(big_loss)
    assert big_loss.item() == pytest.approx(loss.item(), abs=1e-6)
    for key in metrics:
        assert big_metrics[key].item() == pytest.approx(metrics[key].item(), abs=1e-6), key
    big_grad = _grad(big_loss, big_lp)
    assert torch.allclose(big_grad[:2, :3], _grad(loss, small_lp), atol=1e-6)
    assert torch.count_nonzero(big_grad[~padded_mask]) == 0


def test_non_finite_behaviour_tokens_are_dropped():
    logprobs, old, adv, mask = _example()
    old_bad = torch.cat([old, torch.tensor([[math.nan, -math.inf, math.inf]])], dim=1)
    lp_bad = torch.cat([logprobs.detach(), torch.tensor([[-0.1, -0.2, -0.3]])], dim=1).requires_grad_()
    adv_bad = torch.cat([adv, torch.tensor([[5.0, 5.0, 5.0]])], dim=1)
    mask_bad = torch.ones(1, 6, dtype=torch.bool)

    valid = valid_token_mask(mask_bad, old_bad)
    assert valid.tolist() == [[True, True, True, False, False, False]]
    num_tokens = int(valid.sum())  # what the caller counts
    loss, metrics = policy_objective(
        lp_bad, old_bad, adv_bad, mask_bad, ObjectiveConfig(), num_tokens=num_tokens
    )
    # Identical to the clean example: ESS 7/9 from the three finite tokens, loss 41/54.
    assert metrics["loss/ess"].item() == pytest.approx(7 / 9, abs=1e-6)
    assert loss.item() == pytest.approx(41 / 54, abs=1e-6)
    assert torch.count_nonzero(_grad(loss, lp_bad)[:, 3:]) == 0


def test_all_padding_gives_zero_loss_and_unit_ess():
    mask = torch.zeros(1, 3, dtype=torch.bool)
    logprobs = torch.tensor([[-1.0, math.nan, -3.0]], requires_grad=True)
    loss, metrics = policy_objective(
        logprobs, torch.zeros(1, 3), torch.ones(1, 3), mask, ObjectiveConfig(), num_tokens=0
    )
    assert loss.item() == 0.0 and metrics["loss/ess"].item() == 1.0
    assert metrics["loss/ratio/max"].item() == 0.0
    assert torch.count_nonzero(_grad(loss, logprobs)) == 0


def test_huge_log_ratio_is_clamped():
    logprobs = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1000.0, 0.0]])
    _, metrics = policy_objective(
        logprobs, old, torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), ObjectiveConfig(), num_tokens=2
    )
    assert metrics["loss/ratio/max"].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert math.isfinite(metrics["loss/ess"].item())


@pytest.mark.parametrize("bad", [0.0, 1.5, math.nan])
def test_out_of_range_ess_is_rejected(bad):
    logprobs, old, adv, mask = _example()
    with pytest.raises(ValueError, match="ess"):
        policy_objective(logprobs, old, adv, mask, ObjectiveConfig(), num_tokens=3, ess=bad)


def test_shape_and_dtype_contracts():
    logprobs, old, adv, mask = _example()
    with pytest.raises(ValueError, match=r"advantages has shape \(1, 2\)"):
        policy_objective(logprobs, old, adv[:, :2], mask, ObjectiveConfig(), num_tokens=3)
    with pytest.raises(ValueError, match="bool"):
        policy_objective(logprobs, old, adv, mask.float(), ObjectiveConfig(), num_tokens=3)


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"name": "grpo"}, "objective.name"),
        ({"clip_low": -0.1}, "objective.clip_low"),
        ({"clip_high": -0.1}, "objective.clip_high"),
        ({"ref_kl_coef": -1.0}, "objective.ref_kl_coef"),
        ({"max_log_ratio": 0.0}, "objective.max_log_ratio"),
        ({"entropy_coef": math.inf}, "objective.entropy_coef"),
    ],
)
def test_config_validation_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key) as info:
        ObjectiveConfig(**kwargs)
    if key == "objective.name":
        assert "'grpo'" in str(info.value) and "ppo_clip" in str(info.value)


def test_config_is_an_omegaconf_structured_config():
    omegaconf = pytest.importorskip("omegaconf")
    OmegaConf = omegaconf.OmegaConf
    schema = OmegaConf.structured(ObjectiveConfig)
    cfg = OmegaConf.to_object(
        OmegaConf.merge(schema, OmegaConf.from_dotlist(["name=ppo_clip", "clip_high=0.3"]))
    )
    assert cfg == ObjectiveConfig(name="ppo_clip", clip_high=0.3)
    # objective.name is any string to OmegaConf; __post_init__ checks it against the registry.
    with pytest.raises(ValueError, match=r"objective.name='grpo'.*\['ess', 'ppo_clip', 'reinforce'\]"):
        OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.from_dotlist(["name=grpo"])))
    with pytest.raises(ValueError, match="objective.clip_low"):
        OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.from_dotlist(["clip_low=-1"])))


# ---------------------------------------------------------------------------------------- behaviour-KL variants


def test_k2_and_capped_k3_values_and_gradients_by_hand():
    from trainer.objective import k2_kl, k3_kl, k3_kl_capped

    # log r = (ln 2, 0, −ln 2, −ln 20): r = (2, 1, 0.5, 0.05); cap 10 binds only on the last (1/r = 20 > 10).
    log_r = torch.tensor([[LN2, 0.0, -LN2, -math.log(20.0)]], requires_grad=True)
    zero = torch.zeros(1, 4)
    k2 = k2_kl(log_r, zero)
    torch.testing.assert_close(k2.detach(), 0.5 * log_r.detach() ** 2)
    torch.testing.assert_close(_grad(k2.sum(), log_r), log_r.detach())  # gradient log r

    k3 = k3_kl(log_r, zero)
    capped = k3_kl_capped(log_r, zero, cap=10.0)
    torch.testing.assert_close(capped[:, :3], k3[:, :3])  # identical where 1/r <= cap
    # Below r = 1/cap: k3 at the knee (−ln 10 + 10 − 1) plus slope (1 − cap) times the distance past it.
    knee = -math.log(10.0)
    expected = knee + 10.0 - 1.0 + (1.0 - 10.0) * (-math.log(20.0) - knee)
    assert capped[0, 3].item() == pytest.approx(expected, rel=1e-6)
    assert capped[0, 3].item() < k3[0, 3].item()  # k3 there is −ln 20 + 20 − 1
    grad = _grad(capped.sum(), log_r)
    torch.testing.assert_close(grad, torch.tensor([[0.5, 0.0, -1.0, -9.0]]))  # 1 − min(1/r, cap)


def test_capped_k3_gradient_stays_bounded_where_k3s_explodes():
    from trainer.objective import k3_kl, k3_kl_capped

    log_r = torch.linspace(-9.0, 3.0, 200).reshape(1, -1).requires_grad_(True)
    zero = torch.zeros_like(log_r)
    assert _grad(k3_kl(log_r, zero).sum(), log_r).abs().max().item() > 8000  # 1 − e^9
    capped = k3_kl_capped(log_r, zero, cap=10.0)
    assert capped.min().item() >= 0.0
    assert _grad(capped.sum(), log_r).abs().max().item() <= 9.0 + 1e-5
    # Continuous at the knee: the two sides agree to first order.
    knee = torch.tensor([[-math.log(10.0) - 1e-4, -math.log(10.0) + 1e-4]])
    left, right = k3_kl_capped(knee, torch.zeros_like(knee), cap=10.0)[0]
    assert abs(left.item() - right.item()) < 2e-3


def test_k3_gradient_never_pushes_a_token_away_from_the_other_policy():
    """Issue: past the knee log r < −10 the clamped formula's gradient was +1 (down); k3's is 1 − 1/r < 0."""
    from trainer.objective import k3_kl

    log_r = torch.linspace(-30.0, 30.0, 6001, dtype=torch.float32).reshape(1, -1).requires_grad_(True)
    zero = torch.zeros_like(log_r)
    grad = _grad(k3_kl(log_r, zero).sum(), log_r)[0]
    exact = -torch.expm1(-log_r.detach()[0].double())  # 1 − 1/r
    assert torch.equal(torch.sign(grad.double()), torch.sign(exact))
    # Equal to k3's own gradient above the knee, held at its knee value 1 − e^10 below it.
    above = log_r.detach()[0] >= -10.0
    torch.testing.assert_close(grad[above].double(), exact[above], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad[~above], torch.full_like(grad[~above], 1.0 - math.exp(10.0)))
    # The numbers of the issue, at log r = −20, −12, −10.5, −9, −2, 2, 12.
    points = torch.tensor([[-20.0, -12.0, -10.5, -9.0, -2.0, 2.0, 12.0]], requires_grad=True)
    got = _grad(k3_kl(points, torch.zeros_like(points)).sum(), points)[0]
    knee = 1.0 - math.exp(10.0)
    want = torch.tensor([knee, knee, knee, 1 - math.exp(9.0), 1 - math.exp(2.0), 1 - math.exp(-2.0), 1 - math.exp(-12.0)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_k3_value_is_unchanged_and_its_gradient_continuous_at_the_knee():
    from trainer.objective import k3_kl

    log_r = torch.tensor([[-25.0, -10.0 - 1e-3, -10.0 + 1e-3, -3.0, 0.0, 4.0]], requires_grad=True)
    zero = torch.zeros_like(log_r)
    value = k3_kl(log_r, zero)
    clamped = log_r.detach() + torch.exp((-log_r.detach()).clamp(-10.0, 10.0)) - 1.0  # FeynRL's formula
    torch.testing.assert_close(value.detach(), clamped)
    grad = _grad(value.sum(), log_r)[0]
    assert abs(grad[1].item() - grad[2].item()) / abs(grad[2].item()) < 2e-3  # 1 − e^(10 ± 1e-3)
    # The gradient with respect to the other policy's logprobs is the opposite one.
    other = torch.zeros(1, 6, requires_grad=True)
    (g_other,) = torch.autograd.grad(k3_kl(log_r.detach(), other).sum(), other)
    torch.testing.assert_close(g_other[0], -grad)


def test_knee_fraction_and_smallest_log_ratio_are_reported():
    logprobs = torch.tensor([[-20.0, -1.0, -2.0, 0.0]])
    old = torch.tensor([[-1.0, -1.5, -2.0, float("nan")]])
    mask = torch.tensor([[True, True, True, True]])
    adv = torch.ones(1, 4)
    _, metrics = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(name="ess"), num_tokens=3)
    assert metrics["loss/kl_knee_fraction"].item() == pytest.approx(1 / 3)  # log r = −19 of 3 valid tokens
    assert metrics["loss/log_ratio/min"].item() == pytest.approx(-19.0)


@pytest.mark.parametrize("estimator", ["k2", "k3_capped"])
def test_ess_loss_uses_the_chosen_behaviour_kl_and_leaves_the_policy_term(estimator):
    from trainer.objective import k2_kl, k3_kl_capped

    logprobs, old, adv, mask = _example()
    paper, paper_metrics = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(name="ess"), num_tokens=3)
    cfg = ObjectiveConfig(name="ess", behaviour_kl=estimator, behaviour_kl_cap=1.5)
    loss, metrics = policy_objective(logprobs, old, adv, mask, cfg, num_tokens=3)
    kl = k2_kl(logprobs, old) if estimator == "k2" else k3_kl_capped(logprobs, old, 1.5)
    torch.testing.assert_close(metrics["loss/kl_behaviour"], kl.sum().detach() / 3)
    torch.testing.assert_close(metrics["loss/policy"], paper_metrics["loss/policy"])
    ess = 7.0 / 9.0
    torch.testing.assert_close(loss.detach(), metrics["loss/policy"] + (1 - ess) * kl.sum().detach() / 3)
    assert not torch.allclose(loss, paper)  # the cap of 1.5 binds at r = 0.5, and k2 differs from k3


def test_behaviour_kl_is_ignored_by_the_baselines():
    logprobs, old, adv, mask = _example()
    for name in ("ppo_clip", "reinforce"):
        a, _ = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(name=name), num_tokens=3)
        b, _ = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(name=name, behaviour_kl="k2"), num_tokens=3)
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"behaviour_kl": "k4"}, "objective.behaviour_kl='k4'"), ({"behaviour_kl_cap": 1.0}, "behaviour_kl_cap=1.0")],
)
def test_behaviour_kl_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        ObjectiveConfig(**overrides)


# ------------------------------------------------------------------------------- per-sequence ESS, loss parts


def test_ess_per_sequence_hand_values_and_degenerate_rows():
    ratio = torch.tensor([[2.0, 1.0, 0.5], [3.0, 3.0, 9.0], [5.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False], [True, False, False]])
    ess = ess_per_sequence(ratio, mask)
    assert ess.dtype == torch.float64 and ess.shape == (4,) and not ess.requires_grad
    # Row 0: the shared example, 7/9. Row 1: equal ratios on its 2 valid tokens (the 9 is padding): 1.
    # Row 2: no valid token: 1. Row 3: one token: 1.
    assert ess.tolist() == pytest.approx([7 / 9, 1.0, 1.0, 1.0])
    # Each row agrees with ess_from_sums on that row alone.
    for i in range(2):
        assert ess[i].item() == pytest.approx(ess_from_sums(ess_partial_sums(ratio[i : i + 1], mask[i : i + 1])))
    # A row whose only non-zero ratio is one of many tokens reaches the floor 1/n.
    tiny = ess_per_sequence(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), torch.ones(1, 4, dtype=torch.bool))
    assert tiny.item() == pytest.approx(0.25)
    # Non-finite sums give 1 (no pull), as ess_from_sums does.
    inf = ess_per_sequence(torch.tensor([[math.inf, 1.0]]), torch.ones(1, 2, dtype=torch.bool))
    assert inf.item() == 1.0


def test_per_sequence_ess_caps_and_weights_each_row_with_its_own_ess():
    # Row 0 is the shared example (ESS 7/9); row 1 is on-policy (ESS 1) with advantages (1, 1, 1).
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - LN2, -2.0, -3.0 + LN2], [-1.0, -1.0, -1.0]])
    adv = torch.tensor([[1.0, -2.0, 3.0], [1.0, 1.0, 1.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    ess = ess_per_sequence(importance_ratio(logprobs.detach(), old, mask, 20.0), mask)
    loss, metrics = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(), num_tokens=6, ess=ess)
    # Row 0 as test_ess_objective_hand_values: 13/6 + (2/9)·0.5 = 41/18; row 1: ρ = 1, −Σℓ·A = 3, KL 0.
    assert loss.item() == pytest.approx((41 / 18 + 3) / 6, abs=1e-6)
    assert metrics["loss/ess"].item() == pytest.approx((7 / 9 + 1) / 2, abs=1e-6)  # token-weighted mean
    assert metrics["loss/clipfrac"].item() == pytest.approx(2 / 6)  # only row 0's r = 2 and r = 1 exceed 7/9
    # One ESS for the whole batch would cap row 1 too: the per-sequence loss differs from it.
    whole, _ = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(), num_tokens=6)
    assert whole.item() != pytest.approx(loss.item(), rel=1e-3)
    # The gradient: row 0 as test_ess_gradient_includes_the_trust_region_term at ESS 7/9; row 1 is −A / N.
    grad = _grad(loss, logprobs)
    row0 = torch.tensor([-7 / 9 + (2 / 9) * 0.5, 14 / 9, -1.5 - (2 / 9)])
    assert torch.allclose(grad, torch.stack([row0, -torch.ones(3)]) / 6, atol=1e-6)


@pytest.mark.parametrize("bad", [torch.tensor([0.5]), torch.tensor([0.0, 0.5]), torch.tensor([0.5, 1.5])])
def test_per_sequence_ess_is_checked(bad):
    logprobs = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="per-sequence ess"):
        policy_objective(logprobs, logprobs, logprobs, mask, ObjectiveConfig(), num_tokens=6, ess=bad)


@pytest.mark.parametrize("name", ["ess", "ppo_clip", "reinforce"])
def test_loss_parts_add_up_to_the_objective(name):
    logprobs, old, adv, mask = _example()
    cfg = ObjectiveConfig(name=name)
    grads, metrics = {}, {}
    for part in ("all", "policy", "behaviour_kl"):
        loss, metrics[part] = policy_objective(logprobs, old, adv, mask, cfg, num_tokens=3, part=part)
        grads[part] = _grad(loss, logprobs)
    torch.testing.assert_close(grads["policy"] + grads["behaviour_kl"], grads["all"])
    if name == "ess":  # KL part: (1 − 7/9)·(1 − 1/r) / 3 = (2/9)·(0.5, 0, −1) / 3
        assert torch.allclose(grads["behaviour_kl"], torch.tensor([[1 / 9, 0.0, -2 / 9]]) / 3, atol=1e-6)
    else:  # no behaviour-KL term: its part has a zero gradient
        assert torch.equal(grads["behaviour_kl"], torch.zeros_like(grads["all"]))
    for key in set(metrics["all"]) - {"loss/total"}:  # loss/total is the part's loss; the rest are unchanged
        assert torch.equal(metrics["all"][key], metrics["policy"][key]), key
    with pytest.raises(ValueError, match="part="):
        policy_objective(logprobs, old, adv, mask, cfg, num_tokens=3, part="entropy")


# ---------------------------------------------------------------------------------------------- registry


def test_the_registry_holds_the_objectives_and_only_ess_has_the_trust_region_term():
    assert list(LOSSES) == ["ess", "ppo_clip", "reinforce"]
    assert {name: loss.behaviour_kl for name, loss in LOSSES.items()} == {
        "ess": True, "ppo_clip": False, "reinforce": False,
    }  # fmt: skip


def test_a_registered_surrogate_is_a_usable_objective():
    """A new surrogate is one pure function under @register_loss: the config accepts it, the objective runs it."""
    logprobs, old, adv, mask = _example()
    with pytest.raises(ValueError, match="objective.name='half_reinforce'"):
        ObjectiveConfig(name="half_reinforce")

    @register_loss("half_reinforce")
    def half_reinforce(*, logprobs, ratio, advantages, ess, cfg):
        return -0.5 * logprobs * advantages, torch.zeros_like(logprobs, dtype=torch.bool)

    try:
        with pytest.raises(ValueError, match="already registered"):
            register_loss("half_reinforce")(half_reinforce)
        cfg = ObjectiveConfig(name="half_reinforce")
        loss, metrics = policy_objective(logprobs, old, adv, mask, cfg, num_tokens=3)
        reinforce, _ = policy_objective(logprobs, old, adv, mask, ObjectiveConfig(name="reinforce"), num_tokens=3)
        assert loss.item() == pytest.approx(0.5 * reinforce.item())
        assert metrics["loss/clipfrac"].item() == 0.0
        kl_part, _ = policy_objective(logprobs, old, adv, mask, cfg, num_tokens=3, part="behaviour_kl")
        assert torch.equal(_grad(kl_part, logprobs), torch.zeros_like(logprobs))  # no trust-region term
    finally:
        del LOSSES["half_reinforce"]
