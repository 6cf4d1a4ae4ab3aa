"""Turn scored completions into the trainer's padded `TrainBatch`."""

from __future__ import annotations

import torch

from app.rollout.base import Completion
from trainer.step import TrainBatch


def build_train_batch(
    completions: list[Completion], advantages: list[float], *, pad_id: int, temperature: float
) -> TrainBatch:
    """Right-pad prompt + output of each completion into one batch.

    Index t of every [B, L] tensor refers to token input_ids[:, t] (the convention of trainer/logprobs.py):
    loss_mask is True on output tokens, old_logprobs holds their behaviour logprobs, and each output token
    carries its sequence's advantage.
    """
    if len(completions) != len(advantages):
        raise ValueError(f"{len(completions)} completions but {len(advantages)} advantages")
    if not completions:
        raise ValueError("cannot build a train batch from zero completions")
    length = max(len(c.prompt_ids) + len(c.output_ids) for c in completions)
    batch = len(completions)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    loss_mask = torch.zeros((batch, length), dtype=torch.bool)
    old_logprobs = torch.zeros((batch, length), dtype=torch.float32)
    adv = torch.zeros((batch, length), dtype=torch.float32)
    for i, (c, a) in enumerate(zip(completions, advantages, strict=True)):
        p, o = len(c.prompt_ids), len(c.output_ids)
        if len(c.output_logprobs) != o:
            raise ValueError(f"completion {i}: {o} output ids but {len(c.output_logprobs)} logprobs")
        input_ids[i, : p + o] = torch.tensor(c.prompt_ids + c.output_ids, dtype=torch.long)
        attention_mask[i, : p + o] = 1
        loss_mask[i, p : p + o] = True
        old_logprobs[i, p : p + o] = torch.tensor(c.output_logprobs, dtype=torch.float32)
        adv[i, p : p + o] = a
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        old_logprobs=old_logprobs,
        advantages=adv,
        temperature=temperature,
    )
