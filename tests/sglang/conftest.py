"""Fixtures for the tests against real SGLang 0.5.23 on CPU (the `.venv-sglang` environment).

The environment is built by tests/sglang/cpu_env/build.sh (`make sglang-env`; CI runs it before the tests).
Without it the tests marked `sglang` are skipped with that reason; under CI (CI=true) they fail instead,
because CI must exercise the real server. One server, started through trustbatch's own launcher
(app/rollout/sglang_server.py), serves the whole session; tests that change its weights put the session's
initial weights (version 0) back through the `server` fixture.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
BUILD = "bash tests/sglang/cpu_env/build.sh  (or: make sglang-env)"


def sglang_env_missing() -> str | None:
    """Why the SGLang environment cannot be used, or None when it is there."""
    if not SGLANG_PYTHON.exists():
        return f"no SGLang CPU environment at {SGLANG_PYTHON.parent.parent}; build it with: {BUILD}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = sglang_env_missing()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return  # not skipped: the server fixture fails with the reason, so CI cannot pass without them
    for item in items:
        if item.get_closest_marker("sglang") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


# The tiny Qwen2 the server runs: small enough to start and generate quickly on one CPU thread, with a context
# long enough for the 480-token in-flight request.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=512)  # fmt: skip


@dataclass
class Models:
    """Two tiny Qwen2 checkpoints with the same shape and different weights (seed 0 and seed 1)."""

    v0: Path
    v1: Path


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Models:
    from trainer.model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer, save_model

    root = tmp_path_factory.mktemp("sglang-models")
    tokenizer = build_tiny_tokenizer()
    dirs = []
    for seed in (0, 1):
        model = build_tiny_model(TinyModelConfig(**TINY_SHAPE, seed=seed), tokenizer)
        save_model(model, tokenizer, root / f"seed{seed}")
        dirs.append(root / f"seed{seed}")
    return Models(*dirs)


def launch_cpu_server(model_dir: Path, log_dir: Path, **overrides):
    """One real SGLang server (CPU, float32, fixed seed) serving ``model_dir`` as weight version 0."""
    reason = sglang_env_missing()
    if reason is not None:
        pytest.fail(f"CI must run the real-SGLang tests: {reason}")  # reached only under CI=true
    from app.rollout.sglang_server import SGLangLaunchConfig, launch_servers

    cfg = SGLangLaunchConfig(num_servers=1, python=str(SGLANG_PYTHON), cpu=True, dtype="float32", random_seed=0,
                             startup_timeout_s=300, **overrides)  # fmt: skip
    [server] = launch_servers(cfg, model_dir, log_dir, weight_version=0)
    return server


@pytest.fixture(scope="session")
def session_server(models, tmp_path_factory):
    """One real SGLang server (CPU, float32, fixed seed) serving `models.v0` as weight version 0."""
    server = launch_cpu_server(models.v0, tmp_path_factory.mktemp("sglang-logs"))
    yield server
    server.stop()


@pytest.fixture
def server(session_server, models):
    """The session server, holding `models.v0` as version 0 when the test starts (restored from disk)."""
    from app.rollout.base import WeightSource
    from app.rollout.sglang import SGLangClient

    async def reset():
        async with SGLangClient(client_config(session_server.url)) as client:
            info = await client.model_info()
            if info["weight_version"] != "0" or Path(info["model_path"]) != models.v0:
                await client.update_weights(WeightSource(path=models.v0), 0)

    assert session_server.exited() is None, f"the SGLang server died; log tail:\n{session_server.log_tail()}"
    asyncio.run(reset())
    return session_server


def client_config(*urls: str, **overrides):
    from app.rollout.sglang import SGLangClientConfig

    return SGLangClientConfig(urls=list(urls), **{"timeout_s": 120.0, "max_retries": 0, **overrides})


def run_with_client(url: str, coro_fn, **client_kwargs):
    """``coro_fn(client)`` with an SGLangClient built and closed in a fresh event loop."""
    from app.rollout.sglang import SGLangClient

    async def main():
        async with SGLangClient(client_config(url), **client_kwargs) as client:
            return await coro_fn(client)

    return asyncio.run(main())


def load_model(path):
    """An HF checkpoint in float32, in eval mode (the trainer's view of the weights a server was given)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def worst_logprob_gap(completions, model) -> float:
    """The largest |engine behaviour logprob - trainer logprob| over every generated token."""
    import torch

    from trainer.logprobs import token_logprobs

    worst = 0.0
    for completion in completions:
        ids = torch.tensor([completion.prompt_ids + completion.output_ids])
        with torch.no_grad():
            logprobs, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)
        gap = (logprobs[0, len(completion.prompt_ids) :] - torch.tensor(completion.output_logprobs)).abs().max()
        worst = max(worst, gap.item())
    return worst


async def push_new_then_old(client, new_model, old_model, cfg, prompts, params):
    """Sample, connect a `DistributedWeightSync`, push ``new_model`` as version 7 and sample, push ``old_model``
    as version 8 over the same group and sample. Returns (before, after, back, stats of the first push,
    /model_info after it). Shared by the real-SGLang and the built-in-server distributed tests."""
    from app.rollout.joint import gather_weights
    from app.rollout.weight_sync import DistributedWeightSync

    before = await client.generate(prompts, params)
    sync = await DistributedWeightSync.connect(client, cfg)
    try:
        stats = await sync.push(gather_weights(new_model), version=7)
        after = await client.generate(prompts, params)
        info = await client.model_info()
        await sync.push(gather_weights(old_model), version=8)  # the same group serves every push
        back = await client.generate(prompts, params)
    finally:
        await sync.close()
    return before, after, back, stats, info
