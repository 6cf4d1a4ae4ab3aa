"""SGLangClient against real HTTP servers on loopback.

``FakeSGLang`` below is a small real FastAPI app, served by uvicorn in a background thread, that answers with
the response shapes SGLang 0.5.23 was seen to produce (tests/sglang checks them against the real server): a flat prompt-major list for a batch and for n > 1, ``meta_info.output_token_logprobs`` as
``[logprob, token_id, null]`` triples, tagged ``finish_reason`` objects, ``weight_version`` plus
``weight_versions`` spans, 400 ``{"error": "unknown field ..."}`` for an unknown ``sampling_params`` key, 503 from
/health while starting. It can be told to fail: drop the connection mid-answer, answer 5xx/4xx, delay.
Its LoRA routes (/load_lora_adapter, /unload_lora_adapter, ``lora_path`` in /generate) follow SGLang 0.5.23's
source (entrypoints/http_server.py, managers/tokenizer_manager.py, lora/lora_registry.py): they run only on GPUs
(``--enable-lora`` fails on the CPU backend), so tests/gpu/test_sglang_lora_gpu.py checks them live.

Its generation rule is a fixed function of (prompt, sample index, position), so each test can say exactly which
tokens belong to which prompt and sample:
    token j of sample s of prompt p = (sum(p) + 10 * s + j) % 50 + 1,   logprob = -(j + 1) / 10 - s / 100.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from omegaconf import OmegaConf

from app.rollout.base import RolloutEngine, SamplingParams, WeightSource
from app.rollout.router import RouterWorkersError
from app.rollout.sglang import (
    RolloutRequestError,
    RolloutResponseError,
    RolloutServerError,
    SGLangClient,
    SGLangClientConfig,
    connect,
)

# api_types.SamplingParams of SGLang 0.5.23 (read in its source); anything else is a 400 there.
SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
}


def rule_token(prompt: list[int], sample: int, j: int) -> int:
    return (sum(prompt) + 10 * sample + j) % 50 + 1


@dataclass
class FakeSGLang:
    """State and fault switches of one fake server (read and set from the test thread)."""

    actions: list = field(default_factory=list)
    """Per /generate request, in order: "drop", "429", "500", "503", "400", "abort", "short_logprobs", ("delay", s)."""
    default_action: object = None
    """Used once `actions` is empty (e.g. "503" = fail forever)."""
    delay_s: float = 0.0
    health_status: int = 200
    healthy_at: float = 0.0
    """time.monotonic() after which /health answers 200 (while health_status is 200)."""
    weight_version: str = "default"
    spans: list | None = None
    update_success: bool = True
    loras: dict = field(default_factory=dict)
    """LoRA adapters loaded: name -> path."""
    lora_cache: dict = field(default_factory=dict)
    """Every adapter ever loaded (SGLang's lora_ref_cache): a request naming one that was unloaded reloads it."""
    requests: list = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def restart_lora(self) -> None:
        """What a restarted SGLang server knows of adapters: nothing."""
        self.loras.clear()
        self.lora_cache.clear()

    def reset(self) -> None:
        fresh = FakeSGLang()
        for name in fresh.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    def take_action(self):
        return self.actions.pop(0) if self.actions else self.default_action


def build_app(fake: FakeSGLang) -> object:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        action = request.state.action
        fake.in_flight += 1
        fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
        try:
            delay = action[1] if isinstance(action, tuple) else fake.delay_s
            if delay:
                await asyncio.sleep(delay)
            if action in ("429", "500", "503"):
                return JSONResponse({"error": "scheduler is overloaded"}, status_code=int(action))
            if action == "400":
                return JSONResponse({"error": "input_ids: prompt is longer than the context"}, status_code=400)
            unknown = set(body["sampling_params"]) - SGLANG_SAMPLING_KEYS
            if unknown:
                return JSONResponse({"error": f"unknown field `{sorted(unknown)[0]}`"}, status_code=400)
            lora = body.get("lora_path")
            if lora is not None and lora not in fake.loras:
                if lora not in fake.lora_cache:
                    message = f"Got LoRA adapter that has never been loaded: {lora}\nAll loaded adapters: {fake.loras}."
                    return JSONResponse({"error": {"message": message}}, status_code=400)
                fake.loras[lora] = fake.lora_cache[lora]  # "Reloading evicted adapter"
            sampling = body["sampling_params"]
            if body["input_ids"] and isinstance(body["input_ids"][0], int):  # one prompt, not a batch
                if body.get("logprob_start_len") == 0:  # a probe: its input tokens' logprobs
                    shift = int(lora.rsplit("-v", 1)[1]) / 100 if lora else 0.0  # each adapter scores it apart
                    triples = [[None if j == 0 else -0.5 - shift, t, None] for j, t in enumerate(body["input_ids"])]
                    return {"text": "", "output_ids": [1], "meta_info": {
                        "input_token_logprobs": triples, "output_token_logprobs": [[-0.1, 1, None]],
                        "finish_reason": {"type": "length", "length": 1}, "weight_version": fake.weight_version}}
                body["input_ids"] = [body["input_ids"]]
            n, max_new = sampling.get("n", 1), sampling.get("max_new_tokens", 128)
            stops = set(sampling.get("stop_token_ids") or [])
            items = []
            for prompt in body["input_ids"]:  # prompt-major, then sample: [p0s0, p0s1, p1s0, ...]
                for s in range(n):
                    ids, finish = [], {"type": "length", "length": max_new}
                    for j in range(max_new):
                        ids.append(rule_token(prompt, s, j))
                        if ids[-1] in stops:
                            finish = {"type": "stop", "matched": ids[-1]}
                            break
                    if action == "abort":
                        ids, finish = ids[:1], {"type": "abort", "message": "Abort before weight update",
                                                "status_code": 200, "err_type": None}
                    logprobs = [[-(j + 1) / 10 - s / 100, t, None] for j, t in enumerate(ids)]
                    if action == "short_logprobs":
                        logprobs = logprobs[:-1]
                    spans = fake.spans or [{"version": fake.weight_version, "start": 0, "end": len(ids)}]
                    items.append({"text": "", "output_ids": ids, "index": len(items), "meta_info": {
                        "id": f"r{len(items)}", "prompt_tokens": len(prompt), "completion_tokens": len(ids),
                        "finish_reason": finish, "output_token_logprobs": logprobs, "cached_tokens": 0,
                        "weight_version": fake.weight_version, "weight_versions": spans, "e2e_latency": 0.01,
                    }})
            return items
        finally:
            fake.in_flight -= 1

    @app.get("/health")
    async def health():
        ok = fake.health_status == 200 and time.monotonic() >= fake.healthy_at
        return Response(status_code=200 if ok else (fake.health_status if fake.health_status != 200 else 503))

    @app.get("/model_info")
    async def model_info():
        return {"model_path": "/models/tiny", "is_generation": True, "weight_version": fake.weight_version}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await request.json()
        if not fake.update_success:
            return JSONResponse({"success": False, "message": "Failed to get weights iterator: no safetensors",
                                 "num_paused_requests": 0}, status_code=400)
        fake.weight_version = body.get("weight_version") or fake.weight_version
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        if name in fake.loras:
            error = f"Failed to load LoRA adapter {name} because it is already loaded"
        elif not (Path(path) / "adapter_config.json").is_file():
            error = f"Failed to load LoRA adapter {name}: no adapter_config.json in {path}"
        else:
            fake.loras[name] = fake.lora_cache[name] = path
            return {"success": True, "error_message": "", "loaded_adapters": dict(fake.loras)}
        return JSONResponse({"success": False, "error_message": error, "loaded_adapters": None}, status_code=400)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        name = (await request.json())["lora_name"]
        if name not in fake.loras:
            error = f"LoRA with name {name} does not exist. Loaded LoRAs: {list(fake.loras)}"
            return JSONResponse({"success": False, "error_message": error}, status_code=400)
        del fake.loras[name]
        return {"success": True, "error_message": "", "loaded_adapters": dict(fake.loras)}

    @app.post("/flush_cache")
    async def flush_cache():
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details.\n")

    @app.post("/pause_generation")
    async def pause_generation():
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def asgi(scope, receive, send):
        """Records every request; picks the /generate action; "drop" cuts the connection mid-answer."""
        if scope["type"] != "http":
            return await app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        fake.requests.append((scope["path"], raw))
        action = fake.take_action() if scope["path"] == "/generate" else None
        if action == "drop":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")]})
            await send({"type": "http.response.body", "body": b"[", "more_body": True})
            raise ConnectionAbortedError("fake server drops the connection")  # uvicorn closes the socket
        scope.setdefault("state", {})["action"] = action
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}

        return await app(scope, replay, send)

    return asgi


class ServerThread:
    """uvicorn on a free loopback port, in a daemon thread."""

    def __init__(self, app, *, lifespan: str = "off") -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="critical", lifespan=lifespan, timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


@pytest.fixture(scope="module")
def servers():
    fakes = [FakeSGLang(), FakeSGLang()]
    threads = [ServerThread(build_app(fake)) for fake in fakes]
    yield [(thread.url, fake) for thread, fake in zip(threads, fakes, strict=True)]
    for thread in threads:
        thread.stop()


@pytest.fixture
def one(servers):
    for _, fake in servers:
        fake.reset()
    return servers[0]


@pytest.fixture
def two(servers):
    for _, fake in servers:
        fake.reset()
    return servers


def config(*urls: str, **overrides) -> SGLangClientConfig:
    fast = {"timeout_s": 5.0, "connect_timeout_s": 1.0, "max_retries": 2, "backoff_s": 0.01,
            "health_timeout_s": 2.0}
    return SGLangClientConfig(urls=list(urls), **{**fast, **overrides})


def run(coro_fn, *args, **kwargs):
    """Run ``coro_fn(client)`` with a client built (and closed) inside a fresh event loop."""
    cfg = args[0]

    async def main():
        async with SGLangClient(cfg, **kwargs) as client:
            return await coro_fn(client)

    return asyncio.run(main())


def free_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # closed again: nothing listens there


PARAMS = SamplingParams(max_new_tokens=3, temperature=1.0, n=1)


# ------------------------------------------------------------------ shapes


def test_single_prompt_request_body_and_parsed_completion(one):
    url, fake = one
    [c] = run(lambda client: client.generate([[1, 2, 3]], PARAMS), config(url))
    # sum = 6: tokens 7, 8, 9; logprobs -0.1, -0.2, -0.3; ran to max_new_tokens.
    assert c.prompt_ids == [1, 2, 3]
    assert c.output_ids == [7, 8, 9]
    assert c.output_logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert c.finish_reason == "length"
    assert c.policy_version == 0  # label "default" = the weights held before the client's first push
    assert c.meta["server"] == url and c.meta["weight_version"] == "default"
    [(path, raw)] = fake.requests
    assert path == "/generate"
    assert json.loads(raw) == {
        "input_ids": [[1, 2, 3]],
        "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "top_p": 1.0, "n": 1, "stop_token_ids": []},
        "return_logprob": True,
    }


def test_batches_and_n_keep_prompt_major_order_across_requests(one):
    url, fake = one
    prompts = [[1], [2, 2], [3], [4, 0], [5]]
    params = SamplingParams(max_new_tokens=2, n=3, seed=11)
    completions = run(lambda client: client.generate(prompts, params), config(url, batch_size=2))
    assert len(fake.requests) == 3  # 2 + 2 + 1 prompts
    assert len(completions) == 15
    for k, c in enumerate(completions):
        p, s = divmod(k, 3)
        assert c.prompt_ids == prompts[p]
        assert c.output_ids == [rule_token(prompts[p], s, 0), rule_token(prompts[p], s, 1)]
        assert c.output_logprobs == pytest.approx([-0.1 - s / 100, -0.2 - s / 100])
    seeds = [json.loads(raw)["sampling_params"]["sampling_seed"] for _, raw in fake.requests]
    assert sorted(seeds) == [11, 12, 13]  # one seed per request: batches do not repeat each other's draws


def test_finish_reasons_stop_and_abort(one):
    url, fake = one
    stop_at = rule_token([10], 0, 1)  # the second token of prompt [10]
    params = SamplingParams(max_new_tokens=5, stop_token_ids=(stop_at,))
    [stopped] = run(lambda client: client.generate([[10]], params), config(url))
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == [rule_token([10], 0, 0), stop_at]  # the stop token is kept, with its logprob
    assert len(stopped.output_logprobs) == 2

    fake.actions = ["abort"]
    [aborted] = run(lambda client: client.generate([[10]], PARAMS), config(url))
    assert aborted.finish_reason == "abort"
    assert aborted.output_ids == [rule_token([10], 0, 0)]
    assert aborted.meta["abort_message"] == "Abort before weight update"


def test_weight_version_becomes_policy_version(one):
    url, fake = one
    fake.weight_version = "7"
    [c] = run(lambda client: client.generate([[1]], PARAMS), config(url))
    assert c.policy_version == 7

    # An update landed mid-generation: tokens 0-1 from v3, 1-3 from v4. The oldest version is reported, so a
    # staleness bound on policy_version is never too lenient; the spans travel in meta.
    fake.weight_version, fake.spans = "4", [{"version": "3", "start": 0, "end": 1},
                                             {"version": "4", "start": 1, "end": 3}]
    [c] = run(lambda client: client.generate([[1]], PARAMS), config(url))
    assert c.policy_version == 3
    assert c.meta["weight_versions"] == [{"version": 3, "start": 0, "end": 1}, {"version": 4, "start": 1, "end": 3}]

    # A label the client never set (a launch flag such as --weight-version v0) = the constructor's version.
    fake.weight_version, fake.spans = "v0", None
    [c] = run(lambda client: client.generate([[1]], PARAMS), config(url), policy_version=5)
    assert c.policy_version == 5


def test_inconsistent_answer_names_the_server_and_the_request(one):
    url, fake = one
    fake.actions = ["short_logprobs"]
    with pytest.raises(RolloutResponseError) as err:
        run(lambda client: client.generate([[1]], PARAMS), config(url))
    message = str(err.value)
    assert url in message and "/generate request 1/1 (prompts 0..0)" in message
    assert "3 output_ids but 2 output_token_logprobs" in message
    assert len(fake.requests) == 1  # a malformed answer is a server bug: not retried


def test_client_satisfies_the_rollout_engine_protocol(one):
    url, _ = one
    assert run(lambda client: asyncio.sleep(0, isinstance(client, RolloutEngine)), config(url))


# ------------------------------------------------------------------ scheduling


def test_round_robin_over_two_servers_continues_across_calls(two):
    (url_a, fake_a), (url_b, fake_b) = two

    async def go(client):
        first = await client.generate([[1], [2], [3]], PARAMS)
        second = await client.generate([[4]], PARAMS)
        return first + second

    completions = run(go, config(url_a, url_b, batch_size=1))
    assert [c.meta["server"] for c in completions] == [url_a, url_b, url_a, url_b]
    assert [c.prompt_ids for c in completions] == [[1], [2], [3], [4]]
    assert len(fake_a.requests) == 2 and len(fake_b.requests) == 2


def test_concurrency_is_bounded_per_server(one):
    url, fake = one
    fake.delay_s = 0.1
    completions = run(lambda client: client.generate([[i] for i in range(6)], PARAMS),
                      config(url, batch_size=1, max_concurrency=2))
    assert len(completions) == 6
    assert fake.max_in_flight == 2  # requests did overlap, never more than two at once


# ------------------------------------------------------------------ failures


@pytest.mark.parametrize("failure", ["drop", "500", "429"])
def test_dropped_connection_or_busy_server_is_retried(one, failure):
    url, fake = one
    fake.actions = [failure]
    [c] = run(lambda client: client.generate([[1, 2, 3]], PARAMS), config(url))
    assert c.output_ids == [7, 8, 9]
    assert fake.paths() == ["/generate", "/generate"]


def test_503_moves_the_request_to_the_next_server(two):
    (url_a, fake_a), (url_b, fake_b) = two
    fake_a.actions = ["503"]
    [c] = run(lambda client: client.generate([[1, 2, 3]], PARAMS), config(url_a, url_b))
    assert c.meta["server"] == url_b and c.output_ids == [7, 8, 9]
    assert len(fake_a.requests) == 1 and len(fake_b.requests) == 1


def test_4xx_is_not_retried_and_carries_the_servers_message(one):
    url, fake = one
    fake.actions = ["400"]
    with pytest.raises(RolloutRequestError) as err:
        run(lambda client: client.generate([[1]], PARAMS), config(url))
    assert url in str(err.value) and "HTTP 400" in str(err.value)
    assert "prompt is longer than the context" in str(err.value)
    assert len(fake.requests) == 1


def test_all_retries_exhausted_names_the_urls_and_the_last_error(two):
    (url_a, fake_a), (url_b, fake_b) = two
    fake_a.default_action = fake_b.default_action = "503"
    with pytest.raises(RolloutServerError) as err:
        run(lambda client: client.generate([[1]], PARAMS), config(url_a, url_b, max_retries=2))
    message = str(err.value)
    assert "after 3 attempt(s)" in message and url_a in message and url_b in message
    assert "HTTP 503 scheduler is overloaded" in message
    assert len(fake_a.requests) + len(fake_b.requests) == 3


def test_timeout_is_honoured(one):
    url, fake = one
    fake.delay_s = 2.0
    with pytest.raises(RolloutServerError) as err:
        run(lambda client: client.generate([[1]], PARAMS), config(url, timeout_s=0.3, max_retries=0))
    # The client's own timeout ended the call (the server would have answered after 2 s).
    assert "timed out after 0.3 s" in str(err.value) and url in str(err.value)


def test_nothing_listening(one):
    dead = free_port_url()
    with pytest.raises(RolloutServerError) as err:
        run(lambda client: client.generate([[1]], PARAMS), config(dead, max_retries=1))
    assert dead in str(err.value) and "ConnectError" in str(err.value)
    assert run(lambda client: client.health(), config(dead)) is False
    with pytest.raises(RolloutServerError, match="ConnectError"):
        run(lambda client: client.wait_healthy(0.3), config(dead))


# ------------------------------------------------------------------ weights, health, admin


def test_update_weights_from_disk_reaches_every_server_with_the_version(two, tmp_path: Path):
    (url_a, fake_a), (url_b, fake_b) = two

    async def go(client):
        await client.update_weights(WeightSource(path=tmp_path), 3)
        return await client.generate([[1], [2]], PARAMS)

    completions = run(go, config(url_a, url_b, batch_size=1))
    for fake in (fake_a, fake_b):
        [(path, raw)] = [r for r in fake.requests if r[0] == "/update_weights_from_disk"]
        assert json.loads(raw) == {"model_path": str(tmp_path), "weight_version": "3"}
    assert [c.policy_version for c in completions] == [3, 3]


def test_update_weights_errors(one, tmp_path: Path):
    url, fake = one
    with pytest.raises(ValueError, match="save the weights"):
        run(lambda client: client.update_weights(WeightSource(state_dict={"w": torch.zeros(1)}), 1), config(url))
    fake.update_success = False
    with pytest.raises(RolloutRequestError, match="no safetensors"):
        run(lambda client: client.update_weights(WeightSource(path=tmp_path), 1), config(url))


def test_wait_healthy_names_a_server_that_stays_starting(two):
    (url_a, fake_a), (url_b, fake_b) = two
    fake_b.health_status = 503  # for ever: only wait_healthy's own 0.4 s budget can end the wait
    with pytest.raises(RolloutServerError) as err:
        run(lambda client: client.wait_healthy(0.4), config(url_a, url_b))
    assert url_b in str(err.value) and "HTTP 503" in str(err.value) and url_a not in str(err.value)
    assert run(lambda client: client.health(), config(url_a, url_b)) is False


def test_connect_waits_until_the_server_is_up(one):
    url, fake = one
    fake.healthy_at = time.monotonic() + 0.3

    async def main():
        client = await connect(config(url))
        try:
            return await client.health()
        finally:
            await client.close()

    assert asyncio.run(main()) is True
    assert fake.paths().count("/health") >= 2  # it polled through the 503s


def test_admin_calls(two):
    (url_a, fake_a), (url_b, fake_b) = two

    async def go(client):
        info = await client.model_info(url_b)
        await client.pause_generation("in_place")
        await client.flush_cache()
        await client.continue_generation()
        return info

    info = run(go, config(url_a, url_b))
    assert info["weight_version"] == "default" and info["model_path"] == "/models/tiny"
    assert fake_a.paths() == ["/pause_generation", "/flush_cache", "/continue_generation"]
    assert fake_b.paths() == ["/model_info", "/pause_generation", "/flush_cache", "/continue_generation"]
    assert fake_a.requests[0][1] == b'{"mode":"in_place"}'


# ------------------------------------------------------------------ config


def test_config_is_omegaconf_structured_and_validated():
    base = OmegaConf.structured(SGLangClientConfig)
    cfg = OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.from_dotlist(["urls=[http://h:1,http://h:2]"])))
    assert cfg.urls == ["http://h:1", "http://h:2"]
    for field_name, value in [("timeout_s", 0), ("connect_timeout_s", -1), ("max_concurrency", 0),
                              ("max_retries", -1), ("backoff_s", -0.1), ("health_timeout_s", 0),
                              ("batch_size", 0)]:
        with pytest.raises(ValueError, match=f"rollout.sglang.{field_name} "):
            SGLangClientConfig(**{field_name: value})
    with pytest.raises(ValueError, match=r"rollout.sglang.urls\[0\] must be an http"):
        SGLangClientConfig(urls=["127.0.0.1:30000"])
    with pytest.raises(ValueError, match="rollout.sglang.urls is empty"):
        SGLangClient(SGLangClientConfig())


# ------------------------------------------------------------------ the built-in CPU server

def test_against_the_builtin_cpu_server(tmp_path: Path):
    """The same client drives the built-in CPU server: outputs equal its engine's own, weight sync included."""
    from app.rollout.embedded import EmbeddedEngine
    from app.serving.native import create_app
    from tests.helpers import random_qwen2

    random_qwen2(0).save_pretrained(tmp_path / "a")
    random_qwen2(1).save_pretrained(tmp_path / "b")
    reference = EmbeddedEngine.from_pretrained(tmp_path / "a")
    served = ServerThread(create_app(EmbeddedEngine.from_pretrained(tmp_path / "a"), model_path=str(tmp_path / "a"),
                                     weight_version="0", batch_window_ms=1), lifespan="on")
    prompts = [[3, 4, 5], [6], [7, 8]]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, n=2)

    async def go(client):
        await client.wait_healthy(10)
        before = await client.generate(prompts, params)
        await client.update_weights(WeightSource(path=tmp_path / "b"), 1)
        after = await client.generate(prompts, params)
        return before, after, await client.model_info()

    try:
        before, after, info = run(go, config(served.url, batch_size=2, timeout_s=30))
    finally:
        served.stop()
    expected_before = reference.generate_sync(prompts, params)
    reference.update_weights_sync(WeightSource(path=tmp_path / "b"), 1)
    expected_after = reference.generate_sync(prompts, params)
    for got, expected, version in [(before, expected_before, 0), (after, expected_after, 1)]:
        assert len(got) == len(expected) == 6
        for g, e in zip(got, expected, strict=True):
            assert g.prompt_ids == e.prompt_ids and g.output_ids == e.output_ids
            assert g.output_logprobs == pytest.approx(e.output_logprobs, abs=1e-5)
            assert g.finish_reason == e.finish_reason and g.policy_version == version
    assert [c.output_ids for c in before] != [c.output_ids for c in after]
    assert info["weight_version"] == "1"


# ------------------------------------------------------------------ behind a router (rollout.sglang.router)


def test_behind_a_router_the_workers_are_those_it_lists_that_answer_and_none_answering_is_one_clear_error(
    two, caplog
):
    """A stand-in for sglang-router's GET /workers (the real router: tests/sglang/test_router.py); the workers
    are the fake SGLang servers, and one listed URL has nothing behind it."""
    (url_a, _), (url_b, _) = two
    dead = free_port_url()
    listed = {"workers": [{"id": "1", "url": url_a + "/"}, {"id": "2", "url": dead}, {"id": "3", "url": url_b}]}
    app = FastAPI()
    app.get("/workers")(lambda: listed)
    router = ServerThread(app)
    try:
        async def refresh(client):
            await client.wait_healthy()
            return list(client.urls)

        with caplog.at_level("WARNING"):
            assert run(refresh, SGLangClientConfig(router=router.url, health_timeout_s=2.0)) == sorted([url_a, url_b])
        assert f"worker {dead} behind the router {router.url} does not answer GET /health: it gets no weights" in caplog.text

        listed["workers"] = [{"id": "2", "url": dead}]
        with pytest.raises(RolloutServerError) as err:
            run(lambda client: client.wait_healthy(0.5), SGLangClientConfig(router=router.url))
        message = str(err.value)
        assert f"no worker behind the router {router.url} answers GET /health here: {dead}" in message
        assert "reachable from the trainer at the URL the router lists" in message
    finally:
        router.stop()
    # A server that is not a router (no GET /workers): said at once, not waited on.
    with pytest.raises(RouterWorkersError, match="is this an sglang-router"):
        run(lambda client: client.wait_healthy(), SGLangClientConfig(router=url_b, health_timeout_s=600.0))
