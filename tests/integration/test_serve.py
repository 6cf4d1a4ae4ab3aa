"""`trustbatch serve` on CPU, spoken to with the official `openai` client over real HTTP.

The server is the real app (app/serving/openai.py) under uvicorn on a free loopback port, serving the warm-started tiny
model (`tiny_model_dir`); its answers are checked against the same model run directly through
`EmbeddedEngine.generate_sync`. The last tests start `trustbatch serve models:/NAME@best` as a subprocess
against a real MLflow registry, and `trustbatch serve --engine sglang` against real SGLang on its CPU platform
(skipped without the `.venv-sglang` environment of `make sglang-env`). Not covered: SGLang on a GPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.engines import resolve_kind
from app.rollout.base import SamplingParams
from app.rollout.embedded import EmbeddedEngine
from app.rollout.sglang_server import SGLangServerProcess
from app.serving.openai import create_openai_app
from app.serving.server import build_app, served_name, sglang_launch
from tests.helpers import wait_for_health
from trainer.model import encode_prompt

from .conftest import REPO
from .model_refs import ThreadServer, free_port, make_registry, snapshot, trustbatch

NAME = "tiny"
PROMPTS = ["3+4=", "9*8=", "7*6-5=", "2+2*2=", "45+38=", "6*7+1="]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ThreadServer(build_app(tiny_model_dir, model_name=NAME, batch_window_ms=20))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """The served model, run directly: what the server's answers are checked against."""
    return EmbeddedEngine.from_pretrained(tiny_model_dir)


def direct(engine, tokenizer, prompt_ids, **params):
    [completion] = engine.generate_sync([prompt_ids], SamplingParams(**params))
    return completion, tokenizer.decode(completion.output_ids, skip_special_tokens=True)


def ids_of(tokenizer, text):
    return encode_prompt(tokenizer, text)


# ---------------------------------------------------------------------------------------------- completions


def test_greedy_completion_is_the_engine_output_with_usage(client, engine, tokenizer):
    for prompt in PROMPTS[:3]:
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
        expected, text = direct(
            engine, tokenizer, ids_of(tokenizer, prompt), max_new_tokens=8, temperature=0.0
        )
        [choice] = out.choices
        assert choice.text == text and choice.index == 0
        assert choice.finish_reason == expected.finish_reason
        assert out.usage.prompt_tokens == len(ids_of(tokenizer, prompt))
        assert out.usage.completion_tokens == len(expected.output_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        assert out.model == NAME and out.object == "text_completion"


def test_the_warm_started_model_stops_at_eos(client):
    # The tiny model learned "expr=" -> answer + EOS: with room to spare, greedy answers end with "stop".
    out = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=16, temperature=0)
    reasons = [c.finish_reason for c in out.choices]
    assert "stop" in reasons and set(reasons) <= {"stop", "length"}
    assert [c.index for c in out.choices] == list(range(len(PROMPTS)))


def test_seeded_sampling_reproduces_the_engine(client, engine, tokenizer):
    out = client.completions.create(model=NAME, prompt="12+5=", max_tokens=6, temperature=1.0, seed=7, n=3)
    completions = engine.generate_sync(
        [ids_of(tokenizer, "12+5=")], SamplingParams(max_new_tokens=6, temperature=1.0, seed=7, n=3)
    )
    assert [c.text for c in out.choices] == [
        tokenizer.decode(c.output_ids, skip_special_tokens=True) for c in completions
    ]
    assert [c.index for c in out.choices] == [0, 1, 2]


def test_batch_of_prompts_and_token_ids_with_n(client, engine, tokenizer):
    ids = [ids_of(tokenizer, p) for p in PROMPTS[:2]]
    by_text = client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=5, temperature=0, n=2)
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0, n=2)
    flat = client.completions.create(model=NAME, prompt=ids[0], max_tokens=5, temperature=0)
    assert [c.index for c in by_text.choices] == [0, 1, 2, 3]
    # Choices are prompt-major: p0s0, p0s1, p1s0, p1s1; greedy samples of one prompt are equal.
    expected = [direct(engine, tokenizer, p, max_new_tokens=5, temperature=0.0)[1] for p in ids]
    assert [c.text for c in by_text.choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert flat.choices[0].text == expected[0]
    assert by_text.usage.prompt_tokens == sum(len(p) for p in ids)  # each prompt counted once, not n times


def test_stop_strings_cut_the_text_and_end_the_sequence(client, engine, tokenizer):
    # A prompt whose greedy answer has at least two (ASCII) characters; stop at its second one, or at both.
    for prompt in PROMPTS:
        _, text = direct(engine, tokenizer, ids_of(tokenizer, prompt), max_new_tokens=12, temperature=0.0)
        if len(text) >= 2 and text.isascii():
            break
    else:
        pytest.fail(f"no prompt of {PROMPTS} got a greedy answer of two characters or more")
    for stop in (text[1], text[:2]):
        out = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "@@"]
        )
        cut = text.index(stop)
        assert out.choices[0].text == text[:cut] and out.choices[0].finish_reason == "stop"
        # The sequence ended on the token that completed the stop string (one token per ASCII character here),
        # not at max_tokens or EOS.
        assert out.usage.completion_tokens == cut + len(stop)
        streamed = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=stop, stream=True
        )
        chunks = [c.choices[0] for c in streamed if c.choices]
        assert "".join(c.text for c in chunks) == text[:cut] and chunks[-1].finish_reason == "stop"
    never = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=["@@@"])
    assert never.choices[0].text == text


def test_logprobs_are_the_behaviour_logprobs_of_the_sampled_tokens(client, engine, tokenizer):
    out = client.completions.create(model=NAME, prompt="3+4=", max_tokens=4, temperature=0, logprobs=0)
    expected, _ = direct(engine, tokenizer, ids_of(tokenizer, "3+4="), max_new_tokens=4, temperature=0.0)
    logprobs = out.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx(expected.output_logprobs, abs=1e-5)
    assert logprobs.tokens == [tokenizer.decode([t]) for t in expected.output_ids]


def test_streamed_completion_sends_each_token_as_it_is_sampled(client, engine, tokenizer):
    prompt = "45+38="
    expected, text = direct(engine, tokenizer, ids_of(tokenizer, prompt), max_new_tokens=10, temperature=0.0)
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == text
    # One event per sampled token (the tiny tokenizer is byte-level: each token of the answer is a character).
    assert len(content) == len(expected.output_ids)
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + [
        expected.finish_reason
    ]
    usage = chunks[-1]
    assert not usage.choices and usage.usage.completion_tokens == len(expected.output_ids)


def test_stream_events_are_server_sent_events_ending_with_done(server):
    body = {"model": NAME, "prompt": "3+4=", "max_tokens": 3, "temperature": 0, "stream": True}
    with server.client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event[len("data: ") :])["object"] == "text_completion"


def test_a_client_that_leaves_mid_stream_does_not_disturb_the_server(server, client):
    body = {"model": NAME, "prompt": "1=", "max_tokens": 200, "temperature": 2.0, "stream": True, "seed": 1}
    with server.client.stream("POST", "/v1/completions", json=body) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    # The connection is closed after one event; the server ends that sequence and goes on serving.
    out = client.completions.create(model=NAME, prompt="3+4=", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert server.client.get("/health").status_code == 200


class Recording:
    """Wraps an engine's ``generate_sync``: says when a call starts and keeps what each call returned."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.generate, self.started, self.outputs = engine.generate_sync, threading.Event(), []
        engine.generate_sync = self

    def __call__(self, *args, **kwargs):
        self.started.set()
        completions = self.generate(*args, **kwargs)
        self.outputs.append(completions)
        return completions

    def wait_for(self, calls: int) -> list:
        deadline = time.monotonic() + 120
        while len(self.outputs) < calls:
            assert time.monotonic() < deadline, f"{calls - len(self.outputs)} generate call(s) never ended"
            time.sleep(0.02)
        return self.outputs


BUDGET = 250
"""max_tokens of the endless server's long requests (its context is 256 tokens)."""


@pytest.fixture(scope="module")
def endless(tiny_model_dir, tokenizer):
    """The tiny model served with an EOS id it never samples greedily (<|im_start|>), so a greedy completion
    runs to its token budget and a sequence that ends sooner was ended by the server; calls are recorded."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    engine = EmbeddedEngine(model, eos_token_id=im_start, pad_token_id=tokenizer.eos_token_id)
    recording = Recording(engine)
    app = create_openai_app(
        engine, tokenizer, model_name=NAME, model_path=str(tiny_model_dir), batch_window_ms=300
    )
    srv = ThreadServer(app)
    yield srv, recording
    srv.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_has_its_samples_ended_at_the_next_step(endless, stream):
    server, recording = endless
    body = json.dumps(
        {"model": NAME, "prompt": "1=", "max_tokens": BUDGET, "temperature": 0, "n": 64, "stream": stream}
    ).encode()
    calls = len(recording.outputs)
    recording.started.clear()
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert recording.started.wait(60), "the request never started generating"
    # The connection is closed mid-generation: every sample ends at the next step instead of its budget.
    [completions] = recording.wait_for(calls + 1)[calls:]
    assert len(completions) == 64
    assert all(c.finish_reason == "stop" and len(c.output_ids) < BUDGET // 2 for c in completions), sorted(
        {len(c.output_ids) for c in completions}
    )


def test_a_stream_ends_with_its_samples_not_with_the_rest_of_its_batch(endless, engine, tokenizer):
    # A (streamed, stopped by a stop string at its first token) and B (runs to its budget) share one batch:
    # their sampling parameters are the same. A's stream must end while B is still being sampled.
    short, long = "3+4=", "1="
    first = direct(engine, tokenizer, ids_of(tokenizer, short), max_new_tokens=1, temperature=0.0)[1]
    assert first, "the first greedy token of the short prompt decodes to no text"
    server, recording = endless
    calls = len(recording.outputs)
    common = {"model": NAME, "max_tokens": BUDGET, "temperature": 0, "stream": True}

    async def main():
        received = {"b": 0, "b_when_a_ended": None}
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:

            async def b():
                async with http.stream(
                    "POST", "/v1/completions", json={**common, "prompt": long}
                ) as response:
                    async for line in response.aiter_lines():
                        received["b"] += line.startswith("data: {")

            async def a():
                await asyncio.sleep(0.05)  # B first: its arrival opens the batch window
                body = {**common, "prompt": short, "stop": first}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    events = [line async for line in response.aiter_lines() if line]
                received["b_when_a_ended"] = received["b"]
                return events

            _, events = await asyncio.gather(b(), a())
        return received, events

    received, events = asyncio.run(main())
    [completions] = recording.wait_for(calls + 1)[calls:]  # one batch: A's prompt and B's
    assert sorted(len(c.output_ids) for c in completions) == [1, BUDGET]
    [chunk] = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert chunk["choices"][0]["text"] == "" and chunk["choices"][0]["finish_reason"] == "stop"
    assert events[-1] == "data: [DONE]"
    assert received["b"] == BUDGET  # one event per token of B
    assert received["b_when_a_ended"] < BUDGET // 2, received


def test_chat_requests_without_max_tokens_are_batched_together(endless, engine, tokenizer):
    # Each defaults to the rest of the model's context; that must not make their sampling parameters differ.
    server, recording = endless
    conversations = [[{"role": "user", "content": "3+4="}], [{"role": "user", "content": "12*12+100="}]]
    calls = len(recording.outputs)

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(
                *(
                    client.chat.completions.create(model=NAME, messages=m, temperature=0)
                    for m in conversations
                )
            )

    outs = asyncio.run(main())
    assert len(recording.wait_for(calls + 1)[calls:]) == 1  # one generate call for both
    # A chat reply ends at the end-of-turn tokens and the model's EOS (and at the endless engine's EOS).
    stop_ids = tuple(tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<|im_start|>"]))
    for out, messages in zip(outs, conversations, strict=True):
        prompt_ids = encode_prompt(tokenizer, messages=messages)
        room = engine.max_positions - len(prompt_ids)
        expected, text = direct(
            engine, tokenizer, prompt_ids, max_new_tokens=room, temperature=0.0, stop_token_ids=stop_ids
        )
        assert out.choices[0].message.content == text
        assert out.usage.completion_tokens == len(expected.output_ids)


# ---------------------------------------------------------------------------------------------- chat


def test_chat_completion_renders_the_chat_template(client, engine, tokenizer):
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "3+4="}]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    prompt_ids = encode_prompt(tokenizer, messages=messages)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected, text = direct(
        engine, tokenizer, prompt_ids, max_new_tokens=12, temperature=0.0, stop_token_ids=(im_end,)
    )
    [choice] = out.choices
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(prompt_ids) and out.object == "chat.completion"
    # max_completion_tokens is the newer name of the same limit.
    again = client.chat.completions.create(
        model=NAME, messages=messages, max_completion_tokens=12, temperature=0
    )
    assert again.choices[0].message.content == text


def test_streamed_chat_sends_the_role_then_the_content_token_by_token(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "9*8="}]}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert content == whole.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    token_events = [c for c in with_choices if c.choices[0].logprobs is not None]
    assert len(token_events) == whole.usage.completion_tokens  # one event per sampled token
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


# ---------------------------------------------------------------------------------------------- the rest


def test_models_and_health(client, server, tiny_model_dir):
    [model] = client.models.list().data
    assert model.id == NAME and model.owned_by == "trustbatch"
    assert client.models.retrieve(NAME).id == NAME
    assert server.client.get("/health").status_code == 200


def test_32_concurrent_requests_all_succeed(server, engine, tokenizer):
    prompts = [f"{a}+{b}=" for a in range(4) for b in range(8)]

    async def one(client: openai.AsyncOpenAI, i: int):
        if i % 2:
            stream = await client.completions.create(
                model=NAME, prompt=prompts[i], max_tokens=6, temperature=0, stream=True
            )
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        out = await client.completions.create(model=NAME, prompt=prompts[i], max_tokens=6, temperature=0)
        return out.choices[0].text

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

    texts = asyncio.run(main())
    expected = [
        direct(engine, tokenizer, ids_of(tokenizer, p), max_new_tokens=6, temperature=0.0)[1] for p in prompts
    ]
    assert texts == expected
    info = server.client.get("/server_info").json()["trustbatch"]
    assert info["queued"] == 0


LONG = "1+" * 200 + "1="


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", "{not json", 400, None),
        ("/v1/completions", "[1, 2]", 400, None),
        ("/v1/completions", {"prompt": "1+1="}, 400, "model"),
        ("/v1/completions", {"model": "other", "prompt": "1+1="}, 404, "model"),
        ("/v1/completions", {"model": NAME}, 400, "prompt"),
        ("/v1/completions", {"model": NAME, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": NAME, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {"model": NAME, "prompt": [[]]}, 400, "prompt"),
        ("/v1/completions", {"model": NAME, "prompt": [1, "a"]}, 400, "prompt"),
        ("/v1/completions", {"model": NAME, "prompt": [[1, 99999]]}, 400, "prompt"),
        ("/v1/completions", {"model": NAME, "prompt": LONG}, 400, "prompt"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "max_tokens": 10_000}, 400, "max_tokens"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "n": 1.5}, 400, "n"),
        ("/v1/completions", {"model": NAME, "prompt": ["1="] * 40, "n": 128}, 400, "prompt"),
        ("/v1/completions", {"model": NAME, "prompt": ["1="] * 5000}, 400, "prompt"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "stop": [1]}, 400, "stop"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "stop": [""]}, 400, "stop"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "logprobs": 5}, 400, "logprobs"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "echo": True}, 400, "echo"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "presence_penalty": 1}, 400, "presence_penalty"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "stream": "yes"}, 400, "stream"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "stream_options": {}}, 400, "stream_options"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "seed": "x"}, 400, "seed"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "frobnicate": 1}, 400, "frobnicate"),
        # Input that used to crash the handler (500): numbers too large for a float or for the engine's seed,
        # text no tokenizer takes, JSON too deep or with too many digits for Python's parser.
        ("/v1/completions", '{"model": "tiny", "prompt": "1=", "temperature": 1' + "0" * 400 + "}", 400,
         "temperature"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "seed": 2**64}, 400, "seed"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "seed": -(2**63) - 1}, 400, "seed"),
        ("/v1/completions", {"model": NAME, "prompt": "\ud800"}, 400, "prompt"),
        ("/v1/completions", '{"model": "tiny", "prompt": "1=", "n": ' + "9" * 5000 + "}", 400, None),
        ("/v1/completions", "[" * 100_000 + "]" * 100_000, 400, None),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "stop_token_ids": False}, 400, "stop_token_ids"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "best_of": True}, 400, "best_of"),
        ("/v1/completions", {"model": NAME, "prompt": "1=", "stream": True,
                             "stream_options": {"include_usage": 0}}, 400, "stream_options.include_usage"),
        ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": NAME, "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}, 400,
         "messages[0].role"),
        ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": 3}]}, 400,
         "messages[0].content"),
        ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x" * 300}]}, 400,
         "prompt"),
        ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 4, "max_completion_tokens": 5}, 400, "max_completion_tokens"),
        ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                  "tools": [{"type": "function"}]}, 400, "tools[0]"),
        ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "a\udc00"}]}, 400,
         "messages"),
        ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                  "chat_template_kwargs": {"chat_template": "{% for i in range(99999) %}{% for j in "
                                                           "range(99999) %}x{% endfor %}{% endfor %}"}}, 400,
         "chat_template_kwargs"),
    ],
)  # fmt: skip
def test_malformed_requests_get_openai_errors(server, path, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    response = server.client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"
    # The server is still up and answering.
    assert server.client.get("/health").status_code == 200


def test_unknown_routes_and_methods_get_openai_errors(server):
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)):
        response = server.client.request(method, path)
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_the_openai_client_raises_its_typed_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="1+1=")
    with pytest.raises(openai.BadRequestError, match="context length") as err:
        client.completions.create(model=NAME, prompt="1=", max_tokens=100_000)
    assert err.value.code == "context_length_exceeded"


def test_engine_choice_and_the_sglang_command(tmp_path):
    assert resolve_kind("builtin") == "embedded" == resolve_kind("embedded")  # the older name still works
    assert resolve_kind("local") == "local" and resolve_kind("sglang") == "sglang"
    if not __import__("torch").cuda.is_available():
        assert resolve_kind("auto") == "embedded"
    with pytest.raises(ValueError, match="choose one of embedded, local, sglang, auto"):
        resolve_kind("vllm")
    with pytest.raises(ValueError, match="--sglang-python .* does not exist"):
        resolve_kind("sglang", sglang_python=str(tmp_path / "python"))
    assert served_name("models:/q@best") == "q@best" and served_name("runs:/abc/ckpt") == "abc/ckpt"
    assert served_name("/models/q") == "/models/q"
    # serve's SGLang command line is the launcher's (app/rollout/sglang_server.py), with --tp taken out of the
    # extra arguments into the tensor-parallel size the launcher sets.
    launch = sglang_launch(host="0.0.0.0", port=30001, served_model_name="m", extra_args="--tp 2 --log-level warning")
    assert (launch.tp_size, launch.extra_args, launch.skip_tokenizer_init) == (2, ["--log-level", "warning"], False)
    command = SGLangServerProcess(tmp_path, launch, log_path=tmp_path / "log").command()
    assert command[1:] == [
        "-m", "sglang.launch_server", "--model-path", str(tmp_path), "--host", "0.0.0.0", "--port", "30001",
        "--tp-size", "2", "--weight-version", "0", "--dtype", "auto", "--base-gpu-id", "0",
        "--served-model-name", "m", "--log-level", "warning",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--tp\\) must be a whole number >= 1, got 'two'"):
        sglang_launch(host="0.0.0.0", port=30001, served_model_name="m", extra_args="--tp two")
    with pytest.raises(ValueError, match="sets \\['--port'\\], which the launcher sets itself"):
        sglang_launch(host="0.0.0.0", port=30001, served_model_name="m", extra_args="--port 1")


# ---------------------------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def registry(tmp_path_factory, tiny_model_dir):
    return make_registry(tmp_path_factory.getbasetemp() / "registry", tiny_model_dir)


def test_serve_command_resolves_and_serves_a_registered_model(registry, tmp_path, engine, tokenizer):
    ref = f"models:/{registry.name}@best"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRUSTBATCH_CACHE_DIR": str(tmp_path / "cache")}
    before = snapshot(registry.artifact_root)
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", ref, "--port", str(port), "--tracking-uri", registry.uri],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(process, url, tmp_path / "serve.log", timeout_s=180)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            # Served as the reference without its scheme (SGLang refuses a colon); the reference works too.
            assert [m.id for m in client.models.list().data] == [f"{registry.name}@best"]
            outs = [
                client.completions.create(model=model, prompt="3+4=", max_tokens=8, temperature=0)
                for model in (f"{registry.name}@best", ref)
            ]
        expected = direct(engine, tokenizer, ids_of(tokenizer, "3+4="), max_new_tokens=8, temperature=0.0)[1]
        assert [out.choices[0].text for out in outs] == [expected, expected]
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
    banner = (tmp_path / "serve.log").read_text()
    assert f"version {registry.versions['best']} of {registry.name}" in banner
    assert str(tmp_path / "cache") in banner  # served from a downloaded copy ...
    assert snapshot(registry.artifact_root) == before  # ... and the store's files were left alone


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["serve", "models:/nope@best"], "no registered model named 'nope'"),
        (["serve", "models:/tiny-arithmetic@worst"], "no alias 'worst'"),
        (["serve", "/no/such/model"], "neither an existing directory"),
        (["serve", "{model_dir}", "--engine", "vllm"], "choose one of embedded, local, sglang, auto"),
        (["serve", "{model_dir}", "--engine", "local"], "use --engine embedded"),
    ],
)
def test_serve_command_bad_input_exits_2(registry, tiny_model_dir, args, fragment):
    args = [a.format(model_dir=tiny_model_dir) for a in args]
    out = trustbatch(*args, "--tracking-uri", registry.uri)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert fragment in out.stderr and "Traceback" not in out.stderr + out.stdout


SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"


def sglang_servers_on(port: int) -> list[int]:
    """Pids of live `sglang.launch_server` processes listening on ``port`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(") ")[-1][:1]
        except (OSError, ValueError):
            continue
        if "sglang.launch_server" in command and f"--port {port} " in command and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(
    not SGLANG_PYTHON.exists(),
    reason=f"no SGLang CPU environment at {SGLANG_PYTHON.parent.parent} (make sglang-env builds it)",
)
def test_serve_command_with_the_sglang_engine_answers_like_the_builtin_one(
    tiny_model_dir, tmp_path, engine, tokenizer
):
    """`--engine sglang` hands the resolved directory to real SGLang (its CPU platform here, chosen because CUDA is
    absent), a child process that serve stops when it is stopped."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log_path = tmp_path / "sglang.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "app.cli", "serve", str(tiny_model_dir), "--port", str(port),
                "--engine", "sglang", "--sglang-python", str(SGLANG_PYTHON), "--sglang-args", "--log-level warning",
                "--served-model-name", "tiny-sglang",
            ],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(process, url, log_path, timeout_s=300, what="SGLang")
        deadline = time.monotonic() + 120  # serve announces the API once its own health check has passed
        while f"OpenAI API at {url}/v1" not in log_path.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log_path.read_text()
            time.sleep(0.5)
        assert f"OpenAI API at {url}/v1 as model 'tiny-sglang'" in log_path.read_text()
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            assert [m.id for m in client.models.list().data] == ["tiny-sglang"]
            out = client.completions.create(model="tiny-sglang", prompt="45+38=", max_tokens=8, temperature=0)
        expected, text = direct(
            engine, tokenizer, ids_of(tokenizer, "45+38="), max_new_tokens=8, temperature=0.0
        )
        assert out.choices[0].text == text and out.choices[0].finish_reason == expected.finish_reason
        assert out.usage.prompt_tokens == len(ids_of(tokenizer, "45+38="))
        assert out.usage.completion_tokens == len(expected.output_ids)
    finally:
        process.terminate()  # serve stops its SGLang server (a process group of its own) before it exits
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
            code = None
    assert code == 0, log_path.read_text()[-3000:]
    assert "sglang.launch_server --model-path" in log_path.read_text()
    assert not sglang_servers_on(port), "serve left its SGLang server running"
