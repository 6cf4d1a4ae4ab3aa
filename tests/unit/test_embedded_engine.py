"""EmbeddedEngine on a tiny random Qwen2 built in code: logprobs, determinism, stopping, weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from app.rollout.base import RolloutEngine, SamplingParams, WeightSource
from app.rollout.embedded import EmbeddedEngine
from tests.helpers import random_qwen2

VOCAB, EOS, PAD = 64, 1, 0
PROMPTS = [[5, 9, 13], [7, 3, 22, 41, 8, 17, 30], [2, 60, 11, 45, 33, 19, 4, 27, 50, 12, 6, 38]]


def tiny_model(seed: int = 0, max_positions: int = 64) -> Qwen2ForCausalLM:
    # initializer_range 0.3: peaked distributions, so greedy has clear winners and sampling is not uniform.
    return random_qwen2(seed, vocab_size=VOCAB, max_position_embeddings=max_positions, initializer_range=0.3,
                        tie_word_embeddings=True, eos_token_id=EOS, pad_token_id=PAD)


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    return tiny_model()


@pytest.fixture
def engine(model) -> EmbeddedEngine:
    return EmbeddedEngine(model, eos_token_id=EOS, pad_token_id=PAD)


def greedy(max_new_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kw)


def recomputed_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """Full forward over prompt + output, alone (no padding, no cache): logprob of each output token."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 0.6), (0.0, 1.0)])
def test_logprobs_match_a_recomputed_forward_for_a_left_padded_batch(model, engine, temperature, top_p):
    params = SamplingParams(max_new_tokens=6, temperature=temperature, top_p=top_p, n=2, seed=3)
    completions = engine.generate_sync(PROMPTS, params)
    assert len(completions) == len(PROMPTS) * 2
    for c in completions:
        assert len(c.output_ids) == len(c.output_logprobs) >= 1
        expected = recomputed_logprobs(model, c.prompt_ids, c.output_ids, temperature or 1.0)
        torch.testing.assert_close(torch.tensor(c.output_logprobs), expected, atol=1e-5, rtol=0)


def test_logprobs_stay_exact_when_sequences_finish_at_different_steps(model, engine):
    # A third of the vocabulary stops: rows leave the batch (and its KV cache) at different steps.
    stops = tuple(range(2, 24))
    params = SamplingParams(max_new_tokens=10, temperature=1.0, n=6, stop_token_ids=stops, seed=11)
    completions = engine.generate_sync(PROMPTS, params)
    lengths = {len(c.output_ids) for c in completions}
    assert len(lengths) >= 3 and any(c.finish_reason == "length" for c in completions)
    for c in completions:
        assert all(t not in stops for t in c.output_ids[:-1])
        assert (c.output_ids[-1] in stops) == (c.finish_reason == "stop")
        expected = recomputed_logprobs(model, c.prompt_ids, c.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(c.output_logprobs), expected, atol=1e-5, rtol=0)


def test_greedy_batched_equals_one_by_one(engine):
    batched = engine.generate_sync(PROMPTS, greedy())
    for prompt, c in zip(PROMPTS, batched, strict=True):
        [alone] = engine.generate_sync([prompt], greedy())
        assert c.output_ids == alone.output_ids
        assert c.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)


def test_same_seed_same_outputs_different_seed_different(engine):
    def run(seed):
        params = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, seed=seed)
        return [c.output_ids for c in engine.generate_sync(PROMPTS, params)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_finish_reasons_stop_and_length(model, engine):
    [free] = engine.generate_sync([PROMPTS[1]], greedy(8))
    assert free.finish_reason == "length" and len(free.output_ids) == 8
    stop = free.output_ids[3]
    first = free.output_ids.index(stop)
    eos_engine = EmbeddedEngine(model, eos_token_id=stop, pad_token_id=PAD)
    [c] = eos_engine.generate_sync([PROMPTS[1]], greedy(8))
    assert c.finish_reason == "stop"
    assert c.output_ids == free.output_ids[: first + 1]  # the stop token is kept, with its logprob
    assert c.output_logprobs == pytest.approx(free.output_logprobs[: first + 1], abs=1e-5)
    assert c.meta == {"prompt_tokens": len(PROMPTS[1]), "completion_tokens": first + 1}


def test_stop_token_ids_are_honoured(engine):
    free = engine.generate_sync(PROMPTS, greedy(8))
    stop = free[0].output_ids[2]
    stopped = engine.generate_sync(PROMPTS, greedy(8, stop_token_ids=(stop,)))
    for f, s in zip(free, stopped, strict=True):
        if stop in f.output_ids:
            assert s.output_ids == f.output_ids[: f.output_ids.index(stop) + 1] and s.finish_reason == "stop"
        else:
            assert s.output_ids == f.output_ids and s.finish_reason == "length"


def test_pad_token_sampled_mid_sequence_is_an_ordinary_token(model, engine):
    [free] = engine.generate_sync([PROMPTS[2]], greedy(8))
    pad_like = free.output_ids[1]
    other = EmbeddedEngine(model, eos_token_id=EOS, pad_token_id=pad_like)
    [c] = other.generate_sync([PROMPTS[2]], greedy(8))
    assert c.output_ids == free.output_ids and c.finish_reason == "length"


def test_max_position_embeddings_caps_the_output():
    short = EmbeddedEngine(tiny_model(max_positions=16), eos_token_id=EOS, pad_token_id=PAD)
    completions = short.generate_sync([PROMPTS[1], PROMPTS[2]], greedy(50))
    assert [len(c.output_ids) for c in completions] == [16 - 7, 16 - 12]
    assert all(c.finish_reason == "length" for c in completions)
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        short.generate_sync([list(range(2, 18))], greedy())


def test_the_output_head_gets_one_contiguous_position_per_row_in_bfloat16():
    """The prefill's last positions reach the head as a contiguous [B, 1, H]: torch's CPU bf16 linear expands the
    head's weight per row for a strided view (13.6 GB and 160x the time for 240 SmolLM2 prompts)."""
    model = tiny_model().to(torch.bfloat16)
    engine = EmbeddedEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    seen = []
    engine.model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: seen.append((tuple(args[0].shape), args[0].is_contiguous()))
    )
    completions = engine.generate_sync(PROMPTS, greedy(max_new_tokens=4, n=2))
    assert len(completions) == 2 * len(PROMPTS) and len(seen) >= 2
    assert seen[0] == ((len(PROMPTS), 1, model.config.hidden_size), True)  # the prefill of the distinct prompts
    assert all(contiguous and shape[1] == 1 for shape, contiguous in seen), seen


def test_n_samples_are_prompt_major(engine):
    completions = engine.generate_sync(PROMPTS[:2], SamplingParams(max_new_tokens=5, n=3, seed=0))
    assert [c.prompt_ids for c in completions] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert len({tuple(c.output_ids) for c in completions[:3]}) > 1  # samples of one prompt differ


def test_tiny_top_p_is_greedy(engine):
    nucleus = engine.generate_sync(PROMPTS, SamplingParams(max_new_tokens=8, top_p=1e-6, n=2, seed=5))
    exact = engine.generate_sync(PROMPTS, greedy(8, n=2))
    assert [c.output_ids for c in nucleus] == [c.output_ids for c in exact]
    for a, b in zip(nucleus, exact, strict=True):
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-6)


def test_chunking_equals_one_chunk_for_greedy(model, engine):
    small = EmbeddedEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_batch_size=2)
    params = greedy(6, n=3)
    one, chunked = engine.generate_sync(PROMPTS, params), small.generate_sync(PROMPTS, params)
    assert [c.prompt_ids for c in chunked] == [c.prompt_ids for c in one]
    assert [c.output_ids for c in chunked] == [c.output_ids for c in one]
    for a, b in zip(one, chunked, strict=True):
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)


def test_update_weights_from_state_dict_changes_outputs_and_version(engine):
    other = tiny_model(seed=1)
    before = engine.generate_sync(PROMPTS, greedy())
    asyncio.run(engine.update_weights(WeightSource(state_dict=other.state_dict()), version=7))
    after = engine.generate_sync(PROMPTS, greedy())
    reference = EmbeddedEngine(other, eos_token_id=EOS, pad_token_id=PAD).generate_sync(PROMPTS, greedy())
    assert [c.output_ids for c in after] != [c.output_ids for c in before]
    assert [c.output_ids for c in after] == [c.output_ids for c in reference]
    assert {c.policy_version for c in before} == {0} and {c.policy_version for c in after} == {7}
    # A partial state dict is rejected before anything is copied: weights and version stay.
    partial = {"model.embed_tokens.weight": torch.zeros(VOCAB, 32)}
    with pytest.raises(ValueError, match="missing \\['model.layers.0"):
        engine.update_weights_sync(WeightSource(state_dict=partial), 8)
    assert [(c.output_ids, c.policy_version) for c in engine.generate_sync(PROMPTS, greedy())] == [
        (c.output_ids, 7) for c in after
    ]


def test_update_weights_from_directory_and_from_pretrained(engine, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    other = tiny_model(seed=2)
    other.save_pretrained(tmp_path)  # tied embeddings: lm_head.weight is not in the file
    vocab = {"<pad>": PAD, "</s>": EOS, **{f"t{i}": i for i in range(2, VOCAB)}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.save_pretrained(tmp_path)

    before = engine.generate_sync(PROMPTS, greedy())
    asyncio.run(engine.update_weights(WeightSource(path=tmp_path), version=3))
    after = engine.generate_sync(PROMPTS, greedy())
    loaded = EmbeddedEngine.from_pretrained(tmp_path, policy_version=3)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (EOS, PAD)
    assert [c.output_ids for c in after] != [c.output_ids for c in before]
    assert [c.output_ids for c in after] == [c.output_ids for c in loaded.generate_sync(PROMPTS, greedy())]
    assert {c.policy_version for c in after} == {3}

    wrong = tmp_path / "wrong"
    Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(wrong)
    with pytest.raises(ValueError, match="model.embed_tokens.weight: \\(64, 16\\) != \\(64, 32\\)"):
        engine.update_weights_sync(WeightSource(path=wrong), 4)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        engine.update_weights_sync(WeightSource(path=tmp_path / "missing"), 4)


def test_engine_weights_are_independent_of_the_source_model():
    source = tiny_model(seed=4)
    engine = EmbeddedEngine(source, eos_token_id=EOS, pad_token_id=PAD)
    before = engine.generate_sync(PROMPTS, greedy())
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p))
    assert [c.output_ids for c in engine.generate_sync(PROMPTS, greedy())] == [c.output_ids for c in before]
    engine_ptrs = {p.data_ptr() for p in engine.model.parameters()}
    assert engine_ptrs.isdisjoint(p.data_ptr() for p in source.parameters())
    assert not any(p.requires_grad for p in engine.model.parameters()) and not engine.model.training


def test_async_protocol(engine):
    assert isinstance(engine, RolloutEngine)
    params = SamplingParams(max_new_tokens=4, n=2, seed=9)
    completions = asyncio.run(engine.generate(PROMPTS, params))
    assert [c.output_ids for c in completions] == [
        c.output_ids for c in engine.generate_sync(PROMPTS, params)
    ]
    assert asyncio.run(engine.health()) is True


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n must be"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_and_sources_are_rejected(engine):
    with pytest.raises(ValueError, match="prompts\\[1\\] is empty"):
        engine.generate_sync([[3], []], greedy())
    with pytest.raises(ValueError, match="outside \\[0, 64\\)"):
        engine.generate_sync([[3, VOCAB]], greedy())
    with pytest.raises(ValueError, match="exactly one"):
        WeightSource()


def test_scheduler_stops_when_the_stop_meets_a_request_waking_it(engine):
    """A stop() that arrives in the same event-loop turn as a request waking the batch-window wait ends the
    scheduler. With asyncio.wait_for on Python 3.11 the cancellation was swallowed (the wait had completed) and
    the loop ran on forever; the same race hung a training run at shutdown in its rollout watchdog."""
    from app.serving.scheduler import Scheduler

    async def scenario() -> list:
        scheduler = Scheduler(engine, max_batch_size=64, batch_window_s=600.0)
        scheduler.start()
        first = scheduler.enqueue(PROMPTS[0], greedy(2))
        for _ in range(5):
            await asyncio.sleep(0)  # the loop is now in its batch-window wait, for up to 600 s
        assert scheduler.alive and not first.done()
        scheduler.enqueue(PROMPTS[1], greedy(2))  # wakes the wait ...
        stopping = asyncio.ensure_future(scheduler.stop())  # ... and the stop arrives in the same turn
        await asyncio.wait([stopping], timeout=60)  # a hang detector, not a speed bound: stop() takes no time
        if not stopping.done():
            scheduler._task.cancel()  # a second cancel lands (the loop is in its idle wait): clean up, then fail
            await stopping
            pytest.fail("Scheduler.stop() did not return: its cancellation was swallowed and the loop ran on")
        return [scheduler.alive, first.done()]

    alive, generated = asyncio.run(scenario())
    assert not alive and not generated  # stopped inside the window: nothing ran


def test_progress_counts_each_sequence_as_it_finishes_without_changing_the_samples(engine):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, n=5, seed=2)
    small = EmbeddedEngine(engine.model, eos_token_id=EOS, pad_token_id=PAD, max_batch_size=4)  # 4 chunks
    reports: list[int] = []
    with_progress = small.generate_sync(PROMPTS, params, progress=reports.append)
    assert sum(reports) == len(PROMPTS) * 5 and all(k >= 1 for k in reports)
    # Sequences of one chunk finish at different steps, so some chunk reports more than once.
    assert len(reports) > 4
    plain = small.generate_sync(PROMPTS, params)
    assert [c.output_ids for c in with_progress] == [c.output_ids for c in plain]


def test_a_seeded_request_is_one_generate_call_whatever_is_queued_beside_it(engine):
    """Issue 41: a synchronous quickstart run stopped being reproducible. The scheduler took jobs one by one up
    to max_batch_size, so a seeded request that filled the batch was split whenever another request's job was
    ahead of it (the publish check's one-sequence probe): its last prompt then ran as a second generate_sync from
    the same seed and drew other samples. A seeded request must give what generate_sync gives its prompts alone,
    whatever is queued around it, and a request larger than max_batch_size runs alone."""
    from app.serving.scheduler import Scheduler, Stats

    seeded = SamplingParams(max_new_tokens=6, temperature=1.0, n=4, seed=11)
    other_seed = SamplingParams(max_new_tokens=6, temperature=1.0, n=4, seed=12)
    prompts = [PROMPTS[k % 3] + [k + 2] for k in range(4)]  # 4 prompts x 4 samples = the whole batch
    alone = [c.output_ids for c in engine.generate_sync(prompts, seeded)]
    alone_other = [c.output_ids for c in engine.generate_sync(prompts[:3], other_seed)]

    async def scenario() -> tuple[list, list, list, Stats]:
        scheduler = Scheduler(engine, max_batch_size=16, batch_window_s=0.5)
        probe = scheduler.enqueue(PROMPTS[1], greedy(1))  # one sequence ahead of the request (the probe)
        first = [scheduler.enqueue(p, seeded, request_key="a") for p in prompts]
        interleaved = [scheduler.enqueue(p, other_seed, request_key="b") for p in prompts[:3]]
        scheduler.start()
        try:
            results = await asyncio.gather(probe, *first, *interleaved)
        finally:
            await scheduler.stop()
        return results[1:5], results[5:], results[0], scheduler.stats

    first, interleaved, probe, stats = asyncio.run(scenario())
    assert [c.output_ids for per_prompt in first for c in per_prompt] == alone
    assert [c.output_ids for per_prompt in interleaved for c in per_prompt] == alone_other
    assert len(probe) == 1
    # The probe, then request a (16 sequences: the probe left no room for it), then b: three calls.
    assert stats.generate_calls == 3 and stats.largest_batch == 16

    # Larger than the batch limit: taken alone, in one generate_sync that chunks it at fixed offsets.
    small = EmbeddedEngine(engine.model, eos_token_id=EOS, pad_token_id=PAD, max_batch_size=8)
    big = [c.output_ids for c in small.generate_sync(prompts, seeded)]

    async def oversized() -> list:
        scheduler = Scheduler(small, max_batch_size=8, batch_window_s=0.5)
        probe = scheduler.enqueue(PROMPTS[1], greedy(1))
        jobs = [scheduler.enqueue(p, seeded, request_key="a") for p in prompts]
        scheduler.start()
        try:
            results = await asyncio.gather(probe, *jobs)
        finally:
            await scheduler.stop()
        return results[1:]

    assert [c.output_ids for per_prompt in asyncio.run(oversized()) for c in per_prompt] == big
