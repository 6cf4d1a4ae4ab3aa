"""Per-version LoRA adapters on real SGLang 0.5.23 on CUDA (``rollout.sglang.lora_adapters``; skipped without CUDA
or without SGLang). Run by tests/gpu/run_sglang_gpu.sh on a GPU machine. SGLang's ``--enable-lora`` does not run
on its CPU backend (sglang #31894), so this is where the adapter path meets the real server; the client and the
fleet are checked on CPU against SGLang's LoRA routes as read from its source (tests/integration/test_sglang_lora.py).

Covered: a server started with `LoraServing`'s flags loads an adapter written by `save_adapter_version`
(/load_lora_adapter); the probe scored under it matches the trainer's LoRA model, and the base model's reading
(a request that names no adapter: what a run whose adapter never loaded would get) is far from it, so the
publication check tells them apart; the server lists each adapter once loaded and not the older one once
``unload_adapters`` removed it (GET /v1/models lists the loaded adapters).

Tolerance: the server runs bfloat16; the reference is the trainer's float32 forward of the weights rounded to bf16,
as the run's own check takes it (test_sglang_gpu.py's loose bound); the adapter's update is made large
(B ~ N(0, 0.05), alpha / r = 8), so the base reading differs by far more.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from app.rollout.base import SamplingParams
from app.rollout.joint import reference_logprobs, save_adapter_version
from app.rollout.sglang import SGLangClient, SGLangClientConfig
from app.rollout.sglang_server import LoraServing, SGLangLaunchConfig, launch_servers
from tests.gpu.test_sglang_gpu import sglang_python
from tests.sglang.conftest import TINY_SHAPE
from trainer.lora import LoraConfig, apply_lora

pytestmark = pytest.mark.gpu

PROBE = [5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 12, 24, 36, 48]
RANK = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from trainer.model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer, save_model

    path = tmp_path_factory.mktemp("gpu-lora") / "base"
    tokenizer = build_tiny_tokenizer()
    save_model(build_tiny_model(TinyModelConfig(**TINY_SHAPE, seed=0), tokenizer), tokenizer, path)
    return path


@pytest.fixture(scope="module")
def server(base, tmp_path_factory):
    python = sglang_python()
    if python is None:
        pytest.skip("real SGLang is not installed here: run tests/gpu/run_sglang_gpu.sh, or set TRUSTBATCH_SGLANG_PYTHON")
    cfg = SGLangLaunchConfig(num_servers=1, python=python, dtype="bfloat16", mem_fraction_static=0.3, random_seed=0,
                             startup_timeout_s=600)  # fmt: skip
    [process] = launch_servers(cfg, base, tmp_path_factory.mktemp("gpu-lora-logs"), lora=LoraServing(RANK, slots=3))
    yield process
    process.stop()


def lora_model(base, seed: int):
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(rank=RANK))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return model.eval()


def mean_gap(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def test_adapters_load_score_as_the_trainer_and_the_old_one_is_unloaded(server, base, tmp_path):
    models = {1: lora_model(base, 1), 2: lora_model(base, 2)}
    for version, model in models.items():
        save_adapter_version(model, tmp_path / f"v{version}", is_main=True)
    references = {version: reference_logprobs(model, PROBE, weight_dtype="bfloat16") for version, model in models.items()}

    async def go():
        cfg = SGLangClientConfig(urls=[server.url], timeout_s=300, max_retries=0)
        async with SGLangClient(cfg) as client, httpx.AsyncClient(trust_env=False) as http:

            async def served() -> set[str]:
                return {card["id"] for card in (await http.get(f"{server.url}/v1/models")).json()["data"]}

            [base_reading] = await client.score(PROBE)  # no adapter named: the base model answers
            await client.load_adapter(tmp_path / "v1", 1)
            after_v1 = await served()
            [first] = await client.score(PROBE)
            sampled = await client.generate([[10, 20, 30]], SamplingParams(max_new_tokens=8, n=2, seed=0))
            await client.load_adapter(tmp_path / "v2", 2)
            [second] = await client.score(PROBE)
            await client.unload_adapters(keep=1)
            names = {version: client.adapter_name(version) for version in (1, 2)}
            return base_reading, first, second, sampled, after_v1, await served(), names

    base_reading, first, second, sampled, after_v1, after_unload, names = asyncio.run(go())
    gaps = {"v1": mean_gap(first.logprobs, references[1]), "v2": mean_gap(second.logprobs, references[2]),
            "base vs v1": mean_gap(base_reading.logprobs, references[1])}  # fmt: skip
    print(f"probe gaps, engine (bf16) vs trainer (float32), nats/token: {gaps}")
    assert names[1] in after_v1 and names[2] not in after_v1  # the server itself lists what it loaded
    assert names[2] in after_unload and names[1] not in after_unload
    assert gaps["v1"] < 0.05 and gaps["v2"] < 0.05
    assert gaps["base vs v1"] > 5 * max(gaps["v1"], 0.01)  # an adapter that never loaded is caught
    assert len(sampled) == 2 and all(c.output_ids for c in sampled)
