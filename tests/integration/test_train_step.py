"""train_step on a tiny random Qwen2 in one process (LocalReducer): loss, update, micro-batching, guards."""

import math

import pytest
import torch

from tests.integration.dist_worker import build_batch, build_model
from trainer.distributed import LocalReducer
from trainer.logprobs import token_logprobs
from trainer.objective import (
    ObjectiveConfig,
    ess_per_sequence,
    importance_ratio,
    policy_objective,
    valid_token_mask,
)
from trainer.optim import OptimConfig, build_optimizer, lr_multiplier
from trainer.step import TrainBatch, TrainerConfig, train_step

REDUCER = LocalReducer()


def _replace(batch: TrainBatch, **changes) -> TrainBatch:
    fields = {k: getattr(batch, k) for k in batch.__dataclass_fields__}
    return TrainBatch(**{**fields, **changes})


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _sgd_step(batch, objective, cfg, seed=0):
    """One train_step with SGD(lr=1) and no clipping: returns (metrics, -gradient per parameter)."""
    model = build_model(seed)
    before = _params(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = train_step(model, optimizer, batch, objective, REDUCER, cfg)
    after = _params(model)
    return metrics, {k: after[k] - before[k] for k in before}


def test_loss_equals_a_direct_policy_objective_call():
    model = build_model()
    batch = build_batch(model)
    objective = ObjectiveConfig(name="ess", entropy_coef=0.01)
    cfg = TrainerConfig(micro_batch_size=64)
    mask = valid_token_mask(batch.loss_mask, batch.old_logprobs)
    with torch.no_grad():
        logprobs, entropy = token_logprobs(model, batch.input_ids, batch.attention_mask, with_entropy=True)
        loss, expected = policy_objective(
            logprobs, batch.old_logprobs, batch.advantages, mask, objective,
            num_tokens=float(mask.sum()), entropy=entropy,
        )  # fmt: skip
    optimizer, _ = build_optimizer(model, OptimConfig(lr=1e-3), total_steps=1)
    metrics = train_step(model, optimizer, batch, objective, REDUCER, cfg)
    assert metrics["train/num_tokens"] == float(mask.sum()) == batch.num_valid_tokens()
    assert metrics["loss/total"] == pytest.approx(float(loss), rel=1e-6)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(float(value), rel=1e-5, abs=1e-7), key
    assert 0 < metrics["loss/ess"] < 1  # the batch is off-policy
    assert metrics["train/skipped"] == 0.0 and metrics["train/grad_norm"] > 0
    assert metrics["train/lr"] == 1e-3 and metrics["timing/train_step"] > 0
    assert all(isinstance(v, float) for v in metrics.values())


def test_params_move_and_grads_are_cleared():
    model = build_model()
    batch = build_batch(model)
    before = _params(model)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-3), total_steps=2)
    train_step(model, optimizer, batch, ObjectiveConfig(), REDUCER, TrainerConfig(), scheduler=scheduler)
    after = _params(model)
    assert all(not torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert scheduler.last_epoch == 1


@pytest.mark.parametrize(
    "objective, ess_scope",
    [
        (ObjectiveConfig(name="ess"), "step"),
        (ObjectiveConfig(name="ess"), "sequence"),
        (ObjectiveConfig(name="ppo_clip"), "micro_batch"),
    ],
    ids=["ess-step", "ess-sequence", "ppo_clip"],
)
@pytest.mark.parametrize("micro_batch_size", [1, 3])  # 3 on 7 rows: an uneven last micro-batch
def test_micro_batching_does_not_change_the_gradient(objective, ess_scope, micro_batch_size):
    batch = build_batch(build_model())
    full_cfg = TrainerConfig(micro_batch_size=64, max_grad_norm=0.0, ess_scope=ess_scope)
    micro_cfg = TrainerConfig(micro_batch_size=micro_batch_size, max_grad_norm=0.0, ess_scope=ess_scope)
    full_metrics, full_grad = _sgd_step(batch, objective, full_cfg)
    micro_metrics, micro_grad = _sgd_step(batch, objective, micro_cfg)
    assert micro_metrics["train/micro_batches"] == math.ceil(batch.batch_size / micro_batch_size)
    keys = ["loss/total", "train/grad_norm", "train/num_tokens", "loss/ratio/max", "loss/clipfrac"]
    if ess_scope == "step":  # per-micro-batch ESS is a per-piece diagnostic for ppo_clip: it differs
        keys.append("loss/ess")
    for key in keys:
        assert micro_metrics[key] == pytest.approx(full_metrics[key], rel=1e-5), key
    for key, grad in full_grad.items():
        torch.testing.assert_close(micro_grad[key], grad, atol=1e-6, rtol=1e-4, msg=key)


def test_ess_scope_step_uses_one_ess_for_the_whole_step():
    batch = build_batch(build_model())
    objective = ObjectiveConfig(name="ess")
    whole, _ = _sgd_step(batch, objective, TrainerConfig(micro_batch_size=64))
    per_step, _ = _sgd_step(batch, objective, TrainerConfig(micro_batch_size=2, ess_scope="step"))
    per_micro, _ = _sgd_step(batch, objective, TrainerConfig(micro_batch_size=2, ess_scope="micro_batch"))
    assert per_step["loss/ess"] == pytest.approx(whole["loss/ess"], rel=1e-6)
    assert per_step["loss/total"] == pytest.approx(whole["loss/total"], rel=1e-5)
    # Per-micro-batch ESS over 2-row pieces differs from the whole-step ESS (and so does the loss).
    assert per_micro["loss/ess"] != pytest.approx(whole["loss/ess"], rel=1e-3)


def test_ess_scope_sequence_gives_each_row_its_own_ess():
    model = build_model()
    batch = build_batch(model)
    objective = ObjectiveConfig(name="ess")
    mask = valid_token_mask(batch.loss_mask, batch.old_logprobs)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
        ess = ess_per_sequence(importance_ratio(logprobs, batch.old_logprobs, mask, objective.max_log_ratio), mask)
        expected, _ = policy_objective(
            logprobs, batch.old_logprobs, batch.advantages, mask, objective, num_tokens=float(mask.sum()), ess=ess
        )
    assert len(set(ess.tolist())) > 1  # the rows of the off-policy batch differ
    metrics, _ = _sgd_step(batch, objective, TrainerConfig(micro_batch_size=64, ess_scope="sequence"))
    assert metrics["loss/total"] == pytest.approx(float(expected), rel=1e-6)
    whole, _ = _sgd_step(batch, objective, TrainerConfig(micro_batch_size=64))
    assert whole["loss/total"] != pytest.approx(metrics["loss/total"], rel=1e-4)


@pytest.mark.parametrize("name", ["ess", "ppo_clip"])
def test_grad_diagnostics_measure_each_term_and_leave_the_update_alone(name):
    batch = build_batch(build_model())
    objective = ObjectiveConfig(name=name)
    cfg = TrainerConfig(micro_batch_size=64, max_grad_norm=0.0)
    plain, plain_step = _sgd_step(batch, objective, cfg)
    model = build_model()
    before = _params(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    diagnosed = train_step(model, optimizer, batch, objective, REDUCER, cfg, diagnose=True)
    for key, value in _params(model).items():  # the diagnostic passes change neither the gradient nor the step
        torch.testing.assert_close(value - before[key], plain_step[key], atol=1e-7, rtol=1e-5, msg=key)
    assert "train/grad_norm/policy" not in plain
    assert diagnosed["train/grad_norm"] == pytest.approx(plain["train/grad_norm"], rel=1e-6)
    # Each term's norm, measured directly: that part's loss alone over the batch (one micro-batch), backpropagated.
    mask = valid_token_mask(batch.loss_mask, batch.old_logprobs)
    for part in ("policy", "behaviour_kl"):
        model = build_model()
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
        loss, _ = policy_objective(
            logprobs, batch.old_logprobs, batch.advantages, mask, objective,
            num_tokens=float(mask.sum()), part=part,
        )  # fmt: skip
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), math.inf))
        assert diagnosed[f"train/grad_norm/{part}"] == pytest.approx(norm, rel=1e-5), part
    if name == "ess":
        assert diagnosed["train/grad_norm/behaviour_kl"] > 0
    else:
        assert diagnosed["train/grad_norm/behaviour_kl"] == 0.0
        assert diagnosed["train/grad_norm/policy"] == pytest.approx(plain["train/grad_norm"], rel=1e-6)


def test_non_finite_behaviour_logprob_is_dropped_not_skipped():
    model = build_model()
    batch = build_batch(model)
    assert torch.isnan(batch.old_logprobs[batch.loss_mask]).sum() == 1  # build_batch plants one
    optimizer, _ = build_optimizer(model, OptimConfig(lr=1e-3), total_steps=1)
    metrics = train_step(model, optimizer, batch, ObjectiveConfig(), REDUCER, TrainerConfig())
    assert metrics["train/skipped"] == 0.0
    assert metrics["train/num_tokens"] == batch.loss_mask.sum() - 1
    assert all(math.isfinite(v) for v in metrics.values())


def test_nan_in_logprobs_skips_the_step_and_leaves_params_unchanged():
    model = build_model()
    batch = build_batch(model)
    ref = batch.old_logprobs.nan_to_num(0.0).clone()
    ref[2, 4] = float("nan")  # a trained-on token
    assert batch.loss_mask[2, 4]
    batch = _replace(batch, ref_logprobs=ref)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-3, warmup_steps=2), total_steps=4)
    before = _params(model)
    objective = ObjectiveConfig(ref_kl_coef=0.1)
    metrics = train_step(model, optimizer, batch, objective, REDUCER, TrainerConfig(), scheduler=scheduler)
    assert metrics["train/skipped"] == 1.0 and "train/skipped_steps" not in metrics
    assert not math.isfinite(metrics["loss/total"])
    after = _params(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert optimizer.state_dict()["state"] == {}  # AdamW never stepped: no moments
    assert scheduler.last_epoch == 0
    # The next good step trains normally.
    good = _replace(batch, ref_logprobs=ref.nan_to_num(0.0))
    metrics = train_step(model, optimizer, good, objective, REDUCER, TrainerConfig(), scheduler=scheduler)
    assert metrics["train/skipped"] == 0.0 and math.isfinite(metrics["loss/ref_kl"])


def test_non_finite_weights_skip_the_step():
    model = build_model()
    batch = build_batch(model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("inf")
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = _params(model)
    metrics = train_step(model, optimizer, batch, ObjectiveConfig(), REDUCER, TrainerConfig())
    assert metrics["train/skipped"] == 1.0
    after = _params(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_entropy_bonus_changes_the_gradient_only_when_on():
    batch = build_batch(build_model())
    cfg = TrainerConfig(max_grad_norm=0.0)
    off, grad_off = _sgd_step(batch, ObjectiveConfig(entropy_coef=0.0), cfg)
    on, grad_on = _sgd_step(batch, ObjectiveConfig(entropy_coef=0.5), cfg)
    assert off["loss/entropy"] == pytest.approx(on["loss/entropy"], rel=1e-6)  # reported either way
    assert on["loss/total"] == pytest.approx(off["loss/total"] - 0.5 * off["loss/entropy"], rel=1e-5)
    assert any(not torch.allclose(grad_on[k], grad_off[k]) for k in grad_off)


def test_temperature_is_applied():
    model = build_model()
    batch = build_batch(model, temperature=0.5)
    mask = valid_token_mask(batch.loss_mask, batch.old_logprobs)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.5)
        loss, _ = policy_objective(
            logprobs,
            batch.old_logprobs,
            batch.advantages,
            mask,
            ObjectiveConfig(),
            num_tokens=float(mask.sum()),
        )
    metrics, _ = _sgd_step(batch, ObjectiveConfig(), TrainerConfig())
    assert metrics["loss/total"] == pytest.approx(float(loss), rel=1e-6)


def test_grad_norm_is_reported_before_clipping():
    batch = build_batch(build_model())
    free, grad_free = _sgd_step(batch, ObjectiveConfig(), TrainerConfig(max_grad_norm=0.0))
    clipped, grad_clipped = _sgd_step(batch, ObjectiveConfig(), TrainerConfig(max_grad_norm=0.1))
    assert free["train/grad_norm"] > 0.1
    assert clipped["train/grad_norm"] == pytest.approx(free["train/grad_norm"], rel=1e-6)
    assert (free["train/clipped"], clipped["train/clipped"]) == (0.0, 1.0)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grad_clipped.values()]))
    assert float(norm) == pytest.approx(0.1, rel=1e-4)


# ---- TrainBatch, TrainerConfig and OptimConfig contracts -------------------------------------------------


def test_train_batch_rejects_bad_tensors_with_shapes_in_the_message():
    batch = build_batch(build_model())
    with pytest.raises(ValueError, match=r"advantages=\(7, 11\)"):
        _replace(batch, advantages=batch.advantages[:, :-1])
    with pytest.raises(ValueError, match="float32"):
        _replace(batch, old_logprobs=batch.old_logprobs.double())
    with pytest.raises(ValueError, match="int64"):
        _replace(batch, input_ids=batch.input_ids.int())
    with pytest.raises(ValueError, match="bool"):
        _replace(batch, loss_mask=batch.loss_mask.long())
    nan_adv = batch.advantages.clone()
    nan_adv[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"NaN/inf.*rows 3"):
        _replace(batch, advantages=nan_adv)
    at_zero = batch.loss_mask.clone()
    at_zero[0, 0] = True
    with pytest.raises(ValueError, match="index 0"):
        _replace(batch, loss_mask=at_zero)
    on_padding = batch.loss_mask.clone()
    on_padding[:, -1] = True
    with pytest.raises(ValueError, match="padding"):
        _replace(batch, loss_mask=on_padding)
    # Values outside loss_mask are never read: NaN advantages on padding are fine.
    pad_adv = torch.where(batch.loss_mask, batch.advantages, float("nan"))
    _replace(batch, advantages=pad_adv)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"micro_batch_size": 0}, "trainer.micro_batch_size"),
        ({"max_grad_norm": -1.0}, "trainer.max_grad_norm"),
        ({"ess_scope": "global"}, "trainer.ess_scope"),
        ({"share_prompts": "yes"}, "trainer.share_prompts"),
    ],
)
def test_trainer_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": 0.0}, "optim.lr"),
        ({"weight_decay": -0.1}, "optim.weight_decay"),
        ({"beta1": 1.0}, "optim.beta1"),
        ({"beta2": -0.1}, "optim.beta2"),
        ({"eps": 0.0}, "optim.eps"),
        ({"schedule": "step"}, "optim.schedule"),
        ({"warmup_steps": -1}, "optim.warmup_steps"),
        ({"min_lr_ratio": 1.5}, "optim.min_lr_ratio"),
    ],
)
def test_optim_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kwargs)


def test_optim_config_is_an_omegaconf_structured_config():
    omegaconf = pytest.importorskip("omegaconf")
    schema = omegaconf.OmegaConf.structured(OptimConfig)
    merged = omegaconf.OmegaConf.merge(
        schema, omegaconf.OmegaConf.from_dotlist(["schedule=cosine", "lr=3e-5"])
    )
    cfg = omegaconf.OmegaConf.to_object(merged)
    assert isinstance(cfg, OptimConfig) and cfg.schedule == "cosine" and cfg.lr == 3e-5
    with pytest.raises(ValueError, match="optim.schedule"):
        omegaconf.OmegaConf.to_object(omegaconf.OmegaConf.merge(schema, {"schedule": "bogus"}))
    trainer = omegaconf.OmegaConf.to_object(omegaconf.OmegaConf.structured(TrainerConfig))
    assert trainer == TrainerConfig()


@pytest.mark.parametrize(
    "schedule, expected",
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1]),
        ("cosine", [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 0.55, None, 0.1]),
    ],
)
def test_lr_schedule_shapes(schedule, expected):
    """Warmup 2 of 6 steps; the decay reaches min_lr_ratio after the last step (index 6), as in HF."""
    cfg = OptimConfig(lr=1.0, schedule=schedule, warmup_steps=2, min_lr_ratio=0.1)
    got = [lr_multiplier(step, cfg, total_steps=6) for step in range(7)]
    for g, e in zip(got, expected, strict=True):
        if e is not None:
            assert g == pytest.approx(e)
    model = build_model()
    optimizer, scheduler = build_optimizer(model, cfg, total_steps=6)
    seen = []
    for _ in range(7):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx(got)


def test_weight_decay_skips_biases_and_norms():
    model = build_model()
    optimizer, _ = build_optimizer(model, OptimConfig(weight_decay=0.1), total_steps=1)
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, param in model.named_parameters():
        assert (id(param) in decayed) == (param.ndim >= 2), name


def test_a_multi_rank_reducer_needs_a_sharded_model():
    class TwoRanks(LocalReducer):
        world_size = 2

    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ValueError, match="shard_model"):
        train_step(model, optimizer, build_batch(model), ObjectiveConfig(), TwoRanks(), TrainerConfig())


def test_batch_temperature_must_be_positive():
    batch = build_batch(build_model())
    with pytest.raises(ValueError, match="TrainBatch.temperature"):
        TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.old_logprobs,
                   batch.advantages, temperature=0.0)


@pytest.mark.parametrize(
    "objective, ess_scope, micro_batch_size",
    [
        (ObjectiveConfig(name="ess"), "micro_batch", 64),
        (ObjectiveConfig(name="ess"), "micro_batch", 3),  # pairs split across micro-batches
        (ObjectiveConfig(name="ess", entropy_coef=0.01), "step", 2),
        (ObjectiveConfig(name="ess"), "sequence", 4),
        (ObjectiveConfig(name="ppo_clip"), "micro_batch", 64),
    ],
    ids=["ess", "ess-split-groups", "ess-step-entropy", "ess-sequence", "ppo_clip"],
)
def test_shared_prompts_give_the_same_step(objective, ess_scope, micro_batch_size):
    """trainer.share_prompts packs each group's completions after one copy of its prompt: same loss, same gradient."""
    batch = build_batch(build_model(), rows=9, shared_prompts=3, temperature=0.9)
    plain_cfg = TrainerConfig(micro_batch_size=micro_batch_size, max_grad_norm=0.0, ess_scope=ess_scope)
    shared_cfg = TrainerConfig(
        micro_batch_size=micro_batch_size, max_grad_norm=0.0, ess_scope=ess_scope, share_prompts=True
    )
    plain_metrics, plain_grad = _sgd_step(batch, objective, plain_cfg)
    shared_metrics, shared_grad = _sgd_step(batch, objective, shared_cfg)
    for key in ("loss/total", "loss/policy", "loss/ess", "loss/entropy", "train/grad_norm", "train/num_tokens",
                "loss/ratio/max", "loss/clipfrac"):  # fmt: skip
        assert shared_metrics[key] == pytest.approx(plain_metrics[key], rel=1e-5, abs=1e-7), key
    for key, grad in plain_grad.items():
        torch.testing.assert_close(shared_grad[key], grad, atol=1e-6, rtol=1e-4, msg=key)


@pytest.mark.parametrize("micro_batch_size", [3, 64])
def test_lag0_rows_measure_the_engine_mismatch_alone(micro_batch_size):
    """loss/ess_lag0 and loss/logprob_gap_lag0 cover the `fresh` rows only, whatever the micro-batching."""
    model = build_model()
    batch = build_batch(model)
    fresh = torch.arange(batch.batch_size) % 3 == 0
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    mask = valid_token_mask(batch.loss_mask, batch.old_logprobs) & fresh[:, None]
    log_r = (logprobs - batch.old_logprobs)[mask].double()
    expected_ess = float(log_r.exp().sum() ** 2 / (mask.sum() * log_r.exp().pow(2).sum()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = train_step(model, optimizer, _replace(batch, fresh=fresh), ObjectiveConfig(name="ess"), REDUCER,
                         TrainerConfig(micro_batch_size=micro_batch_size))  # fmt: skip
    assert metrics["loss/ess_lag0"] == pytest.approx(expected_ess, rel=1e-5)
    assert metrics["loss/logprob_gap_lag0"] == pytest.approx(float(log_r.abs().mean()), rel=1e-5)
    assert metrics["loss/lag0_tokens"] == float(mask.sum())
    assert not any(key.startswith("_lag0") for key in metrics)
    # No fresh row (or no `fresh` at all): nothing to report.
    none = train_step(model, optimizer, _replace(batch, fresh=torch.zeros_like(fresh)), ObjectiveConfig(name="ess"),
                      REDUCER, TrainerConfig(micro_batch_size=micro_batch_size))  # fmt: skip
    assert "loss/ess_lag0" not in none
    with pytest.raises(ValueError, match="fresh"):
        _replace(batch, fresh=fresh[:-1])


@pytest.mark.parametrize("share_prompts", [False, True], ids=["rows", "shared-prompts"])
def test_a_reference_model_gives_the_step_its_reference_logprobs(share_prompts):
    """objective.ref_kl_coef: `train_step(reference=...)` computes each micro-batch's reference logprobs with the
    reference model, as if the batch had carried them: the same loss, reference KL and gradient."""
    batch = build_batch(build_model(), rows=9, shared_prompts=3, temperature=0.9)
    reference = build_model(seed=7)
    objective = ObjectiveConfig(name="ess", ref_kl_coef=0.1)
    cfg = TrainerConfig(micro_batch_size=4, max_grad_norm=0.0, share_prompts=share_prompts)
    with torch.no_grad():
        ref, _ = token_logprobs(reference, batch.input_ids, batch.attention_mask, temperature=0.9)
    given_metrics, given_grad = _sgd_step(_replace(batch, ref_logprobs=ref), objective, cfg)

    model = build_model()
    before = _params(model)
    metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, objective, REDUCER, cfg,
                         reference=reference)  # fmt: skip
    assert metrics["loss/ref_kl"] > 0
    for key in ("loss/total", "loss/ref_kl", "loss/policy", "train/grad_norm"):
        assert metrics[key] == pytest.approx(given_metrics[key], rel=1e-5, abs=1e-7), key
    for key, value in _params(model).items():
        torch.testing.assert_close(value - before[key], given_grad[key], atol=1e-6, rtol=1e-4, msg=key)
    assert all(not p.requires_grad or p.grad is None for p in reference.parameters())

    # The policy itself as the reference: the penalty and its gradient are zero on the first step.
    model = build_model()
    same = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, objective, REDUCER, cfg,
                      reference=build_model())  # fmt: skip
    assert same["loss/ref_kl"] == pytest.approx(0.0, abs=1e-7)
