"""The distributed (gloo) weight update into the built-in CPU server: app/serving/weight_updates.py.

The trainer's half is the one real SGLang gets (`DistributedWeightSync`, tests/sglang/test_weight_sync.py runs it
against a real server); here the receiving half is the built-in server, a `trustbatch rollout-server` subprocess
(a process of its own: two ranks of one group cannot live in one process). That the right weights arrived is
checked through the server's own logprobs: after a push they equal the trainer's under the pushed weights (float32
on both sides; 6e-6 apart, the KV-cached decode against one full forward). Bad requests get a 400 naming the field before anything is
received, so none of them leaves a receive waiting for broadcasts that never come.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from app.rollout.base import SamplingParams
from app.rollout.joint import WeightUpdateGroup, gather_weights
from app.rollout.process import LocalServerProcess
from app.rollout.sglang import RolloutRequestError, SGLangClient, SGLangClientConfig
from app.rollout.weight_sync import DistributedWeightSync, WeightSyncConfig, init_weights_update_group
from tests.sglang.conftest import (  # the same sequence and checks as against real SGLang
    load_model,
    push_new_then_old,
    worst_logprob_gap,
)

PROMPTS = [[10, 20, 30], [40, 50], [60, 70, 80, 90]]
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=5)


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    """A built-in rollout server serving model a as version 0."""
    proc = LocalServerProcess(
        model_dirs[0], max_batch_size=64, log_path=tmp_path_factory.mktemp("logs") / "server.log"
    )
    proc.start()
    proc.wait_ready()
    yield proc
    proc.stop()


def run(url: str, coro_fn):
    async def main():
        cfg = SGLangClientConfig(urls=[url], timeout_s=60.0, max_retries=0)
        async with SGLangClient(cfg) as client:
            return await coro_fn(client)

    return asyncio.run(main())


@pytest.mark.parametrize("bucket_mb", [0.005, 1024.0], ids=["several-buckets", "one-bucket"])
def test_a_gloo_push_reaches_the_built_in_server(server, model_dirs, bucket_mb):
    new, old = load_model(model_dirs[1]), load_model(model_dirs[0])
    cfg = WeightSyncConfig(method="distributed", backend="gloo", bucket_mb=bucket_mb, timeout_s=60)

    async def go(client):  # model a at the start: version 0, or 8 after the other case
        return await push_new_then_old(client, new, old, cfg, PROMPTS, SAMPLED)

    before, after, back, stats, info = run(server.url, go)
    assert (stats.buckets > 1) == (bucket_mb < 1)
    assert stats.tensors == len(new.state_dict()) and stats.version == 7
    assert {c.policy_version for c in before} in ({0}, {8})
    assert {c.policy_version for c in after} == {7} and info["weight_version"] == "7"
    assert {c.policy_version for c in back} == {8}
    # The server decodes with a KV cache, the trainer recomputes in one pass: equal to float32 rounding.
    assert worst_logprob_gap(after, new) < 1e-4 and worst_logprob_gap(back, old) < 1e-4
    assert worst_logprob_gap(after, old) > 1e-2  # the check tells the two models apart


def test_bad_weight_update_requests_are_refused_before_anything_is_received(server, model_dirs):
    """Each answers 400 with success false and a message naming the problem, at once; the server then still
    takes a good push."""
    name = "checks"
    model = load_model(model_dirs[1])
    weight, tensor = next(iter(model.state_dict().items()))

    def post(path: str, body: dict) -> dict:
        response = httpx.post(server.url + path, json=body, timeout=30, trust_env=False)
        assert response.status_code == 400, (path, response.text)
        answer = response.json()
        assert answer["success"] is False
        return answer

    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": name}
    assert "gloo only" in post("/init_weights_update_group", {**group, "backend": "nccl"})["message"]
    assert "rank_offset" in post("/init_weights_update_group", {**group, "backend": "gloo", "rank_offset": 0})["message"]
    update = {"names": [weight], "dtypes": ["float32"], "shapes": [list(tensor.shape)], "group_name": name}
    assert "init_weights_update_group first" in post("/update_weights_from_distributed", update)["message"]
    assert "no weight-update group" in post("/destroy_weights_update_group", {"group_name": name})["message"]

    async def with_group(client):
        trainer = WeightUpdateGroup(world_size=2, group_name=name, backend="gloo", timeout_s=30)
        joined = asyncio.ensure_future(asyncio.to_thread(trainer.connect))
        await init_weights_update_group(
            client, master_address="127.0.0.1", master_port=trainer.master_port, world_size=2, rank_offsets=[1],
            group_name=name, backend="gloo",
        )  # fmt: skip
        await joined
        clash = WeightUpdateGroup(world_size=2, group_name=name, backend="gloo", timeout_s=5)
        try:
            with pytest.raises(RolloutRequestError, match="already exists"):
                await init_weights_update_group(
                    client, master_address="127.0.0.1", master_port=clash.master_port, world_size=2,
                    rank_offsets=[1], group_name=name, backend="gloo",
                )  # fmt: skip
        finally:
            clash.destroy()
        return trainer

    trainer = run(server.url, with_group)
    try:
        assert "begin_weight_update first" in post("/update_weights_from_distributed", update)["message"]
        httpx.post(server.url + "/begin_weight_update", json={}, trust_env=False).raise_for_status()
        try:
            assert "already open" in post("/begin_weight_update", {})["message"]
            for body, fragment in [
                ({**update, "names": ["no.such.weight"]}, "not a weight of the served model"),
                ({**update, "shapes": [[1, 2, 3]]}, "the model's is"),
                ({**update, "dtypes": ["int64"]}, "expected one of"),
                ({**update, "dtypes": []}, "one dtype per name"),
                ({**update, "names": [weight, weight], "dtypes": ["float32"] * 2, "shapes": [list(tensor.shape)] * 2},
                 "duplicates"),
                ({**update, "load_format": "direct"}, "load_format"),
                ({**update, "weight_version": ["7"]}, "weight_version"),
            ]:  # fmt: skip
                assert fragment in post("/update_weights_from_distributed", body)["message"], fragment
        finally:
            httpx.post(server.url + "/end_weight_update", json={}, trust_env=False).raise_for_status()
        answer = httpx.post(server.url + "/destroy_weights_update_group", json={"group_name": name}, trust_env=False)
        assert answer.json()["success"] is True
    finally:
        trainer.destroy()

    async def push(client):  # the server is still usable
        sync = await DistributedWeightSync.connect(client, WeightSyncConfig(backend="gloo", timeout_s=60))
        try:
            await sync.push(gather_weights(model), version=3)
        finally:
            await sync.close()
        return await client.model_info()

    assert run(server.url, push)["weight_version"] == "3"


@pytest.mark.parametrize(
    "path",
    ["/init_weights_update_group", "/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update",
     "/destroy_weights_update_group"],
)  # fmt: skip
def test_malformed_bodies_get_a_json_400_and_the_server_stays_healthy(server, path):
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as http:
        for content in (b"{", b"[1, 2]", b'"text"', b"\xff\xfe"):
            response = http.post(path, content=content, headers={"content-type": "application/json"})
            assert response.status_code == 400, (path, content, response.text)
            assert response.json()  # a JSON error body
        assert http.post(path, content=b"x" * (65 << 20)).status_code == 413
        assert http.get("/health").status_code == 200
