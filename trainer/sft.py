"""Supervised fine-tuning step: masked next-token cross-entropy (used to warm-start the tiny model)."""

from __future__ import annotations

import torch

from trainer.logprobs import token_logprobs


def sft_step(model, optimizer, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
             *, max_grad_norm: float = 1.0, scheduler=None) -> float:
    """One step of −Σ log π(target) / #targets over positions where loss_mask is True; returns the loss."""
    logprobs, _ = token_logprobs(model, input_ids, attention_mask)
    num_tokens = loss_mask.sum().clamp(min=1)
    loss = -(logprobs * loss_mask).sum() / num_tokens
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
