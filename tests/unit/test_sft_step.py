"""trainer/sft.py on the tiny Qwen2: the step's loss is the masked mean NLL (checked against transformers' own
loss), micro-batching does not change the update, and length sorting keeps padding small."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer
from trainer.sft import Example, SFTConfig, collate, held_out_loss, plan_sft_step, sft_step


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    tok = build_tiny_tokenizer()
    return build_tiny_model(TinyModelConfig(), tok), tok


def _examples(n: int, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, target = rng.randint(3, 30), rng.randint(1, 12)
        out.append(Example(tuple(rng.randrange(3, 200) for _ in range(prompt + target)), prompt))
    return out


def test_loss_is_the_mean_nll_of_target_tokens_as_transformers_computes_it(tiny):
    model, tok = tiny
    examples = _examples(12)
    batch = collate(examples, tok.pad_token_id)
    labels = batch.input_ids.masked_fill(~batch.loss_mask, -100)
    with torch.no_grad():
        expected = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = sft_step(model, optimizer, plan_sft_step(examples, 5, tok.pad_token_id), max_grad_norm=0.0)
    assert metrics["sft/loss"] == pytest.approx(float(expected), rel=1e-5)
    assert held_out_loss(model, examples, 4, tok.pad_token_id) == pytest.approx(float(expected), rel=1e-5)


def test_micro_batch_size_does_not_change_the_update(tiny):
    model, tok = tiny
    examples = _examples(10, seed=1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    after = []
    for micro in (1, 3, 10):
        model.load_state_dict(start)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        sft_step(model, optimizer, plan_sft_step(examples, micro, tok.pad_token_id), max_grad_norm=0.0)
        after.append({k: v.clone() for k, v in model.state_dict().items()})
    moved = max((after[0][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-4
    for other in after[1:]:
        for k in start:
            torch.testing.assert_close(other[k], after[0][k], rtol=1e-4, atol=1e-6)


def test_micro_batches_are_length_sorted_and_cover_every_example():
    examples = _examples(64, seed=2)
    plan = plan_sft_step(examples, 8, pad_id=0)
    assert len(plan.micro_batches) == 8
    assert sum(int(m.loss_mask.sum()) for m in plan.micro_batches) == sum(e.num_targets for e in examples)
    assert plan.tokens == sum(len(e.ids) for e in examples) and plan.num_targets == plan.tokens - sum(
        e.start for e in examples
    )
    lengths = [m.input_ids.shape[1] for m in plan.micro_batches]
    assert lengths == sorted(lengths)
    unsorted_padded = sum(
        8 * max(len(e.ids) for e in examples[i : i + 8]) for i in range(0, 64, 8)
    )  # the same micro-batches in arrival order
    assert plan.padded_tokens < unsorted_padded


def test_steps_follow_epochs_or_the_step_count():
    assert SFTConfig(epochs=2.0, batch_size=32).total_steps(100) == 7
    assert SFTConfig(steps=5).total_steps(10**6) == 5
    with pytest.raises(ValueError, match=r"sft\.batch_size=0 must be an integer >= 1"):
        SFTConfig(batch_size=0)
    with pytest.raises(ValueError, match=r"sft\.on_long='cut'"):
        SFTConfig(on_long="cut")
    with pytest.raises(ValueError, match="target must start inside"):
        Example((1, 2, 3), 3)
