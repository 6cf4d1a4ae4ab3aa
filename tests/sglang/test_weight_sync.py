"""Weight updates of a real SGLang 0.5.23 server (CPU): from disk and over a gloo process group.

Covered: `SGLangClient.update_weights` (/update_weights_from_disk) and `DistributedWeightSync.push`
(/init_weights_update_group + /update_weights_from_distributed in /begin_weight_update ... /end_weight_update,
broadcasts from trainer/weights.py) each change what the server generates, and the weight version it reports
(GET /model_info and every completion's policy_version). That the *right* weights arrived is checked through
the logprobs: after the update, the engine's behaviour logprobs equal the trainer's recomputed logprobs under the
new checkpoint (1e-4; 4.8e-7 measured), which a missing, misordered or mis-cast tensor would break. The
distributed push is run with buckets small enough to need several requests, and with one bucket.

In-flight requests (each update takes SGLang's writer lock, app/rollout/weight_sync.py): an update sent while a long request
streams waits for it — the request ends normally with every token from the old version — for both update paths;
with ``abort_all_requests: true`` the request ends early with finish_reason "abort" and the new version is served.
Updates keep succeeding and labelling their version under continuous rollout traffic, and the client's answer
to SGLang's "the cache was not flushed" (retract, flush, label, continue) works with a request running.

Not covered: NCCL (tests/gpu/test_sglang_gpu.py), several servers in one group (one server here: each costs
about 2 GB and 20 s to start), /update_weights_from_tensor (CUDA IPC; it killed the CPU server when tried).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from app.rollout.base import SamplingParams, WeightSource
from app.rollout.joint import gather_weights
from app.rollout.weight_sync import DistributedWeightSync, WeightSyncConfig, init_weights_update_group
from tests.sglang.conftest import load_model, push_new_then_old, run_with_client, worst_logprob_gap

pytestmark = pytest.mark.sglang

PROMPTS = [[10, 20, 30], [40, 50], [60, 70, 80, 90]]
SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=5)
LOGPROB_TOLERANCE = 1e-4
LONG = 480  # new tokens of the in-flight request (the context is 512)


def outputs(completions) -> list:
    """What a generate call produced: tokens and their logprobs (a tiny random model often repeats its
    prompt's last token under greedy decoding, whatever its weights, so the logprobs are compared too)."""
    return [(c.output_ids, [round(lp, 4) for lp in c.output_logprobs]) for c in completions]


def test_update_from_disk_changes_outputs_and_version(server, models):
    async def go(client):
        before = await client.generate(PROMPTS, SAMPLED)
        await client.update_weights(WeightSource(path=models.v1), 5)
        sampled = await client.generate(PROMPTS, SAMPLED)
        return before, sampled, await client.model_info()

    before, sampled, info = run_with_client(server.url, go)
    assert outputs(before) != outputs(sampled)
    assert {c.policy_version for c in before} == {0}
    assert {c.policy_version for c in sampled} == {5}
    assert info["weight_version"] == "5" and info["model_path"] == str(models.v1)
    assert worst_logprob_gap(sampled, load_model(models.v1)) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("bucket_mb", [0.05, 1024.0], ids=["several-buckets", "one-bucket"])
def test_update_from_distributed_gloo_changes_outputs_and_version(server, models, bucket_mb):
    new_model, old_model = load_model(models.v1), load_model(models.v0)
    cfg = WeightSyncConfig(method="distributed", backend="gloo", bucket_mb=bucket_mb, timeout_s=120)

    async def go(client):
        return await push_new_then_old(client, new_model, old_model, cfg, PROMPTS, SAMPLED)

    before, sampled_new, sampled_old, stats, info = run_with_client(server.url, go)
    assert (stats.buckets > 1) == (bucket_mb < 1)
    assert stats.tensors == len(new_model.state_dict()) and stats.version == 7
    assert outputs(before) != outputs(sampled_new)
    assert {c.policy_version for c in sampled_new} == {7} and info["weight_version"] == "7"
    assert {c.policy_version for c in sampled_old} == {8}
    assert worst_logprob_gap(sampled_new, new_model) < LOGPROB_TOLERANCE
    assert worst_logprob_gap(sampled_old, old_model) < LOGPROB_TOLERANCE


def test_distributed_sync_rejects_a_second_group_with_the_same_name_and_recovers(server):
    """SGLang refuses to initialise a group name it holds (400); destroying it makes the name usable again."""
    from app.rollout.joint import WeightUpdateGroup
    from app.rollout.sglang import RolloutRequestError

    async def go(client):
        sync = await DistributedWeightSync.connect(client, WeightSyncConfig(backend="gloo", timeout_s=30))
        name = sync.group.group_name
        clash = WeightUpdateGroup(world_size=2, group_name=name, backend="gloo", timeout_s=5)
        try:
            with pytest.raises(RolloutRequestError):
                await init_weights_update_group(
                    client, master_address="127.0.0.1", master_port=clash.master_port, world_size=2,
                    rank_offsets=[1], group_name=name, backend="gloo",
                )  # fmt: skip
        finally:
            clash.destroy()
            await sync.close()
        again = await DistributedWeightSync.connect(client, WeightSyncConfig(backend="gloo", timeout_s=30))
        await again.close()

    run_with_client(server.url, go)


# ------------------------------------------------------------------ a request in flight during an update


async def stream_long_request(url: str, on_started):
    """Stream one LONG-token request; call ``on_started()`` once the first tokens arrived. Returns the last
    chunk (cumulative: the whole answer)."""
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": LONG, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
    }
    started = False
    last = None
    async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
        async with http.stream("POST", url + "/generate", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                last = json.loads(data)
                if not started:
                    started = True
                    await on_started()
    return last


@pytest.mark.parametrize("method", ["disk", "distributed"])
def test_update_waits_for_the_request_in_flight(server, models, method):
    new_model = load_model(models.v1)

    async def go(client):
        sync = None
        if method == "distributed":
            sync = await DistributedWeightSync.connect(
                client, WeightSyncConfig(backend="gloo", timeout_s=120)
            )
        update: list[asyncio.Future] = []

        async def start_update():
            if sync is None:
                work = client.update_weights(WeightSource(path=models.v1), 3)
            else:
                work = sync.push(gather_weights(new_model), version=3)
            update.append(asyncio.ensure_future(work))
            await asyncio.sleep(0)  # let it send its first request

        # Whether the update waited is read from the server's own record (every token's weight version, below),
        # not from when this client saw which reply: on a starved CPU the stream's chunks sit in the socket
        # while the update's reply is read first, though the server finished the request before updating.
        try:
            last = await stream_long_request(server.url, start_update)
            await update[0]
            info = await client.model_info()
            after = await client.generate(PROMPTS, SAMPLED)
        finally:
            if sync is not None:
                await sync.close()
        return last, info, after

    last, info, after = run_with_client(server.url, go)
    meta = last["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and len(last["output_ids"]) == LONG
    assert {span["version"] for span in meta["weight_versions"]} == {"0"}  # every token from the old weights
    assert info["weight_version"] == "3" and {c.policy_version for c in after} == {3}


def test_abort_all_requests_aborts_the_request_in_flight(server, models):
    """SGLang 0.5.23 answers such an update with 200, or (when the aborted request is still in the scheduler)
    with 400 "Weights were updated, but the cache was not flushed" and no version label; either way the client
    call succeeds (it completes the second case: retract, flush, label, continue) and serves the new version."""

    async def go(client):
        update: list[asyncio.Future] = []

        async def start_update():
            work = client.update_weights(WeightSource(path=models.v1), 4, abort_all_requests=True)
            update.append(asyncio.ensure_future(work))
            await asyncio.sleep(0)

        last = await stream_long_request(server.url, start_update)
        await update[0]
        return last, await client.model_info(), await client.generate(PROMPTS, SAMPLED)

    last, info, after = run_with_client(server.url, go)
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(last["output_ids"]) < LONG
    assert info["weight_version"] == "4"
    assert {c.policy_version for c in after} == {4}


def test_updates_under_continuous_rollout_traffic(server, models):
    """The loop's situation: rollouts never stop while weights are pushed. Requests reach the scheduler as
    the update releases its lock, so SGLang may refuse the flush after an update; every update must still
    complete, label its version, and leave the server generating."""
    paths = [models.v1, models.v0, models.v1]

    async def go(client):
        stop = asyncio.Event()
        seen: list[int] = []
        before = int((await client.model_info())["weight_version"])

        async def traffic():
            while not stop.is_set():
                batch = await client.generate(
                    PROMPTS, SamplingParams(max_new_tokens=24, temperature=1.0, n=2)
                )
                seen.extend(c.policy_version for c in batch)

        async def abandoned_requests():  # cancelled mid-generation, as a run's producers are at shutdown
            while not stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(client.generate(PROMPTS, SamplingParams(max_new_tokens=200)), 0.3)

        workers = [asyncio.ensure_future(traffic()) for _ in range(3)]
        workers += [asyncio.ensure_future(abandoned_requests()) for _ in range(2)]
        try:
            await asyncio.sleep(1.0)
            for version, path in enumerate(paths, start=10):
                await client.update_weights(WeightSource(path=path), version)
                info = await client.model_info()
                assert info["weight_version"] == str(version)
                await asyncio.sleep(0.5)
        finally:
            stop.set()
            await asyncio.gather(*workers)
        return before, seen, await client.generate(PROMPTS, SAMPLED)

    before, seen, after = run_with_client(server.url, go)
    assert len(seen) > 0 and set(seen) <= {before, 10, 11, 12}
    assert {c.policy_version for c in after} == {12}


def test_completing_an_unflushed_update_while_a_request_runs(server, models):
    """The path taken after "Weights were updated, but the cache was not flushed", forced: the race that
    produces that answer (requests reaching the scheduler between the load and the flush) cannot be staged on
    demand, so the completion step runs while a long request is generating. A bare /flush_cache would be
    refused here; retract + flush + label + continue must succeed, label the version, and let the request
    finish normally."""

    async def go(client):
        done: list[asyncio.Future] = []

        async def complete_update():
            done.append(asyncio.ensure_future(client.finish_unflushed_update(server.url, "21")))
            await asyncio.sleep(0)

        last = await stream_long_request(server.url, complete_update)
        await done[0]
        return last, await client.model_info(), await client.generate(PROMPTS, SAMPLED)

    last, info, after = run_with_client(server.url, go)
    assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == LONG
    assert info["weight_version"] == "21"
    assert {c.policy_version for c in after} == {21}


def test_the_publish_check_reads_the_real_servers_input_logprobs_and_catches_stale_weights(server, models):
    """The probe of app/rollout/probe.py on real SGLang: ``input_token_logprobs`` (logprob_start_len 0) equal the
    trainer's float32 logprobs of the weights served, under the label served; a server that holds v0 while the
    trainer published v1 is flagged, and one that holds v1 is not."""
    from transformers import AutoTokenizer

    from app.rollout.probe import PublishCheck, PublishCheckConfig, probe_ids, reference_logprobs

    ids = probe_ids(AutoTokenizer.from_pretrained(models.v0))
    reference = {name: reference_logprobs(load_model(path), ids) for name, path in (("v0", models.v0), ("v1", models.v1))}

    async def go(client):
        start = await client.score(ids)
        await client.update_weights(WeightSource(path=models.v1), 1)
        return start, await client.score(ids)

    start, after = run_with_client(server.url, go)
    check = PublishCheck(PublishCheckConfig(), ids)
    check.start(start, reference["v0"], 0)
    assert check.start_gap < 1e-4  # float32 server against the float32 trainer
    assert check.failures(after, reference["v1"], 1) == []
    assert [r.weight_version for r in after] == ["1"]
    stale = check.failures(start, reference["v1"], 1)  # v0's reading, labelled 0, against v1's reference
    assert len(stale) == 1 and server.url in stale[0]
    relabelled = [type(r)(r.server, "1", r.logprobs) for r in start]  # the label moved, the weights did not
    [problem] = check.failures(relabelled, reference["v1"], 1)
    assert "nats away" in problem
