"""Real SGLang 0.5.23 on CUDA (skipped without CUDA or without SGLang): the checks of tests/sglang, on GPUs.

Run by tests/gpu/run_sglang_gpu.sh on a GPU machine, in one venv holding real SGLang (its CUDA torch and
transformers) and trustbatch; the server interpreter is that venv's python, or $TRUSTBATCH_SGLANG_PYTHON. No
shims: sgl_kernel, flashinfer and NCCL are the real ones.

Covered: batched generate with n > 1 through SGLangClient; behaviour logprobs against the trainer's recomputed
logprobs; update from disk; update over NCCL with `DistributedWeightSync` (trainer rank 0 on cuda:0, the server
on cuda:1: NCCL refuses two ranks of one communicator on the same GPU, so this one needs two GPUs) — each changes
the outputs and the reported weight version.

Tolerance: the server runs bfloat16 (SGLang's GPU attention kernels are half precision) while the trainer
recomputes in float32, so logprobs differ by bf16 rounding of weights and activations. Not measured yet (no GPU
where this was written): the bounds below (mean 0.05, max 0.5 nats per token) are deliberately loose and still
catch a wrong convention (T = 1 vs the sampling temperature) or wrong weights (differences of order 1); record
the measured values printed by the test and tighten them on the first GPU run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from app.rollout.base import SamplingParams, WeightSource
from app.rollout.joint import gather_weights
from app.rollout.sglang import SGLangClient, SGLangClientConfig
from app.rollout.sglang_server import SGLangLaunchConfig, launch_servers
from app.rollout.weight_sync import DistributedWeightSync, WeightSyncConfig
from tests.sglang.conftest import TINY_SHAPE
from trainer.logprobs import token_logprobs

pytestmark = pytest.mark.gpu

PROMPTS = [[10, 20, 30], [40, 50], [60, 70, 80, 90]]
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.7, n=4, seed=5)
MEAN_TOLERANCE, MAX_TOLERANCE = 0.05, 0.5


def sglang_python() -> str | None:
    explicit = os.environ.get("TRUSTBATCH_SGLANG_PYTHON")
    if explicit:
        return explicit if Path(explicit).exists() else None
    return sys.executable if importlib.util.find_spec("sglang") is not None else None


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from trainer.model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer, save_model

    root = tmp_path_factory.mktemp("gpu-models")
    tokenizer = build_tiny_tokenizer()
    for seed in (0, 1):
        save_model(
            build_tiny_model(TinyModelConfig(**TINY_SHAPE, seed=seed), tokenizer), tokenizer, root / str(seed)
        )
    return root / "0", root / "1"


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    python = sglang_python()
    if python is None:
        pytest.skip(
            "real SGLang is not installed here: run tests/gpu/run_sglang_gpu.sh, or set TRUSTBATCH_SGLANG_PYTHON"
        )
    gpu = 1 if torch.cuda.device_count() > 1 else 0  # the trainer side uses cuda:0
    cfg = SGLangLaunchConfig(num_servers=1, python=python, base_gpu_id=gpu, dtype="bfloat16", mem_fraction_static=0.3,
                             random_seed=0, startup_timeout_s=600)  # fmt: skip
    [process] = launch_servers(cfg, models[0], tmp_path_factory.mktemp("gpu-sglang-logs"), weight_version=0)
    yield process
    process.stop()


def run(url, coro_fn):
    async def main():
        async with SGLangClient(SGLangClientConfig(urls=[url], timeout_s=300, max_retries=0)) as client:
            return await coro_fn(client)

    return asyncio.run(main())


def logprob_gaps(completions, path, temperature) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    gaps = []
    for completion in completions:
        ids = torch.tensor([completion.prompt_ids + completion.output_ids], device="cuda")
        with torch.no_grad():
            logprobs, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)
        engine = torch.tensor(completion.output_logprobs, device="cuda")
        gaps.append((logprobs[0, len(completion.prompt_ids) :] - engine).abs())
    gaps = torch.cat(gaps)
    print(
        f"engine vs trainer logprobs ({path.name}): mean {gaps.mean().item():.3e}, max {gaps.max().item():.3e}"
    )
    return gaps.mean().item(), gaps.max().item()


def test_generate_and_logprobs_on_gpu(server, models):
    completions = run(server.url, lambda client: client.generate(PROMPTS, SAMPLED))
    assert len(completions) == len(PROMPTS) * SAMPLED.n
    for k, completion in enumerate(completions):
        assert completion.prompt_ids == PROMPTS[k // SAMPLED.n] and completion.policy_version == 0
        assert len(completion.output_logprobs) == len(completion.output_ids) > 0
    mean, worst = logprob_gaps(completions, models[0], SAMPLED.temperature)
    assert mean < MEAN_TOLERANCE and worst < MAX_TOLERANCE


def test_update_from_disk_on_gpu(server, models):
    async def go(client):
        await client.update_weights(WeightSource(path=models[1]), 5)
        sampled = await client.generate(PROMPTS, SAMPLED)
        info = await client.model_info()
        await client.update_weights(WeightSource(path=models[0]), 6)
        return sampled, info

    sampled, info = run(server.url, go)
    assert {c.policy_version for c in sampled} == {5} and info["weight_version"] == "5"
    mean, worst = logprob_gaps(sampled, models[1], SAMPLED.temperature)
    assert mean < MEAN_TOLERANCE and worst < MAX_TOLERANCE


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL weight sync needs 2 GPUs (trainer and server)"
)
def test_update_from_distributed_nccl(server, models):
    from transformers import AutoModelForCausalLM

    torch.cuda.set_device(0)
    new_model = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32)
    cfg = WeightSyncConfig(method="distributed", backend="nccl", dtype="bfloat16", timeout_s=300)

    async def go(client):
        sync = await DistributedWeightSync.connect(client, cfg)
        try:
            stats = await sync.push(gather_weights(new_model, dtype=cfg.dtype), version=7)
            sampled = await client.generate(PROMPTS, SAMPLED)
            info = await client.model_info()
        finally:
            await sync.close()
        await client.update_weights(WeightSource(path=models[0]), 8)
        return stats, sampled, info

    stats, sampled, info = run(server.url, go)
    print(f"NCCL push: {stats}")
    assert {c.policy_version for c in sampled} == {7} and info["weight_version"] == "7"
    mean, worst = logprob_gaps(sampled, models[1], SAMPLED.temperature)
    assert mean < MEAN_TOLERANCE and worst < MAX_TOLERANCE
