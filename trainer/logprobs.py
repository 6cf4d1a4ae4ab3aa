"""Model forward -> per-token log-probabilities and entropies (chunked log-softmax).

Convention used everywhere in trustbatch (rollout engines, ``TrainBatch``, the objective):

    logprobs[:, t] = log pi(input_ids[:, t] | input_ids[:, <t])   under log_softmax(logits / temperature)
    logprobs[:, 0] = 0                                              (nothing predicts the first token)

so index ``t`` of every per-token tensor is about token ``t`` itself, and a ``loss_mask`` that is True on the
response tokens lines up with the logprobs, the behaviour logprobs and the advantages without any shifting.
``entropy[:, t]`` is the entropy of the (temperature-scaled) distribution that token ``t`` was drawn from.

Padding. Positions are passed explicitly as ``position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)``, so
left- and right-padded batches give the same values on the attended tokens (left padding is what batched
sampling produces; right padding is what the trainer builds). Positions with ``attention_mask == 0`` get 0, and
so does the first attended token of each row (it has no context; under left padding the model would otherwise
"predict" it from a pad position).

Memory. The log-softmax over the vocabulary is computed in float32, ``chunk_size`` sequence positions at a time,
so the float32 copy of the logits never exists for the whole sequence at once. When gradients are needed each
chunk runs under activation checkpointing: autograd keeps only the model's logits (which the model produced
anyway) and recomputes the chunk's softmax in the backward pass, instead of holding one float32 [B, L, V]
softmax (plus one for the entropy) per sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 1024


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position of each token among the attended tokens of its row: 0, 1, 2, ... (pads get 0)."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def _chunk_logprobs(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
    """log-softmax of one chunk in float32: target logprobs [B, C] and (optionally) entropies [B, C]."""
    scaled = logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return token_logp
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor | None]:
    """Per-token logprobs [B, L] (float32) and, if ``with_entropy``, entropies [B, L] of any HF causal LM.

    ``input_ids`` and ``attention_mask`` are [B, L]; padding may be on either side. See the module docstring
    for the index convention (index ``t`` is the logprob of token ``t``; index 0 is 0). Gradients flow to the
    model through the logprobs and the entropy.
    """
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, L]; got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the sampling temperature); got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")

    position_ids = position_ids_from_mask(attention_mask)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
    ).logits  # [B, L, V]; logits[:, t] predicts input_ids[:, t + 1]

    batch, length = input_ids.shape
    use_checkpoint = torch.is_grad_enabled() and logits.requires_grad
    logp_chunks, entropy_chunks = [], []
    for start in range(0, length - 1, chunk_size):
        end = min(start + chunk_size, length - 1)
        args = (logits[:, start:end], input_ids[:, start + 1 : end + 1], temperature, with_entropy)
        out = (
            checkpoint(_chunk_logprobs, *args, use_reentrant=False)
            if use_checkpoint
            else _chunk_logprobs(*args)
        )
        if with_entropy:
            logp_chunks.append(out[0])
            entropy_chunks.append(out[1])
        else:
            logp_chunks.append(out)

    zeros = logits.new_zeros((batch, 1), dtype=torch.float32)
    attended = attention_mask.bool() & (position_ids > 0)
    logprobs = torch.cat([zeros, *logp_chunks], dim=1)
    logprobs = torch.where(attended, logprobs, torch.zeros_like(logprobs))
    entropy = None
    if with_entropy:
        entropy = torch.cat([zeros, *entropy_chunks], dim=1)
        entropy = torch.where(attended, entropy, torch.zeros_like(entropy))
    return logprobs, entropy
