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

Only the logits that are read. Given a ``loss_mask`` (the tokens a loss reads), the output head and the
log-softmax run only from the batch's first position that predicts such a token (HF's ``logits_to_keep``, which
keeps the last N positions): the prompt positions before it are never computed (a longer prompt in the same
micro-batch still runs the head past that column). On SmolLM2 the 49k-token head is a fifth of a
forward's FLOPs and a prompt is about half of a sequence. Positions before that one get 0, which the loss never
reads. A model whose ``forward`` takes no ``logits_to_keep`` computes every position, as before.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 1024
MAX_SHARED_MASK_ENTRIES = 1 << 26
"""Largest [G, L', L'] block mask `shared_prefix_token_logprobs` builds (64M entries: 256 MB as float32)."""


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position of each token among the attended tokens of its row: 0, 1, 2, ... (pads get 0)."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


@cache
def _takes_logits_to_keep(forward_type: type) -> bool:
    return "logits_to_keep" in inspect.signature(forward_type.forward).parameters


def _model_logits(model: torch.nn.Module, keep: int, **inputs: Tensor) -> Tensor:
    """``model(**inputs).logits`` of the last ``keep`` positions: the model computes only those when its forward
    takes ``logits_to_keep``; otherwise (or if it computed more anyway) the leading ones are sliced off here."""
    length = inputs["input_ids"].shape[1]
    if keep < length and _takes_logits_to_keep(type(model)):
        logits = model(**inputs, logits_to_keep=keep).logits
    else:
        logits = model(**inputs).logits
    if logits.shape[1] < keep:
        raise ValueError(
            f"the model returned logits for {logits.shape[1]} positions, fewer than the {keep} asked of it "
            f"(logits_to_keep={keep})"
        )
    return logits[:, logits.shape[1] - keep :]


def _first_predictor(loss_mask: Tensor | None) -> int:
    """The first column whose logits predict a ``loss_mask`` token (0 without a mask, or when none is set)."""
    if loss_mask is None or not loss_mask[:, 1:].any():
        return 0
    return int(loss_mask[:, 1:].any(0).nonzero()[0])


def _chunk_logprobs(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
    """log-softmax of one chunk in float32: target logprobs [B, C] and (optionally) entropies [B, C]."""
    scaled = logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return token_logp
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def _check_sampling_args(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the sampling temperature); got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")


def _chunked_logprobs(pieces, temperature: float, with_entropy: bool, use_checkpoint: bool):
    """`_chunk_logprobs` over (logits, targets) chunks, each under activation checkpointing when gradients are
    needed; returns the lists of logprob chunks and of entropy chunks (empty without `with_entropy`)."""
    logp_chunks, entropy_chunks = [], []
    for logits, targets in pieces:
        args = (logits, targets, temperature, with_entropy)
        out = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if use_checkpoint else _chunk_logprobs(*args)
        logp_chunks.append(out[0] if with_entropy else out)
        if with_entropy:
            entropy_chunks.append(out[1])
    return logp_chunks, entropy_chunks


def token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    loss_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token logprobs [B, L] (float32) and, if ``with_entropy``, entropies [B, L] of any HF causal LM.

    ``input_ids`` and ``attention_mask`` are [B, L]; padding may be on either side. See the module docstring
    for the index convention (index ``t`` is the logprob of token ``t``; index 0 is 0). Gradients flow to the
    model through the logprobs and the entropy. With a ``loss_mask`` [B, L], columns before the first one that
    any row's mask sets are 0 (their logits are not computed); every column from there on is as without it.
    """
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, L]; got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    if loss_mask is not None and loss_mask.shape != input_ids.shape:
        raise ValueError(f"loss_mask must be [B, L] like input_ids; got {tuple(loss_mask.shape)}")
    _check_sampling_args(temperature, chunk_size)

    batch, length = input_ids.shape
    first = _first_predictor(loss_mask)
    position_ids = position_ids_from_mask(attention_mask)
    logits = _model_logits(
        model, length - first, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    )  # [B, L - first, V]; logits[:, t] predicts input_ids[:, first + t + 1]

    predicting, predicted = logits[:, :-1], input_ids[:, first + 1 :]
    pieces = (
        (predicting[:, start : start + chunk_size], predicted[:, start : start + chunk_size])
        for start in range(0, length - first - 1, chunk_size)
    )
    use_checkpoint = torch.is_grad_enabled() and logits.requires_grad
    logp_chunks, entropy_chunks = _chunked_logprobs(pieces, temperature, with_entropy, use_checkpoint)

    zeros = logits.new_zeros((batch, first + 1), dtype=torch.float32)
    attended = attention_mask.bool() & (position_ids > 0)
    logprobs = torch.cat([zeros, *logp_chunks], dim=1)
    logprobs = torch.where(attended, logprobs, torch.zeros_like(logprobs))
    entropy = None
    if with_entropy:
        entropy = torch.cat([zeros, *entropy_chunks], dim=1)
        entropy = torch.where(attended, entropy, torch.zeros_like(entropy))
    return logprobs, entropy


# --- Shared prompts: one forward per group instead of one per sequence --------------------------------------
#
# The n completions of a group share their prompt token for token, and a causal model computes identical
# hidden states for identical prefixes. So a group can run as one packed sequence: the prompt once, then each
# completion after it, each attending to the prompt and causally to itself only (a block mask), with the
# positions it would have had in its own row. Every completion token then sees exactly the context it sees in
# the padded batch, so the logprobs are the same (up to float summation order) while the prompt's n - 1
# copies are never computed. On the quickstart (6-token prompts, 3-token completions, n = 8) this cuts the
# tokens of a forward and backward by about 2.5x.


@dataclass(frozen=True)
class SharedPrefixPlan:
    """How the rows of a right-padded [B, L] batch pack into G sequences of L' tokens, one per shared prefix.

    A row's prefix is everything before its first `loss_mask` token (the prompt); its suffix is every attended
    token from there on. Rows whose prefixes are equal token for token share one packed sequence. Rows with no
    `loss_mask` token (a padding micro-batch) are left out: nothing in them is trained.
    """

    input_ids: Tensor  # [G, L'] packed tokens (pad 0 past each group's end)
    position_ids: Tensor  # [G, L'] each token's position in its own row
    allowed: Tensor  # [G, L', L'] bool: query i may attend key j
    row: Tensor  # [N] for every suffix token: its row in the batch,
    col: Tensor  # [N] its column there,
    group: Tensor  # [N] its packed sequence,
    packed_col: Tensor  # [N] its column in that sequence,
    predictor: Tensor  # [N] and the packed column whose logits predict it.


def shared_prefix_plan(input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor) -> SharedPrefixPlan:
    """The packing of a right-padded batch by shared prompt (see `SharedPrefixPlan`). Pure bookkeeping, CPU."""
    ids, attended, trained = input_ids.cpu(), attention_mask.cpu().bool(), loss_mask.cpu().bool()
    if (attended.long().cummin(1).values != attended.long()).any():
        raise ValueError("shared prompts need right-padded rows (attention_mask 1...1 0...0 in every row)")
    groups: dict[tuple[int, ...], list[int]] = {}
    for b in range(ids.shape[0]):
        if trained[b].any():
            start = int(trained[b].nonzero()[0])
            groups.setdefault(tuple(ids[b, :start].tolist()), []).append(b)
    lengths = attended.sum(1).tolist()
    sizes = [len(p) + sum(lengths[b] - len(p) for b in rows) for p, rows in groups.items()]
    width = max(sizes, default=1)
    entries = len(groups) * width * width
    if entries > MAX_SHARED_MASK_ENTRIES:  # checked before anything that size is allocated
        raise ValueError(
            f"trainer.share_prompts would build a {len(groups)}x{width}x{width} attention mask ({entries:,} "
            f"entries, limit {MAX_SHARED_MASK_ENTRIES:,}): packing a group's completions after one prompt pays "
            "for short completions; set trainer.share_prompts=false or lower trainer.micro_batch_size"
        )
    packed = torch.zeros((len(groups), width), dtype=torch.long)
    positions = torch.zeros((len(groups), width), dtype=torch.long)
    allowed = torch.eye(width, dtype=torch.bool).repeat(len(groups), 1, 1)  # padding attends to itself
    row, col, group, packed_col, predictor = [], [], [], [], []
    for g, (prefix, rows) in enumerate(groups.items()):
        p = len(prefix)
        packed[g, :p] = torch.tensor(prefix, dtype=torch.long)
        positions[g, :p] = torch.arange(p)
        allowed[g, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
        q = p
        for b in rows:
            r = lengths[b] - p
            packed[g, q : q + r] = ids[b, p : p + r]
            positions[g, q : q + r] = torch.arange(p, p + r)
            allowed[g, q : q + r, :p] = True
            allowed[g, q : q + r, q : q + r] = torch.ones(r, r, dtype=torch.bool).tril()
            row += [b] * r
            col += range(p, p + r)
            group += [g] * r
            packed_col += range(q, q + r)
            predictor += [p - 1, *range(q, q + r - 1)]  # the prompt's last token predicts the first one
            q += r
    index = [torch.tensor(values, dtype=torch.long) for values in (row, col, group, packed_col, predictor)]
    return SharedPrefixPlan(packed, positions, allowed, *index)


def shared_prefix_token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` with each group's shared prompt computed once (module comment above).

    Same [B, L] outputs on every suffix token (from a row's first `loss_mask` token to its last attended one);
    0 on the prompt and on padding, which the objective never reads. Needs right-padded rows and a model whose
    attention takes a 4D mask (HF `sdpa` or `eager`; not `flash_attention_*`).
    """
    if input_ids.dim() != 2 or not input_ids.shape == attention_mask.shape == loss_mask.shape:
        raise ValueError(
            f"input_ids, attention_mask and loss_mask must all be [B, L]; got {tuple(input_ids.shape)}, "
            f"{tuple(attention_mask.shape)} and {tuple(loss_mask.shape)}"
        )
    _check_sampling_args(temperature, chunk_size)
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attn is not None and attn not in ("sdpa", "eager"):
        raise ValueError(
            f"trainer.share_prompts needs an attention that takes a 4D mask (sdpa or eager); this model uses "
            f"{attn!r}: set trainer.share_prompts=false"
        )
    if loss_mask[:, 0].any():
        raise ValueError("loss_mask[:, 0] is set: nothing predicts a row's first token, so it cannot be trained")
    if not loss_mask.any():
        # Nothing to pack (a padding micro-batch), but under FSDP2 every rank must still run the forward.
        return token_logprobs(model, input_ids, attention_mask, temperature=temperature,
                              with_entropy=with_entropy, chunk_size=chunk_size)  # fmt: skip
    plan = shared_prefix_plan(input_ids, attention_mask, loss_mask)
    device = input_ids.device
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=device)
    entropy_out = torch.zeros_like(out) if with_entropy else None
    # sdpa takes the boolean mask whatever the compute dtype (bf16 under FSDP2 mixed precision); eager attention
    # adds the mask to its scores, so it gets the additive float form.
    mask = plan.allowed if attn != "eager" else torch.zeros(plan.allowed.shape).masked_fill_(
        ~plan.allowed, torch.finfo(torch.float32).min)  # fmt: skip
    first = int(plan.predictor.min())  # the head runs from the first column that predicts a suffix token
    logits = _model_logits(
        model,
        plan.input_ids.shape[1] - first,
        input_ids=plan.input_ids.to(device),
        attention_mask=mask[:, None].to(device),
        position_ids=plan.position_ids.to(device),
    )  # [G, L' - first, V]
    group, predictor = plan.group.to(device), (plan.predictor - first).to(device)
    targets = input_ids[plan.row.to(device), plan.col.to(device)]
    pieces = (
        (logits[group[start : start + chunk_size], predictor[start : start + chunk_size]][None],
         targets[start : start + chunk_size][None])
        for start in range(0, targets.numel(), chunk_size)
    )  # fmt: skip
    use_checkpoint = torch.is_grad_enabled() and logits.requires_grad
    logp_chunks, entropy_chunks = _chunked_logprobs(pieces, temperature, with_entropy, use_checkpoint)
    index = (plan.row.to(device), plan.col.to(device))
    out = out.index_put(index, torch.cat(logp_chunks, dim=1)[0])
    if with_entropy:
        entropy_out = entropy_out.index_put(index, torch.cat(entropy_chunks, dim=1)[0])
    return out, entropy_out
