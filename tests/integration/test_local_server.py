"""The built-in CPU rollout server, spoken to over real HTTP with SGLang's request and response shapes.

The expected shapes are SGLang 0.5.23's (its http_server.py and io_struct.py, and what a live server answered;
tests/sglang runs the same client against the real one). Servers are real uvicorn servers on free loopback ports (a background thread, or the
`trustbatch rollout-server` command as a subprocess).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from app.rollout.base import SamplingParams, WeightSource
from app.rollout.embedded import EmbeddedEngine
from app.rollout.sglang import SGLangClient, SGLangClientConfig
from app.serving.native import create_app
from trainer.model import build_tiny_tokenizer

from .conftest import REPO

PROMPTS = [[72, 101, 108, 108, 111], [50, 43, 50, 61]]  # different lengths, so prompt_tokens tells them apart


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThreadServer:
    """A real uvicorn server for `app` in a daemon thread."""

    def __init__(self, app) -> None:
        port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def close(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _start(model_dir, **kwargs) -> ThreadServer:
    from transformers import AutoTokenizer

    engine = EmbeddedEngine.from_pretrained(model_dir)
    app = create_app(
        engine, model_path=str(model_dir), tokenizer=AutoTokenizer.from_pretrained(model_dir), **kwargs
    )
    return ThreadServer(app)


@pytest.fixture(scope="module")
def server(model_dirs):
    srv = _start(model_dirs[0], max_batch_size=256, batch_window_ms=50)
    yield srv
    srv.close()


def _logprob_triples_match(meta: dict, output_ids: list[int]) -> None:
    triples = meta["output_token_logprobs"]
    assert len(triples) == len(output_ids) == meta["completion_tokens"]
    for (logprob, token, text), out in zip(triples, output_ids, strict=True):
        assert isinstance(logprob, float) and logprob <= 0
        assert token == out and text is None


def test_single_prompt_answers_one_dict_with_sglang_meta_info(server):
    r = server.client.post(
        "/generate",
        json={
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "return_logprob": True,
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, dict) and set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert {
        "id",
        "prompt_tokens",
        "completion_tokens",
        "finish_reason",
        "weight_version",
        "e2e_latency",
    } <= set(meta)
    assert meta["prompt_tokens"] == len(PROMPTS[0]) and meta["weight_version"] == "0"
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": meta["completion_tokens"]}]
    _logprob_triples_match(meta, out["output_ids"])
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"] == {"type": "length", "length": 6} and len(out["output_ids"]) == 6
    else:
        assert meta["finish_reason"] == {"type": "stop", "matched": out["output_ids"][-1]}
    assert out["text"] == build_tiny_tokenizer().decode(out["output_ids"], skip_special_tokens=True)


def test_stop_token_gives_a_stop_finish_reason_with_the_matched_id(server):
    every_id = list(range(259))  # whatever is sampled first stops the sequence
    out = server.client.post(
        "/generate", json={"input_ids": PROMPTS[1], "sampling_params": {"stop_token_ids": every_id}}
    ).json()
    assert len(out["output_ids"]) == 1 and "output_token_logprobs" not in out["meta_info"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": out["output_ids"][0]}


def test_batch_with_n_is_a_flat_prompt_major_list(server):
    body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 4, "n": 2}, "return_logprob": True}
    items = server.client.post("/generate", json=body).json()
    assert isinstance(items, list) and len(items) == 4
    assert [it["meta_info"]["prompt_tokens"] for it in items] == [5, 5, 4, 4]  # [p0s0, p0s1, p1s0, p1s1]
    assert [it["index"] for it in items] == [0, 1, 2, 3]
    assert len({it["meta_info"]["id"] for it in items}) == 4
    for it in items:
        _logprob_triples_match(it["meta_info"], it["output_ids"])
    # One prompt with n > 1 is a list too; a batch of one prompt with n = 1 as well.
    assert (
        len(
            server.client.post(
                "/generate", json={"input_ids": PROMPTS[0], "sampling_params": {"n": 3, "max_new_tokens": 2}}
            ).json()
        )
        == 3
    )
    assert isinstance(
        server.client.post(
            "/generate", json={"input_ids": [PROMPTS[0]], "sampling_params": {"max_new_tokens": 2}}
        ).json(),
        list,
    )


def test_per_prompt_sampling_params_and_text_input(server):
    body = {"input_ids": PROMPTS, "sampling_params": [{"max_new_tokens": 3, "n": 2}, {"max_new_tokens": 1}]}
    items = server.client.post("/generate", json=body).json()
    assert [it["meta_info"]["prompt_tokens"] for it in items] == [5, 5, 4]
    assert items[2]["meta_info"]["completion_tokens"] == 1
    out = server.client.post(
        "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
    ).json()
    assert out["meta_info"]["prompt_tokens"] == 5


def test_logprobs_equal_the_engines_own_for_the_same_seed(server, model_dirs):
    reference = EmbeddedEngine.from_pretrained(model_dirs[0])
    expected = reference.generate_sync(
        PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.8, n=2, seed=7)
    )
    body = {
        "input_ids": PROMPTS,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.8, "n": 2, "sampling_seed": 7},
        "return_logprob": True,
    }
    items = server.client.post("/generate", json=body).json()
    for item, completion in zip(items, expected, strict=True):
        assert item["output_ids"] == completion.output_ids
        logprobs = [lp for lp, _, _ in item["meta_info"]["output_token_logprobs"]]
        assert logprobs == pytest.approx(completion.output_logprobs, abs=1e-6)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"input_ids": [1, 2], "sampling_params": {"max_new_token": 4}}, "unknown field `max_new_token`"),
        ({"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}, "regex"),
        ({"input_ids": [1, 2], "sampling_params": {"json_schema": "{}"}}, "json_schema"),
        ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 5}}, "top_k"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": [{}, {}]}, "2 entries"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [[1], []]}, "input_ids[1] is empty"),
        ({"input_ids": ["a"]}, "input_ids"),
        ({"input_ids": [1, 99999]}, "outside"),
        ({"input_ids": [1], "text": "hi"}, "exactly one"),
        ({"sampling_params": {}}, "exactly one"),
        ({"input_ids": [1], "stream": True}, "stream"),
        ([1, 2, 3], "JSON object"),
    ],
)
def test_bad_requests_get_400_json_errors(server, body, fragment):
    r = server.client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]


def test_malformed_json_gets_400_and_unknown_top_level_keys_are_ignored(server):
    for raw in (b"{not json", b"[" * 100_000, b'{"input_ids": [' + b"9" * 5000 + b"]}", b"\xff\xfe"):
        r = server.client.post("/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"], raw[:20]
    r = server.client.post(
        "/generate",
        json={"input_ids": [1, 2], "some_future_key": 1, "sampling_params": {"max_new_tokens": 1}},
    )
    assert r.status_code == 200
    r = server.client.post(
        "/update_weights_from_disk", content=b"[", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["success"] is False
    assert server.client.get("/health").status_code == 200


def test_concurrent_requests_are_batched(server):
    before = server.client.get("/server_info").json()["trustbatch"]

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
            return await asyncio.gather(*(client.post("/generate", json=body) for _ in range(16)))

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    assert all(len(r.json()["output_ids"]) == r.json()["meta_info"]["completion_tokens"] for r in responses)
    after = server.client.get("/server_info").json()["trustbatch"]
    assert after["requests"] - before["requests"] == 16
    assert after["sequences"] - before["sequences"] == 16
    assert after["generate_calls"] - before["generate_calls"] < 16, (before, after)
    assert after["largest_batch"] > 1


def test_health_model_info_server_info_and_flush_cache(server, model_dirs):
    assert server.client.get("/health").status_code == 200
    assert server.client.get("/health_generate").status_code == 200
    info = server.client.get("/model_info").json()
    assert info["model_path"] == str(model_dirs[0]) and info["is_generation"] is True
    assert info["weight_version"] == "0" and {"served_model_name", "tokenizer_path"} <= set(info)
    assert server.client.get("/get_model_info").json() == info
    assert server.client.get("/server_info").json()["max_batch_size"] == 256
    assert server.client.post("/flush_cache").status_code == 200


def test_pause_holds_new_requests_until_continue(server):
    assert server.client.post("/pause_generation", json={"mode": "in_place"}).json()["status"] == "ok"

    async def held():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            task = asyncio.create_task(
                client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
            )
            await asyncio.sleep(0.4)
            assert not task.done()
            assert (await client.get("/server_info")).json()["trustbatch"]["paused"] is True
            await client.post("/continue_generation", json={})
            return await asyncio.wait_for(task, 30)

    assert asyncio.run(held()).status_code == 200
    assert server.client.post("/pause_generation", json={"mode": "sideways"}).status_code == 400


def test_update_weights_from_disk_changes_outputs_and_weight_version(model_dirs):
    dir_a, dir_b = model_dirs
    srv = _start(dir_a)
    try:
        greedy = {
            "input_ids": PROMPTS,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0},
            "return_logprob": True,
        }
        before = srv.client.post("/generate", json=greedy).json()

        async def update_while_generating():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                running = asyncio.create_task(client.post("/generate", json=greedy))
                while (await client.get("/server_info")).json()["trustbatch"]["requests"] < 2:
                    await asyncio.sleep(0.005)
                update = await client.post(
                    "/update_weights_from_disk", json={"model_path": str(dir_b), "weight_version": "7"}
                )
                return (await running).json(), update

        in_flight, update = asyncio.run(update_while_generating())
        assert update.status_code == 200, update.text
        assert update.json() == {
            "success": True,
            "message": update.json()["message"],
            "num_paused_requests": 0,
        }
        # The update waited for the request in flight, which finished on the old weights.
        assert [it["meta_info"]["weight_version"] for it in in_flight] == ["0", "0"]
        assert [it["output_ids"] for it in in_flight] == [it["output_ids"] for it in before]

        after = srv.client.post("/generate", json=greedy).json()
        assert [it["meta_info"]["weight_version"] for it in after] == ["7", "7"]
        assert [it["output_ids"] for it in after] != [it["output_ids"] for it in before]
        info = srv.client.get("/model_info").json()
        assert info["weight_version"] == "7" and info["model_path"] == str(dir_b)

        bad = srv.client.post("/update_weights_from_disk", json={"model_path": str(dir_b / "missing")})
        assert bad.status_code == 400 and bad.json()["success"] is False
        assert srv.client.get("/model_info").json()["weight_version"] == "7"
    finally:
        srv.close()


def test_rollout_server_command_serves_until_stopped(model_dirs, monkeypatch):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "app.cli",
        "rollout-server",
        "--model",
        str(model_dirs[0]),
        "--port",
        str(port),
        "--max-body-bytes",
        "4096",
    ]
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "rollout-server never became healthy"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        out = httpx.post(
            f"{url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        ).json()
        assert out["meta_info"]["completion_tokens"] >= 1
        # --max-body-bytes reaches the server: a body past it answers 413.
        big = httpx.post(f"{url}/generate", json={"input_ids": [1] * 4000, "sampling_params": {}})
        assert big.status_code == 413 and "max_body_bytes" in big.json()["error"]
        assert httpx.get(f"{url}/server_info").json()["max_body_bytes"] == 4096
        # A weight directory given relative to the trainer's working directory (run.dir defaults to runs/<name>)
        # reaches a server working elsewhere: the client sends it absolute.
        monkeypatch.chdir(model_dirs[1].parent)
        client = SGLangClient(SGLangClientConfig(urls=[url]))
        asyncio.run(client.update_weights(WeightSource(path=Path(model_dirs[1].name)), 3))
        assert httpx.get(f"{url}/get_model_info").json()["weight_version"] == "3"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_pause_with_abort_answers_queued_requests_with_an_abort(server):
    async def aborted():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            await client.post("/pause_generation", json={"mode": "in_place"})
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
            task = asyncio.create_task(client.post("/generate", json=body))
            while (await client.get("/server_info")).json()["trustbatch"]["queued"] < 1:
                await asyncio.sleep(0.005)
            await client.post("/pause_generation", json={"mode": "abort"})
            response = await asyncio.wait_for(task, 30)
            await client.post("/continue_generation")
            return response.json()

    out = asyncio.run(aborted())
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    assert (
        server.client.post(
            "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        ).status_code
        == 200
    )
