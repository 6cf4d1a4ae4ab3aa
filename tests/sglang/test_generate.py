"""Generation through trustbatch's SGLangClient against real SGLang 0.5.23 (CPU, float32, tiny Qwen2).

Covered: batched /generate with n > 1 parsed into prompt-major Completions; the raw /generate answer has every
key and type the client's parser reads (so the unit tests' fake server cannot drift from the real one unseen);
an unknown sampling key is a 400 that the client reports without retrying; the engine's behaviour logprobs
equal the trainer's recomputed logprobs (trainer/logprobs.py) of the same tokens at the sampling temperature.

Logprob tolerance: measured on this machine at 4.8e-7 (max |difference| over 12 completions x 16 tokens at
T = 1.0 and T = 0.7, float32 on both sides); the test allows 1e-4, which still fails on any convention
mismatch (logprobs at T = 1 instead of the sampling temperature differ by about 0.5 here).
Not covered: text in/out (the server runs with --skip-tokenizer-init, as trustbatch uses it), streaming.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from app.rollout.base import SamplingParams
from app.rollout.sglang import RolloutRequestError
from tests.sglang.conftest import run_with_client
from trainer.logprobs import token_logprobs

pytestmark = pytest.mark.sglang

PROMPTS = [[10, 20, 30], [40, 50], [60, 70, 80, 90]]
LOGPROB_TOLERANCE = 1e-4


def test_batched_generate_with_n_is_parsed_prompt_major(server):
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=4, seed=3)
    completions = run_with_client(server.url, lambda client: client.generate(PROMPTS, params))
    assert len(completions) == len(PROMPTS) * 4
    for k, completion in enumerate(completions):
        assert completion.prompt_ids == PROMPTS[k // 4]
        assert 1 <= len(completion.output_ids) <= 6
        assert len(completion.output_logprobs) == len(completion.output_ids)
        assert all(lp <= 0.0 and lp > -1e4 for lp in completion.output_logprobs)
        assert completion.finish_reason in ("stop", "length")
        assert completion.policy_version == 0 and completion.meta["weight_version"] == "0"
        assert completion.meta["weight_versions"] == [
            {"version": 0, "start": 0, "end": len(completion.output_ids)}
        ]
    # n samples of one prompt are distinct draws, not one sample repeated
    assert len({tuple(c.output_ids) for c in completions[:4]}) > 1


def test_real_response_has_every_key_the_parser_reads(server):
    body = {
        "input_ids": PROMPTS[:2],
        "sampling_params": {
            "max_new_tokens": 3,
            "temperature": 1.0,
            "top_p": 1.0,
            "n": 2,
            "stop_token_ids": [],
        },
        "return_logprob": True,
    }
    items = httpx.post(server.url + "/generate", json=body, timeout=60, trust_env=False).json()
    assert isinstance(items, list) and len(items) == 4  # flat, prompts x n
    for item in items:
        assert {"output_ids", "meta_info"} <= item.keys()
        meta = item["meta_info"]
        assert {"output_token_logprobs", "finish_reason", "weight_version", "weight_versions"} <= meta.keys()
        assert len(meta["output_token_logprobs"]) == len(item["output_ids"])
        for (logprob, token, text), output_id in zip(
            meta["output_token_logprobs"], item["output_ids"], strict=True
        ):
            assert isinstance(logprob, float) and token == output_id and text is None
        assert meta["finish_reason"]["type"] in ("stop", "length")
        assert isinstance(meta["weight_version"], str)
        for span in meta["weight_versions"]:
            assert {"version", "start", "end"} <= span.keys()


def test_unknown_sampling_key_is_a_400_not_retried(server):
    with httpx.Client(trust_env=False, timeout=30) as http:
        answer = http.post(
            server.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"tempreature": 1}}
        )
    assert answer.status_code == 400 and "unknown field" in answer.text

    async def bad_prompt(client):
        # The context is 512 tokens: a longer prompt is the server's 4xx, reported with its message.
        return await client.generate([[5] * 600], SamplingParams(max_new_tokens=4))

    with pytest.raises(RolloutRequestError, match="HTTP 400"):
        run_with_client(server.url, bad_prompt)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_the_trainer(server, models, temperature):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_new_tokens=16, temperature=temperature, n=4, seed=11)
    completions = run_with_client(server.url, lambda client: client.generate(PROMPTS, params))
    model = AutoModelForCausalLM.from_pretrained(models.v0, dtype=torch.float32).eval()
    worst = 0.0
    for completion in completions:
        ids = torch.tensor([completion.prompt_ids + completion.output_ids])
        with torch.no_grad():
            logprobs, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)
        recomputed = logprobs[0, len(completion.prompt_ids) :]
        engine = torch.tensor(completion.output_logprobs)
        worst = max(worst, (recomputed - engine).abs().max().item())
    print(f"max |engine - trainer| logprob at T={temperature}: {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE
