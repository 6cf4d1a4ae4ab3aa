"""Shared test builders (real models, built in code; nothing is downloaded)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def random_qwen2(seed: int = 0, *, vocab_size: int = 64, **config) -> Qwen2ForCausalLM:
    """A tiny random float32 Qwen2 (hidden 32, 2 layers, 4/2 heads), identical for the same seed and config.

    Keyword arguments override Qwen2Config fields. The caller's global RNG is left untouched.
    """
    config = Qwen2Config(**{
        "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, **config,
    })
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).eval()


def wait_for_health(process, url: str, log_path, *, timeout_s: float, what: str = "the server") -> None:
    """Poll ``url``/health until it answers 200; fail with the log's tail if ``process`` exits or time runs out."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, f"{what} exited: " + log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, f"{what} did not come up in {timeout_s:g} s: " + log_path.read_text()[-4000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def remove_unless_failed(request: pytest.FixtureRequest, path: Path) -> None:
    """Teardown of a module-scoped fixture's directory (a SmolLM2 checkpoint is 0.5-2 GB): removed when no test
    has failed so far, kept to read otherwise. pyproject's `tmp_path_retention_policy = "failed"` does the same for
    each passing test's `tmp_path`, so the suite's disk use peaks at about one module's, not the sum of all."""
    if request.session.testsfailed == 0:
        shutil.rmtree(path, ignore_errors=True)


def recording_hooks(gate=None):
    """`PublishHooks` for a fleet under test: each held version is appended, in order, to the list returned beside
    them; a failed push fails the test. ``gate`` is passed through."""
    from app.rollout.fleet import PublishHooks

    held: list[int] = []

    async def record(version: int) -> None:
        held.append(version)

    async def failed(exc: BaseException) -> None:
        raise AssertionError(f"no push should fail: {exc}")

    return PublishHooks(held=record, failed=failed, gate=gate), held
