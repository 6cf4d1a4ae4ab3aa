"""token_logprobs on a tiny random Qwen2: index convention, padding invariance, temperature, entropy, chunking."""

import pytest
import torch

from tests.helpers import random_qwen2
from trainer import logprobs as logprobs_module
from trainer.logprobs import shared_prefix_plan, shared_prefix_token_logprobs, token_logprobs

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return random_qwen2(0, vocab_size=VOCAB)


def _sequences(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in (7, 4, 10)]


def _pad(seqs: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(length - len(s), length)
        ids[i, cols] = s
        mask[i, cols] = 1
    return ids, mask


def _direct_log_softmax(model, seq: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of one unpadded sequence: log_softmax(logits[t-1] / T)[token t], with index 0 = 0."""
    logits = model(input_ids=seq[None]).logits[0].float() / temperature
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, seq[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), logp])


@torch.no_grad()
def test_logprobs_equal_direct_log_softmax_gather(model):
    seqs = _sequences()
    ids, mask = _pad(seqs, "right")
    logprobs, entropy = token_logprobs(model, ids, mask)
    assert entropy is None
    assert logprobs.dtype == torch.float32 and logprobs.shape == ids.shape
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(
            logprobs[i, : len(seq)], _direct_log_softmax(model, seq), atol=1e-5, rtol=0
        )
        assert torch.all(logprobs[i, len(seq) :] == 0)  # padding
    assert torch.all(logprobs[:, 0] == 0)
    assert torch.all(logprobs[mask.bool() & (torch.arange(ids.shape[1]) > 0)] < 0)


@torch.no_grad()
def test_left_and_right_padding_agree_on_valid_tokens(model):
    seqs = _sequences()
    right, _ = token_logprobs(model, *_pad(seqs, "right"), with_entropy=True)
    left, _ = token_logprobs(model, *_pad(seqs, "left"), with_entropy=True)
    length = right.shape[1]
    for i, seq in enumerate(seqs):
        n = len(seq)
        torch.testing.assert_close(left[i, length - n :], right[i, :n], atol=1e-5, rtol=0)
        assert torch.all(left[i, : length - n] == 0)


@torch.no_grad()
def test_temperature_scales_the_logits(model):
    seqs = _sequences()
    ids, mask = _pad(seqs, "right")
    logprobs, _ = token_logprobs(model, ids, mask, temperature=0.7)
    for i, seq in enumerate(seqs):
        expected = _direct_log_softmax(model, seq, temperature=0.7)
        torch.testing.assert_close(logprobs[i, : len(seq)], expected, atol=1e-5, rtol=0)
    plain, _ = token_logprobs(model, ids, mask)
    assert not torch.allclose(plain, logprobs)


@torch.no_grad()
def test_entropy_matches_a_direct_computation(model):
    seqs = _sequences()
    ids, mask = _pad(seqs, "right")
    _, entropy = token_logprobs(model, ids, mask, temperature=1.3, with_entropy=True)
    for i, seq in enumerate(seqs):
        probs = torch.softmax(model(input_ids=seq[None]).logits[0, :-1].float() / 1.3, dim=-1)
        expected = -(probs * probs.log()).sum(-1)
        torch.testing.assert_close(entropy[i, 1 : len(seq)], expected, atol=1e-5, rtol=0)
        assert entropy[i, 0] == 0 and torch.all(entropy[i, len(seq) :] == 0)
    assert torch.all(entropy[mask.bool()][1:] <= torch.log(torch.tensor(float(VOCAB))) + 1e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_chunking_changes_neither_values_nor_gradients(model, chunk_size):
    ids, mask = _pad(_sequences(), "right")

    def run(chunk):
        model.zero_grad()
        logprobs, entropy = token_logprobs(model, ids, mask, with_entropy=True, chunk_size=chunk)
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        return logprobs.detach(), entropy.detach(), grads

    ref_lp, ref_ent, ref_grads = run(ids.shape[1])
    lp, ent, grads = run(chunk_size)
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=0)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in grads)
    model.zero_grad()


def test_left_padding_gradients_are_finite(model):
    """A left-padded row starts with pad queries that attend to nothing; no NaN may leak into gradients."""
    ids, mask = _pad(_sequences(), "left")
    model.zero_grad()
    logprobs, entropy = token_logprobs(model, ids, mask, with_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.zero_grad()


def test_bad_inputs_raise(model):
    ids, mask = _pad(_sequences(), "right")
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, mask, temperature=0.0)
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        token_logprobs(model, ids, mask[:, :-1])


# --- shared prompts: one packed sequence per group ----------------------------------------------------------


def _grouped_batch(seed: int = 3):
    """Right-padded rows: three prompts (3, 5 and 3 tokens; the third starts like the first) shared by 3, 2 and
    2 rows in interleaved order, completions of 1-6 tokens; loss_mask on the completions."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (3, 5, 3)]
    prompts[2][:2] = prompts[0][:2]  # same first two tokens, different third: a different group
    which = [0, 1, 0, 2, 1, 0, 2]
    rows = [torch.cat([prompts[w], torch.randint(1, VOCAB, (int(torch.randint(1, 7, (1,), generator=gen)),),
                                                 generator=gen)]) for w in which]  # fmt: skip
    ids, mask = _pad(rows, "right")
    loss_mask = torch.zeros_like(mask, dtype=torch.bool)
    for i, w in enumerate(which):
        loss_mask[i, len(prompts[w]) : len(rows[i])] = True
    return ids, mask, loss_mask, prompts, which


def test_shared_prefix_plan_packs_each_prompt_once():
    ids, mask, loss_mask, prompts, which = _grouped_batch()
    plan = shared_prefix_plan(ids, mask, loss_mask)
    assert plan.input_ids.shape[0] == 3  # one packed sequence per distinct prompt
    # every prompt once, every completion token once (real tokens are >= 1, packing pads with 0)
    assert int((plan.input_ids != 0).sum()) == sum(len(p) for p in prompts) + int(loss_mask.sum())
    assert sorted(zip(plan.row.tolist(), plan.col.tolist(), strict=True)) == [tuple(x) for x in loss_mask.nonzero().tolist()]
    # each completion token sits in its group with its own token and its own row's position
    assert torch.equal(plan.input_ids[plan.group, plan.packed_col], ids[plan.row, plan.col])
    assert torch.equal(plan.position_ids[plan.group, plan.packed_col], plan.col)
    # and sees its prompt and the earlier tokens of its own completion, nothing else
    for g, q, r in zip(plan.group.tolist(), plan.packed_col.tolist(), plan.row.tolist(), strict=True):
        own = [pc for gg, pc, rr in zip(plan.group.tolist(), plan.packed_col.tolist(), plan.row.tolist(),
                                        strict=True) if gg == g and rr == r and pc <= q]  # fmt: skip
        assert plan.allowed[g, q].nonzero().flatten().tolist() == list(range(len(prompts[which[r]]))) + own
        # predicted by the token before it in its own row: the prompt's last token for the first one
        predictor = int(plan.predictor[(plan.group == g) & (plan.packed_col == q)])
        assert int(plan.position_ids[g, predictor]) == int(plan.position_ids[g, q]) - 1


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # a boolean mask for sdpa, an additive one for eager
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefix_logprobs_match_the_padded_rows(temperature, attention):
    model = random_qwen2(0, vocab_size=VOCAB, attn_implementation=attention)
    ids, mask, loss_mask, _, _ = _grouped_batch()
    with torch.no_grad():
        plain, plain_entropy = token_logprobs(model, ids, mask, temperature=temperature, with_entropy=True)
        shared, shared_entropy = shared_prefix_token_logprobs(
            model, ids, mask, loss_mask, temperature=temperature, with_entropy=True
        )
    torch.testing.assert_close(shared[loss_mask], plain[loss_mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared_entropy[loss_mask], plain_entropy[loss_mask], atol=1e-5, rtol=0)
    assert torch.all(shared[~loss_mask] == 0) and torch.all(shared_entropy[~loss_mask] == 0)


def test_shared_prefix_gradients_match_the_padded_rows():
    ids, mask, loss_mask, _, _ = _grouped_batch()
    grads = []
    for fn in ("plain", "shared"):
        model = random_qwen2(0, vocab_size=VOCAB)
        if fn == "plain":
            logprobs, entropy = token_logprobs(model, ids, mask, with_entropy=True)
        else:
            logprobs, entropy = shared_prefix_token_logprobs(model, ids, mask, loss_mask, with_entropy=True)
        weights = torch.linspace(-1, 1, ids.numel()).reshape(ids.shape)
        (logprobs * weights + 0.1 * entropy)[loss_mask].sum().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for key in grads[0]:
        torch.testing.assert_close(grads[1][key], grads[0][key], atol=1e-5, rtol=1e-4, msg=key)


def test_shared_prefix_rejects_left_padding_and_oversized_masks(model, monkeypatch):
    ids, mask, loss_mask, _, _ = _grouped_batch()
    left = torch.roll(mask, shifts=1, dims=1)
    left[:, 0] = 0
    with pytest.raises(ValueError, match="right-padded"):
        shared_prefix_token_logprobs(model, ids, left, loss_mask & left.bool())
    monkeypatch.setattr(logprobs_module, "MAX_SHARED_MASK_ENTRIES", 10)
    with pytest.raises(ValueError, match="share_prompts=false"):
        shared_prefix_token_logprobs(model, ids, mask, loss_mask)


def test_shared_prefix_with_nothing_trained_still_runs_the_model(model):
    ids, mask, loss_mask, _, _ = _grouped_batch()
    logprobs, _ = shared_prefix_token_logprobs(model, ids, mask, torch.zeros_like(loss_mask))
    assert logprobs.requires_grad  # the forward ran (FSDP2 ranks must all run it), values unused


# --- only the logits that are read: the head skips what precedes the first trained token --------------------


def _head_positions(model) -> list[int]:
    """Record how many positions each forward sends through the output head (a hook, not a replacement)."""
    seen: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[-2]))
    return seen


class _NoLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward takes no `logits_to_keep` (older or custom models)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, position_ids):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


class _IgnoresLogitsToKeep(_NoLogitsToKeep):
    """A forward that takes `logits_to_keep` and computes every position anyway."""

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep=0):
        return super().forward(input_ids, attention_mask, position_ids)


@pytest.mark.parametrize("wrapper", [None, _NoLogitsToKeep, _IgnoresLogitsToKeep])
def test_loss_mask_skips_the_head_before_the_first_trained_token(wrapper):
    ids, mask, loss_mask, prompts, _ = _grouped_batch()
    first = min(len(p) for p in prompts) - 1  # the shortest prompt's last token predicts the first trained one
    results = []
    for given in (None, loss_mask):
        base = random_qwen2(0, vocab_size=VOCAB)
        seen = _head_positions(base)
        model = wrapper(base) if wrapper else base
        logprobs, entropy = token_logprobs(model, ids, mask, with_entropy=True, loss_mask=given)
        weights = torch.linspace(-1, 1, ids.numel()).reshape(ids.shape)
        (logprobs * weights + 0.1 * entropy)[loss_mask].sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        results.append((logprobs.detach(), entropy.detach(), grads, seen))
    (plain, plain_entropy, plain_grads, plain_seen), (kept, kept_entropy, kept_grads, kept_seen) = results
    assert plain_seen == [ids.shape[1]]
    assert kept_seen == [ids.shape[1] if wrapper else ids.shape[1] - first]
    torch.testing.assert_close(kept[:, first + 1 :], plain[:, first + 1 :], atol=1e-5, rtol=0)
    torch.testing.assert_close(kept_entropy[:, first + 1 :], plain_entropy[:, first + 1 :], atol=1e-5, rtol=0)
    assert torch.all(kept[:, : first + 1] == 0) and torch.all(kept_entropy[:, : first + 1] == 0)
    assert loss_mask[:, : first + 1].sum() == 0 and loss_mask[:, first + 1].any()
    for key in plain_grads:
        torch.testing.assert_close(kept_grads[key], plain_grads[key], atol=1e-5, rtol=1e-4, msg=key)


def test_shared_prefix_runs_the_head_from_the_first_predictor_only():
    ids, mask, loss_mask, prompts, _ = _grouped_batch()
    model = random_qwen2(0, vocab_size=VOCAB)
    seen = _head_positions(model)
    with torch.no_grad():
        shared, _ = shared_prefix_token_logprobs(model, ids, mask, loss_mask)
        plain, _ = token_logprobs(model, ids, mask)
    width = shared_prefix_plan(ids, mask, loss_mask).input_ids.shape[1]
    assert seen == [width - (min(len(p) for p in prompts) - 1), ids.shape[1]]
    torch.testing.assert_close(shared[loss_mask], plain[loss_mask], atol=1e-5, rtol=0)


def test_a_loss_mask_of_the_wrong_shape_or_on_the_first_token_raises(model):
    ids, mask = _pad(_sequences(), "right")
    with pytest.raises(ValueError, match="loss_mask"):
        token_logprobs(model, ids, mask, loss_mask=mask[:, :-1].bool())
    with pytest.raises(ValueError, match=r"loss_mask\[:, 0\]"):
        shared_prefix_token_logprobs(model, ids, mask, mask.bool())
    # no trained token at all: every position is computed, as without a mask
    logprobs, _ = token_logprobs(model, ids, mask, loss_mask=torch.zeros_like(mask, dtype=torch.bool))
    torch.testing.assert_close(logprobs, token_logprobs(model, ids, mask)[0], atol=0, rtol=0)
