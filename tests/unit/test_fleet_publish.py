"""The fleet's publication (app/rollout/fleet.py) with the embedded engine: versions in order, the hooks, errors.

Covered: ``publish`` snapshots the weights before returning (a later change to the model does not reach the
engine), pushes run one after another and report each version to ``held`` in order; ``wait_for_push`` returns
with the version held; the ``gate`` is awaited before a push; a push that fails calls ``failed`` with the error
and raises from ``flush``; ``publish`` before ``connect`` is refused. The HTTP paths (disk, distributed) run in
tests/integration/test_loop.py and tests/sglang/test_loop_sglang.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from app.rollout.embedded import EmbeddedEngine
from app.rollout.fleet import Fleet, PublishHooks, SupervisionConfig
from tests.helpers import recording_hooks
from trainer.model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer

SHAPE = TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)


def tiny():
    tokenizer = build_tiny_tokenizer()
    return build_tiny_model(SHAPE, tokenizer), tokenizer


def fleet_of(*, wait_for_push: bool = False) -> tuple[Fleet, torch.nn.Module]:
    model, tokenizer = tiny()
    engine = EmbeddedEngine(
        build_tiny_model(SHAPE, tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    fleet = Fleet(engine, [], SupervisionConfig(), health_timeout_s=5.0, wait_for_push=wait_for_push)
    return fleet, model


def engine_weight(fleet: Fleet) -> torch.Tensor:
    return fleet.engine.model.get_input_embeddings().weight


def test_versions_are_snapshots_pushed_in_order():
    async def go():
        fleet, model = fleet_of()
        gated: list[int] = []

        async def gate(version: int) -> None:
            gated.append(version)

        hooks, held = recording_hooks(gate)
        await fleet.connect(hooks)
        with torch.no_grad():
            model.get_input_embeddings().weight.fill_(0.5)
        await fleet.publish(model, 1)
        with torch.no_grad():  # the next optimizer step: must not reach version 1
            model.get_input_embeddings().weight.fill_(2.0)
        await fleet.flush()
        first = engine_weight(fleet).clone()
        await fleet.publish(model, 2)
        await fleet.publish(model, 3)
        await fleet.flush()
        await fleet.close()
        return held, gated, first, engine_weight(fleet).clone(), fleet.engine.policy_version

    held, gated, first, last, version = asyncio.run(go())
    assert held == [1, 2, 3] and gated == [1, 2, 3]
    assert torch.all(first == 0.5) and torch.all(last == 2.0) and version == 3


def test_wait_for_push_returns_with_the_version_held():
    async def go():
        fleet, model = fleet_of(wait_for_push=True)
        hooks, held = recording_hooks()
        await fleet.connect(hooks)
        await fleet.publish(model, 1)
        seen = list(held)
        await fleet.close()
        return seen

    assert asyncio.run(go()) == [1]


def test_a_failed_push_is_reported_and_raised():
    async def go():
        fleet, _ = fleet_of()
        errors: list[BaseException] = []

        async def held(version: int) -> None:
            raise AssertionError("a failed push is never held")

        async def failed(exc: BaseException) -> None:
            errors.append(exc)

        with pytest.raises(RuntimeError, match="connect"):
            await fleet.publish(torch.nn.Linear(2, 2), 1)
        await fleet.connect(PublishHooks(held=held, failed=failed))
        await fleet.publish(torch.nn.Linear(2, 2), 1)  # weights that do not fit the engine's model
        with pytest.raises(Exception) as raised:
            await fleet.flush()
        await fleet.close()
        return errors, raised.value

    errors, raised = asyncio.run(go())
    assert errors == [raised]
