"""Per-version LoRA adapters on SGLang servers (``rollout.sglang.lora_adapters``), client and fleet, against the
loopback SGLang of test_sglang_client.py with SGLang 0.5.23's LoRA routes (read in its source; SGLang runs them
on GPUs only, so tests/gpu/test_sglang_lora_gpu.py checks them live).

Covered: once an adapter is loaded every /generate and probe request names it, and a completion's version is the
adapter its request named when it was sent, not the one loaded while it ran; loading a version again replaces
it, and a server that holds it already keeps it; ``unload_adapters`` keeps the newest ones and takes an adapter the
server already evicted as gone; a server that lost its adapters (restarted) gets the resident ones back and the
request is sent again; a directory that is no adapter is a clear error; the fleet writes each version as a PEFT
directory of the LoRA matrices alone, loads it on every server, keeps ``max_lag + 1`` resident, and a resumed run
loads its checkpoint's adapter at connect; the launch flags follow the config, ``max_lag: auto`` included.
Config errors are in tests/unit/test_config.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file

from app.rollout.base import SamplingParams, WeightSource
from app.rollout.fleet import Fleet, SupervisionConfig
from app.rollout.sglang import RolloutRequestError, SGLangClient
from app.rollout.sglang_server import LoraServing
from tests.helpers import random_qwen2, recording_hooks
from trainer.lora import LoraConfig, apply_lora

from . import test_sglang_client as loopback
from .test_sglang_client import FakeSGLang, config

PARAMS = SamplingParams(max_new_tokens=3, temperature=1.0, n=2, seed=0)
servers, two = loopback.servers, loopback.two
"""The two loopback servers of test_sglang_client.py (this module gets its own pair), reset before each test."""


def adapter_dir(root, name: str):
    """A directory SGLang takes as an adapter (the fake checks for adapter_config.json)."""
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": "all-linear"}))
    return path


def versions(names) -> list[int | None]:
    """Adapter names (``tb-<client>-v<N>``) -> their versions; None stays None (no adapter named)."""
    return [None if name is None else int(name.rsplit("-v", 1)[1]) for name in names]


def loaded(fake: FakeSGLang) -> list[int]:
    return sorted(versions(fake.loras))


def bodies(fake: FakeSGLang, route: str) -> list[dict]:
    return [json.loads(raw) for path, raw in fake.requests if path == route]


def test_every_request_names_the_adapter_of_the_version_it_was_issued_under(two, tmp_path):
    (url_a, fake_a), (url_b, fake_b) = two

    async def go(client: SGLangClient):
        before = await client.generate([[1, 2]], PARAMS)  # no adapter yet: the base model, no lora_path
        await client.load_adapter(adapter_dir(tmp_path, "v1"), 1)
        fake_a.delay_s = fake_b.delay_s = 0.3
        slow = asyncio.ensure_future(client.generate([[3, 4], [5, 6]], PARAMS))  # issued under v1
        await asyncio.sleep(0.1)
        await client.load_adapter(adapter_dir(tmp_path, "v2"), 2)  # lands while those requests run
        fake_a.delay_s = fake_b.delay_s = 0.0
        during = await slow
        after = await client.generate([[7, 8]], PARAMS)
        readings = await client.score([1, 2, 3])
        return before, during, after, readings

    before, during, after, readings = asyncio.run(run_client(config(url_a, url_b, batch_size=1), go))
    assert [c.policy_version for c in before] == [0, 0] and all("adapter" not in c.meta for c in before)
    assert [c.policy_version for c in during] == [1] * 4 and versions({c.meta["adapter"] for c in during}) == [1]
    assert [c.policy_version for c in after] == [2, 2] and versions({c.meta["adapter"] for c in after}) == [2]
    for fake in (fake_a, fake_b):
        assert sorted(fake.loras.values()) == [str((tmp_path / "v1").resolve()), str((tmp_path / "v2").resolve())]
        assert all(name.startswith("tb-") for name in fake.loras)  # this client's own names
    names = versions(b.get("lora_path") for f in (fake_a, fake_b) for b in bodies(f, "/generate"))
    assert sorted(names, key=str) == sorted([None, 1, 1, 2, 2, 2], key=str)  # 1+2+1 generate requests, 2 probes
    # The probe names the adapter too, and each server's reading carries its version.
    assert [r.weight_version for r in readings] == ["2", "2"]
    assert all(lp == pytest.approx(-0.52) for r in readings for lp in r.logprobs)


def test_loading_a_version_again_replaces_it_and_old_ones_are_unloaded(two, tmp_path):
    (url_a, fake_a), (url_b, fake_b) = two

    async def go(client: SGLangClient):
        for version in (1, 2, 3):
            await client.load_adapter(adapter_dir(tmp_path, f"v{version}"), version)
        again = adapter_dir(tmp_path, "v3-again")
        await client.load_adapter(again, 3)  # a publish retried after a failed check
        del fake_b.loras[client.adapter_name(1)]  # evicted by the server itself (--max-loaded-loras)
        await client.unload_adapters(keep=2)
        return sorted(client.adapters), client.adapter

    resident, current = asyncio.run(run_client(config(url_a, url_b), go))
    assert resident == [2, 3] and versions([current[1]]) == [3]
    for fake in (fake_a, fake_b):
        assert loaded(fake) == [2, 3] and fake.loras[current[1]].endswith("v3-again")
    with pytest.raises(ValueError, match="must stay loaded"):
        asyncio.run(run_client(config(url_a), lambda client: client.unload_adapters(keep=0)))


def test_a_server_that_lost_its_adapters_gets_them_back_and_a_directory_that_is_no_adapter_is_an_error(
    two, tmp_path
):
    (url_a, fake_a), (url_b, fake_b) = two

    async def go(client: SGLangClient):
        await client.load_adapter(adapter_dir(tmp_path, "v1"), 1)
        await client.load_adapter(adapter_dir(tmp_path, "v2"), 2)
        fake_a.restart_lora()  # restarted from the base model: its registry is empty
        completions = await client.generate([[1, 2], [3, 4]], PARAMS)  # one request to each server
        await client.load_adapter(tmp_path / "v2", 2, urls=[url_b])  # a push resent: b holds it already
        return completions

    completions = asyncio.run(run_client(config(url_a, url_b, batch_size=1), go))
    assert [c.policy_version for c in completions] == [2] * 4
    assert loaded(fake_a) == loaded(fake_b) == [1, 2]
    retried = versions(b.get("lora_path") for b in bodies(fake_a, "/generate"))
    assert retried == [2, 2]  # rejected ("never been loaded"), then answered after the reload
    (tmp_path / "empty").mkdir()
    with pytest.raises(RolloutRequestError, match=r"no adapter_config.json.*--enable-lora, --max-lora-rank"):
        asyncio.run(run_client(config(url_b), lambda c: c.load_adapter(tmp_path / "empty", 1)))


def test_the_fleet_publishes_adapters_keeps_max_lag_plus_one_and_reloads_a_restarted_server(two, tmp_path):
    """adapters=3 (max_lag 2): 3 resident, the newest max(3, 3 + 1) = 4 directories kept."""
    (url_a, fake_a), (url_b, fake_b) = two
    model = apply_lora(random_qwen2(0), LoraConfig(rank=4))

    async def go():
        client = SGLangClient(config(url_a, url_b))
        fleet = Fleet(client, [], SupervisionConfig(), health_timeout_s=5.0, weights_dir=tmp_path / "weights",
                      adapters=3)  # fmt: skip
        hooks, held = recording_hooks()
        await fleet.connect(hooks)
        for version in (1, 2, 3, 4, 5):
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.fill_(0.1 * version)
            await fleet.publish(model, version)
        await fleet.flush()
        fake_b.restart_lora()  # a server that came back from the base model: what the watchdog's restart loads
        await client.reload_adapters(urls=[url_b])
        await fleet.close()
        return held, client.adapter

    held, current = asyncio.run(go())
    assert held == [1, 2, 3, 4, 5] and current[0] == 5
    assert loaded(fake_a) == loaded(fake_b) == [3, 4, 5]
    v5 = tmp_path / "weights" / "v5"
    config_json = json.loads((v5 / "adapter_config.json").read_text())
    weights = load_file(v5 / "adapter_model.safetensors")
    assert config_json["r"] == 4 and weights and all(".lora_" in key for key in weights)  # the adapter alone
    assert all(torch.allclose(w, torch.full_like(w, 0.5)) for k, w in weights.items() if "lora_B" in k)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2", "v3", "v4", "v5"]


def test_a_resumed_run_loads_its_checkpoints_adapter_at_connect(two, tmp_path):
    (url_a, fake_a), (url_b, fake_b) = two
    checkpoint = adapter_dir(tmp_path, "adapter")

    async def go():
        client = SGLangClient(config(url_a, url_b))
        fleet = Fleet(client, [], SupervisionConfig(), health_timeout_s=5.0, weights_dir=tmp_path / "w", adapters=2)
        fleet.latest_adapter = (checkpoint, 7)
        await fleet.connect(recording_hooks()[0])
        completions = await fleet.generate([[1, 2]], PARAMS)
        await fleet.close()
        return completions

    completions = asyncio.run(go())
    assert loaded(fake_a) == loaded(fake_b) == [7] and set(fake_a.loras.values()) == {str(checkpoint.resolve())}
    assert [c.policy_version for c in completions] == [7, 7]


def test_launch_flags_follow_the_config():
    from app.config import load_config
    from app.training.setup import lora_serving

    from .conftest import REPO

    common = ["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1]", "trainer.lora.rank=8"]
    on = [*common, "rollout.sglang.lora_adapters=true"]
    assert lora_serving(load_config(REPO / "configs" / "quickstart.yaml", common)) is None
    assert lora_serving(load_config(REPO / "configs" / "quickstart.yaml", [*on, "rollout.max_lag=2"])) == \
        LoraServing(rank=8, slots=4, target_modules=("all",))  # fmt: skip
    auto = load_config(REPO / "configs" / "quickstart.yaml", [*on, "rollout.max_lag=auto", "rollout.max_auto_lag=5",
                                                              "trainer.lora.target_modules=[q_proj,v_proj]"])  # fmt: skip
    assert lora_serving(auto) == LoraServing(rank=8, slots=7, target_modules=("q_proj", "v_proj"))


def test_lora_serving_flags():
    flags = LoraServing(rank=8, slots=3).args()
    assert flags == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
                     "--max-loras-per-batch", "3", "--max-loaded-loras", "3"]  # fmt: skip
    assert LoraServing(rank=4, slots=2, target_modules=("q_proj", "v_proj")).args()[4:6] == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="adapter's directory"):
        WeightSource(state_dict={}, adapter=True)


async def run_client(cfg, body):
    async with SGLangClient(cfg) as client:
        return await body(client)
