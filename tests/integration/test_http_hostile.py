"""Hostile and malformed requests against both built-in HTTP servers, over real HTTP.

`trustbatch serve` (app/serving/openai.py, OpenAI routes) and the rollout server (app/serving/native.py,
SGLang's native routes) both serve the warm-started tiny model (`tiny_model_dir`) under uvicorn on free loopback ports.
Every malformed request must answer a 4xx JSON error, leave the keep-alive connection usable and the server
healthy; oversized bodies answer 413; a client that hangs up mid-body logs one line; heavy work (tokenizing a
huge prompt) must not hold up other clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time

import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.rollout.embedded import EmbeddedEngine
from app.serving.native import create_app
from app.serving.openai import create_openai_app
from app.serving.server import build_app

from .model_refs import ThreadServer

NAME = "tiny"
MiB = 1 << 20


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def serve_server(tiny_model_dir):
    srv = ThreadServer(build_app(tiny_model_dir, model_name=NAME, batch_window_ms=20))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def rollout_server(tiny_model_dir, tokenizer):
    engine = EmbeddedEngine.from_pretrained(tiny_model_dir)
    srv = ThreadServer(
        create_app(engine, model_path=str(tiny_model_dir), tokenizer=tokenizer, batch_window_ms=20)
    )
    yield srv
    srv.close()


def _post(client: httpx.Client, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post(path, content=content, headers={"content-type": "application/json"})


def _local_port(response: httpx.Response) -> int | None:
    """The client-side port of the connection that carried ``response`` (None once it is closed)."""
    try:
        return response.extensions["network_stream"].get_extra_info("client_addr")[1]
    except (OSError, KeyError, TypeError):
        return None


def _assert_still_serving(client: httpx.Client, response: httpx.Response) -> None:
    """The connection that carried ``response`` stays open and carries the next request; health is fine."""
    assert "close" not in response.headers.get("connection", "").lower(), response.headers
    port = _local_port(response)
    health = client.get("/health")
    assert health.status_code == 200
    assert port is not None and _local_port(health) == port, "the keep-alive connection was dropped"


DEEP = "[" * 500 + "]" * 500  # nested deep, though not too deep for the JSON parser

SERVE_ROWS = [
    # (path, body, status, param); param ... = not checked (it names a field the server could not print).
    ("/v1/completions", "", 400, None),
    ("/v1/completions", "null", 400, None),
    ("/v1/completions", '"just a string"', 400, None),
    ("/v1/completions", '{"model": "tiny", "prompt": "1=", "temperature": 1e-320}', 400, "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": "1=", "temperature": 5e-324}', 400, "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": "1=", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": "1=", "temperature": Infinity}', 400, "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": "1=", "temperature": 1e999}', 400, "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": "1=", "top_p": NaN}', 400, "top_p"),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "top_p": -0.5}, 400, "top_p"),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "max_tokens": 2**70}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "max_tokens": 3.5}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "n": 10**30}, 400, "n"),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "seed": True}, 400, "seed"),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "logprobs": 10**30}, 400, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "stop_token_ids": [2**70]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "stop": ["\ud800"]}, 400, "stop"),
    ("/v1/completions", {"model": NAME, "prompt": ["1=", "\udfff"]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": {"text": "1="}}, 400, "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ' + DEEP + "}", 400, ...),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "\ud800": 1}, 400, ...),
    ("/v1/completions", {"model": "\ud800", "prompt": "1="}, 404, "model"),
    ("/v1/completions", {"model": NAME, "prompt": "1=", "stream": 1}, 400, "stream"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "\ud800"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                              "temperature": 1e-320}, 400, "temperature"),
    ("/v1/chat/completions", {"model": NAME, "messages": [1]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"model": NAME}, 400, "messages"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param"), SERVE_ROWS)
def test_serve_answers_malformed_requests_with_openai_errors(serve_server, path, body, status, param):
    response = _post(serve_server.client, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not ...:
        assert error["param"] == param
    _assert_still_serving(serve_server.client, response)


ROLLOUT_ROWS = [
    # (body, a fragment of the error message)
    ("", "not valid JSON"),
    ("null", "JSON object"),
    ({"text": "\ud800"}, "text"),
    ({"text": ["1=", "a\udc00b"]}, "text[1]"),
    ({"text": "1=", "rid": "\ud800"}, "rid"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": 1e-320}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ('{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}', "temperature"),
    ('{"input_ids": [1, 2], "sampling_params": {"temperature": Infinity}}', "temperature"),
    ('{"input_ids": [1, 2], "sampling_params": {"temperature": 1' + "0" * 400 + "}}", "temperature"),
    ('{"input_ids": [1, 2], "sampling_params": {"top_p": NaN}}', "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**70}}, "sampling_seed"),
    ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": -(2**63) - 1}}, "sampling_seed"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -5}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2**70}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 0}}, "n"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 10**12}}, "n"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [2**70]}}, "stop_token_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [1.5]}}, "stop_token_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"\ud800": 1}}, "unknown field"),
    ({"input_ids": [1, 2], "sampling_params": "greedy"}, "sampling_params"),
    ({"input_ids": [1, 10**30]}, "outside"),
    ({"input_ids": {"a": 1}}, "input_ids"),
    ('{"input_ids": ' + DEEP + "}", "input_ids"),
    ({"text": [1, 2]}, "text"),
    ({"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1, 2], "logprob_start_len": 10**30}, "logprob_start_len"),
    ({}, "exactly one"),
]


@pytest.mark.parametrize(("body", "fragment"), ROLLOUT_ROWS)
def test_rollout_server_answers_malformed_requests_with_json_errors(rollout_server, body, fragment):
    response = _post(rollout_server.client, "/generate", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert isinstance(error, str) and fragment in error
    _assert_still_serving(rollout_server.client, response)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999", '"hot"', "true"])
def test_both_apis_refuse_the_same_temperatures_with_the_same_message(serve_server, rollout_server, value):
    # One check (app/sampling.py) behind both APIs: a value refused by one is refused by the other, in the
    # same words, with the field named the API's way.
    openai = _post(
        serve_server.client, "/v1/completions", f'{{"model": "tiny", "prompt": "1=", "temperature": {value}}}'
    )
    native = _post(
        rollout_server.client,
        "/generate",
        f'{{"input_ids": [1, 2], "sampling_params": {{"temperature": {value}}}}}',
    )
    assert openai.status_code == native.status_code == 400, (openai.text, native.text)
    message = openai.json()["error"]["message"]
    assert message.startswith("temperature must be") and openai.json()["error"]["param"] == "temperature"
    assert native.json()["error"] == f"sampling_params.{message}"


# ---------------------------------------------------------------------------------------------- body size


def _chunks(data: bytes, size: int = 256 * 1024):
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("which", ["serve", "rollout"])
def test_an_oversized_body_gets_413_and_the_connection_survives(request, which, chunked):
    from app.serving.requests import DEFAULT_MAX_BODY_BYTES

    server = request.getfixturevalue(f"{which}_server")
    path = "/v1/completions" if which == "serve" else "/generate"
    body = {"model": NAME, "prompt": "1" * (DEFAULT_MAX_BODY_BYTES + 1)}
    if which == "rollout":
        body = {"text": "1" * (DEFAULT_MAX_BODY_BYTES + 1)}
    data = json.dumps(body).encode()
    content = _chunks(data) if chunked else data  # a generator goes out chunked, without a Content-Length
    response = server.client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text[:300]
    if which == "serve":
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
        assert str(DEFAULT_MAX_BODY_BYTES) in error["message"]
    else:
        assert str(DEFAULT_MAX_BODY_BYTES) in response.json()["error"]
    _assert_still_serving(server.client, response)


def test_the_body_limit_is_a_parameter_of_both_servers(tiny_model_dir, tokenizer):
    engine = EmbeddedEngine.from_pretrained(tiny_model_dir)
    servers = {
        "/v1/completions": ThreadServer(build_app(tiny_model_dir, model_name=NAME, max_body_bytes=1000)),
        "/generate": ThreadServer(
            create_app(engine, model_path=str(tiny_model_dir), tokenizer=tokenizer, max_body_bytes=1000)
        ),
    }
    try:
        for path, server in servers.items():
            small = {"model": NAME, "prompt": "1=", "max_tokens": 1} if path.startswith("/v1") else {
                "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}  # fmt: skip
            assert _post(server.client, path, small).status_code == 200
            big = {**small, "user": "x" * 1000} if path.startswith("/v1") else {**small, "rid": "x" * 1000}
            assert _post(server.client, path, big).status_code == 413
            assert server.client.get("/server_info").json()["max_body_bytes"] == 1000
    finally:
        for server in servers.values():
            server.close()
    with pytest.raises(ValueError, match="max_body_bytes"):
        create_app(engine, model_path=str(tiny_model_dir), max_body_bytes=0)


# ---------------------------------------------------------------------------------------------- huge prompts


def test_a_5mb_prompt_is_refused_before_it_is_tokenized(serve_server, rollout_server):
    prompt = "1+" * (5 * MiB // 2) + "1="
    out = _post(serve_server.client, "/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 1})
    assert out.status_code == 400
    error = out.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "characters" in error["message"]  # refused on its length in characters, not after tokenizing
    chat = {"model": NAME, "messages": [{"role": "user", "content": prompt}]}
    out = _post(serve_server.client, "/v1/chat/completions", chat)
    assert out.status_code == 400 and "characters" in out.json()["error"]["message"]
    out = _post(rollout_server.client, "/generate", {"text": prompt})
    assert out.status_code == 400 and "characters" in out.json()["error"]
    assert serve_server.client.get("/health").status_code == 200


def _long_context_engine(tiny_model_dir, tokenizer) -> EmbeddedEngine:
    """The tiny model with a 64k-token context: a 1 MB prompt passes the character bound and is tokenized (a
    few seconds) before its million tokens are refused."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, max_position_embeddings=65536)
    return EmbeddedEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)


HUGE_CHARS = 1 * MiB


@pytest.mark.parametrize("which", ["serve", "rollout"])
def test_a_small_request_sent_during_a_huge_one_is_answered_first(tiny_model_dir, tokenizer, which):
    engine = _long_context_engine(tiny_model_dir, tokenizer)
    if which == "serve":
        app = create_openai_app(engine, tokenizer, model_name=NAME, model_path=str(tiny_model_dir))
        path = "/v1/completions"
        huge = {"model": NAME, "prompt": "1+" * (HUGE_CHARS // 2) + "1=", "max_tokens": 1}
        small = {"model": NAME, "prompt": "3+4=", "max_tokens": 2, "temperature": 0}
    else:
        app = create_app(engine, model_path=str(tiny_model_dir), tokenizer=tokenizer)
        path = "/generate"
        huge = {"text": "1+" * (HUGE_CHARS // 2) + "1=", "sampling_params": {"max_new_tokens": 1}}
        small = {"text": "3+4=", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    server = ThreadServer(app)

    async def main() -> list[tuple[str, httpx.Response]]:
        done: list[tuple[str, httpx.Response]] = []
        sent = asyncio.Event()

        async def huge_body():
            data = json.dumps(huge).encode()
            for start in range(0, len(data), 64 * 1024):
                yield data[start : start + 64 * 1024]
            sent.set()  # the whole body is out: the server now parses and tokenizes it

        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:

            async def send_huge():
                response = await http.post(path, content=huge_body())
                done.append(("huge", response))

            async def send_small():
                await sent.wait()
                response = await http.post(path, json=small)
                done.append(("small", response))

            await asyncio.gather(send_huge(), send_small())
        return done

    try:
        done = asyncio.run(main())
    finally:
        server.close()
    assert [name for name, _ in done] == ["small", "huge"]
    responses = dict(done)
    assert responses["small"].status_code == 200, responses["small"].text
    assert responses["huge"].status_code == 400  # a million tokens: past even this context
    if which == "serve":
        assert responses["huge"].json()["error"]["code"] == "context_length_exceeded"


# ---------------------------------------------------------------------------------------------- disconnects


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _recording():
    """Every log record of uvicorn and of the app while inside. Entered after the server started: uvicorn's
    logging set-up replaces the handlers of its loggers."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "app", "fastapi", "starlette")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


@pytest.mark.parametrize("which", ["serve", "rollout"])
def test_a_client_that_hangs_up_mid_body_logs_one_line(request, which):
    server = request.getfixturevalue(f"{which}_server")
    path = b"/v1/completions" if which == "serve" else b"/generate"
    with _recording() as records:
        with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock:
            sock.sendall(
                b"POST " + path + b" HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n" + b'{"input_ids": [1, 2, '
            )  # 21 of the 1000 bytes announced, then the connection closes

        def ours() -> list[logging.LogRecord]:
            return [
                r for r in list(records.records) if "before sending the whole request body" in r.getMessage()
            ]

        deadline = time.monotonic() + 30
        while not ours():
            assert time.monotonic() < deadline, [r.getMessage()[:200] for r in records.records]
            time.sleep(0.02)
        assert server.client.get("/health").status_code == 200
    [line] = ours()
    assert "\n" not in line.getMessage() and line.exc_info is None
    assert all(r.exc_info is None for r in records.records), [r.getMessage()[:200] for r in records.records]
    assert not [r for r in records.records if "Exception in ASGI application" in r.getMessage()]


# ---------------------------------------------------------------------------------------------- abort_request


def test_abort_request_answers_sglangs_empty_200_and_refuses_bad_bodies(rollout_server):
    for body in ({"rid": "nothing-by-that-id"}, {"abort_all": False}, {}):
        response = _post(rollout_server.client, "/abort_request", body)
        assert response.status_code == 200 and response.content == b""
    for body, fragment in (
        ({"rid": 3}, "rid"),
        ({"abort_all": "yes"}, "abort_all"),
        ([1], "JSON object"),
        ("{bad", "not valid JSON"),
    ):
        response = _post(rollout_server.client, "/abort_request", body)
        assert response.status_code == 400 and fragment in response.json()["error"], response.text
    assert rollout_server.client.get("/health").status_code == 200


def test_abort_request_aborts_queued_requests_by_rid_or_all(rollout_server):
    common = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}

    async def main():
        async with httpx.AsyncClient(base_url=rollout_server.url, timeout=60) as http:

            async def queue(*rids: str) -> dict[str, asyncio.Task]:
                assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
                tasks = {
                    rid: asyncio.create_task(http.post("/generate", json={**common, "rid": rid}))
                    for rid in rids
                }
                while (await http.get("/server_info")).json()["trustbatch"]["queued"] < len(rids):
                    await asyncio.sleep(0.005)
                return tasks

            async def answer(task: asyncio.Task) -> dict:
                return (await asyncio.wait_for(task, 60)).json()

            tasks = await queue("keep", "drop")
            assert (await http.post("/abort_request", json={"rid": "drop"})).status_code == 200
            dropped = await answer(tasks["drop"])  # answered while generation is still paused
            assert (await http.get("/server_info")).json()["trustbatch"]["queued"] == 1
            await http.post("/continue_generation")
            kept = await answer(tasks["keep"])

            tasks = await queue("a", "b")
            assert (await http.post("/abort_request", json={"abort_all": True})).status_code == 200
            everything = [await answer(tasks[rid]) for rid in ("a", "b")]
            await http.post("/continue_generation")
            return dropped, kept, everything

    dropped, kept, everything = asyncio.run(main())
    assert dropped["meta_info"]["finish_reason"]["type"] == "abort" and dropped["output_ids"] == []
    assert dropped["meta_info"]["id"] == "drop"
    assert kept["meta_info"]["finish_reason"]["type"] in ("stop", "length") and kept["output_ids"]
    assert [out["meta_info"]["finish_reason"]["type"] for out in everything] == ["abort", "abort"]
    after = _post(rollout_server.client, "/generate", common)
    assert after.status_code == 200 and after.json()["meta_info"]["finish_reason"]["type"] != "abort"
