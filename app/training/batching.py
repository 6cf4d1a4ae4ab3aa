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
    loss_mask is True on output tokens the policy sampled (a multi-turn trajectory's tool tokens are False: they
    are context, never trained on), old_logprobs holds their behaviour logprobs, and each output token carries its
    sequence's advantage. With multi-turn trajectories in the batch, `turns` holds each output token's turn
    (-1 elsewhere) for the per-turn metrics.
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
    multi_turn = any(c.output_turns is not None for c in completions)
    turns = torch.full((batch, length), -1, dtype=torch.long) if multi_turn else None
    for i, (c, a) in enumerate(zip(completions, advantages, strict=True)):
        p, o = len(c.prompt_ids), len(c.output_ids)
        if len(c.output_logprobs) != o:
            raise ValueError(f"completion {i}: {o} output ids but {len(c.output_logprobs)} logprobs")
        for name in ("output_mask", "output_turns"):
            values = getattr(c, name)
            if values is not None and len(values) != o:
                raise ValueError(f"completion {i}: {o} output ids but {len(values)} entries in {name}")
        input_ids[i, : p + o] = torch.tensor(c.prompt_ids + c.output_ids, dtype=torch.long)
        attention_mask[i, : p + o] = 1
        if c.output_mask is None:
            loss_mask[i, p : p + o] = True
        else:
            loss_mask[i, p : p + o] = torch.tensor(c.output_mask, dtype=torch.bool)
        old_logprobs[i, p : p + o] = torch.tensor(c.output_logprobs, dtype=torch.float32)
        adv[i, p : p + o] = a
        if turns is not None:
            turns[i, p : p + o] = torch.tensor(c.output_turns, dtype=torch.long) if c.output_turns is not None else 0
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        old_logprobs=old_logprobs,
        advantages=adv,
        temperature=temperature,
        turns=turns,
    )
