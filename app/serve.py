"""`trustbatch serve`: any model reference behind an OpenAI-compatible HTTP API.

The reference (``models:/NAME@ALIAS``, ``models:/NAME/VERSION``, ``runs:/RUN_ID/PATH`` or a directory; see
app/models.py) is resolved to a local Hugging Face directory, then served by one of two engines:
- **SGLang** (``--engine sglang``, or ``auto`` when CUDA is available and SGLang is installed, as in the Docker
  image): this process is replaced by ``python -m sglang.launch_server --model-path DIR --host H --port P
  --served-model-name NAME [--sglang-args ...]``, SGLang's own OpenAI-compatible server. ``--sglang-python``
  picks the interpreter of another environment (SGLang pins its own torch). Tested on CPU against SGLang's CPU
  platform (``.venv-sglang``, ``SGLANG_USE_CPU_ENGINE=1`` and ``--device cpu --attention-backend torch_native
  ...``), not on a GPU.
- **built-in** (otherwise): the CPU server of app/rollout/local_server.py (its native SGLang routes stay) plus
  the OpenAI routes below. Requests from all clients join the same batching scheduler as ``/generate``.

Routes added here: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``; ``GET /health`` comes from the native app. The model's name is the reference without
its scheme (``models:/quickstart@best`` is served as ``quickstart@best``: SGLang refuses a colon in a served
model name) unless ``--served-model-name`` says otherwise; the built-in engine also accepts the reference as typed.

What the built-in engine honours (everything else answers 400 naming the field, never silently ignored):
- completions: ``prompt`` (str, [str], [int] or [[int]]), ``max_tokens`` (default 16), ``temperature`` (0 =
  greedy, or 1e-6 to 2: a denormal temperature would turn the logits into infinities), ``top_p``, ``n``
  (1-128), ``stop`` (str or up to 16 strings), ``stop_token_ids`` (SGLang's extension), ``seed``, ``stream`` +
  ``stream_options.include_usage``, ``logprobs: 0`` (the logprob of each sampled token; top alternatives,
  ``logprobs > 0``, are not computed), ``user`` (ignored).
- chat: ``messages`` (roles system/developer/user/assistant; string content or text parts) rendered with the
  tokenizer's chat template and the generation prompt, ``max_tokens`` or ``max_completion_tokens`` (default:
  the rest of the context), ``logprobs: true`` (``top_logprobs`` 0), ``response_format`` text, and the same
  sampling fields. The tokenizer's EOS and the usual end-of-turn tokens (``<|im_end|>``...) end a reply.
- Token-by-token streaming: each sampled token reaches its request through the scheduler's ``on_token`` hook
  (app/rollout/embedded.py, "Streaming and early stops") as the decoding step that sampled it ends, and goes
  out as one server-sent event ``data: {json}\\n\\n``; the stream ends with ``data: [DONE]\\n\\n`` as soon as
  its own samples have ended (not when the rest of their batch has). Text that could still become a stop
  string, or an incomplete UTF-8 character, is held back until it is decided.
- A client that disconnects, streamed or not, has its sequences ended at the next step.
- Stop strings end a sequence as soon as its decoded text contains one (the text is cut before it,
  finish_reason "stop"); the EOS or a stop token id also gives "stop", the token budget or the model's
  context "length".
- Logprobs are the engine's behaviour logprobs: log-softmax of logits / temperature (T = 1 for greedy) before
  top-p truncation, what SGLang reports too.

Errors follow OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed or
unsupported requests (bad JSON, wrong types, empty or too long prompts, out-of-range or non-finite values, text
with a lone surrogate), 404 for an unknown model (code ``model_not_found``) or route, 405 for a wrong method,
413 for a body over ``max_body_bytes`` (8 MiB by default; code ``request_too_large``, refused as soon as its
``Content-Length`` or the bytes received pass the limit), 500 only for a failure inside the engine. A prompt
that leaves no room in the model's context, or asks ``max_tokens`` beyond it, gets code
``context_length_exceeded``; a text longer than any text of that many tokens gets it before it is tokenized.
A refused request keeps the keep-alive connection open (after a 413 with an unread body, uvicorn may close it).

Heavy work stays off the event loop, so one huge request never holds up the others: a large body is parsed,
and every request is validated, tokenized and rendered with the chat template, in a worker thread
(app/rollout/http_common.py has the body reader and the value checks shared with the native routes). A client
that hangs up before its body is in costs one log line.

Not covered: tools / function calling, ``echo``, ``suffix``, ``best_of > n``, penalties, ``logit_bias``,
top-k logprobs, images, embeddings, the Responses API.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shlex
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.rollout import http_common as http
from app.rollout.base import Completion, SamplingParams
from app.rollout.embedded import EmbeddedEngine
from app.rollout.http_common import DEFAULT_MAX_BODY_BYTES, FieldError, describe, is_int
from app.rollout.local_server import create_app

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8000
MAX_N = 128
MAX_SEQUENCES = 4096
"""Most sequences (prompts x n) one request may ask for; more is refused rather than left to hog the server."""
MAX_STOPS = 16
MAX_TEMPERATURE = 2.0
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
"""Tokens that end an assistant turn in common chat templates; those in the vocabulary stop chat replies."""


# ---------------------------------------------------------------------------------------------- errors


class APIError(Exception):
    """A request the server refuses, answered as ``{"error": {...}}`` with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        # printable: a message or param may quote a client's text, lone surrogates included.
        param = None if self.param is None else http.printable(self.param)
        message = http.printable(self.message)
        return {"error": {"message": message, "type": self.type, "param": param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array"}.get(
        type(value), "an object"
    )


_show = describe


def _bad_type(param: str, value: Any, expected: str) -> APIError:
    return APIError(f"{param} must be {expected}, got {_kind(value)} {_show(value)}", param=param)


def _checked(check: Callable[..., Any], value: Any, param: str, *args: Any, **kwargs: Any) -> Any:
    """A value through one of the checks shared with the rollout server (app/rollout/http_common.py)."""
    try:
        return check(value, param, *args, **kwargs)
    except FieldError as exc:
        raise APIError(exc.message, param=exc.field) from None


# ---------------------------------------------------------------------------------------------- request parsing

_COMMON = (
    "model", "max_tokens", "temperature", "top_p", "n", "stop", "stop_token_ids", "seed", "stream",
    "stream_options", "logprobs", "user", "presence_penalty", "frequency_penalty", "logit_bias", "top_k",
    "ignore_eos", "min_tokens", "repetition_penalty",
)  # fmt: skip
COMPLETION_FIELDS = (*_COMMON, "prompt", "echo", "suffix", "best_of")
CHAT_FIELDS = (
    *_COMMON, "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "chat_template_kwargs", "function_call", "functions",
)  # fmt: skip

# field -> (is its value neutral?, why it is refused otherwise)
_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "presence_penalty": (lambda v: v in (None, 0), "presence_penalty must be 0: penalties are not supported"),
    "frequency_penalty": (
        lambda v: v in (None, 0),
        "frequency_penalty must be 0: penalties are not supported",
    ),
    "repetition_penalty": (
        lambda v: v in (None, 1),
        "repetition_penalty must be 1: penalties are not supported",
    ),
    "logit_bias": (lambda v: not v, "logit_bias is not supported"),
    "top_k": (lambda v: v in (None, -1, 0), "top_k must be -1 (all tokens): top-k sampling is not supported"),
    "ignore_eos": (
        lambda v: v in (None, False),
        "ignore_eos must be false: the EOS token always ends a sequence",
    ),
    "min_tokens": (lambda v: v in (None, 0), "min_tokens must be 0: a minimum length is not supported"),
    "echo": (lambda v: v in (None, False), "echo must be false: echoing the prompt is not supported"),
    "suffix": (lambda v: v in (None, ""), "suffix is not supported (no insertion)"),
    "tools": (lambda v: not v, "tools are not supported by the built-in server (no function calling)"),
    "functions": (
        lambda v: not v,
        "functions are not supported by the built-in server (no function calling)",
    ),
    "tool_choice": (
        lambda v: v in (None, "none", "auto"),
        "tool_choice is not supported (no function calling)",
    ),
    "function_call": (lambda v: v in (None, "none", "auto"), "function_call is not supported"),
    "top_logprobs": (lambda v: v in (None, 0), "top_logprobs must be 0: top alternatives are not computed"),
}


@dataclass
class _Parsed:
    """A validated request: prompts as token ids and everything needed to shape the answer."""

    prompts: list[list[int]]
    params: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    chat: bool


@dataclass
class ServedModel:
    """What the ``/v1`` routes need besides the engine: the names answered to and the tokenizer."""

    name: str
    root: str
    tokenizer: Any
    chat_stop_ids: tuple[int, ...]
    vocab_size: int
    max_positions: int | None
    max_prompt_chars: int | None = None
    """Longer texts cannot fit in the context: refused before they are tokenized."""
    aliases: tuple[str, ...] = ()
    """Other names accepted in requests (the reference as typed, e.g. ``models:/NAME@best``)."""
    created: int = field(default_factory=lambda: int(time.time()))


def _check_fields(body: Any, allowed: tuple[str, ...], route: str) -> dict:
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {_kind(body)}")
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise APIError(
            f"unrecognized request argument(s) for {route}: {', '.join(unknown)}; supported: {', '.join(allowed)}",
            param=unknown[0],
        )
    for key, (neutral, why) in _NEUTRAL.items():
        if key in body and not neutral(body[key]):
            raise APIError(f"{why} (got {_show(body[key])})", param=key)
    return body


def _check_model_name(model: str, served: ServedModel) -> None:
    if model != served.name and model not in served.aliases:
        raise APIError(
            f"the model {model!r} does not exist; this server serves {served.name!r} (see GET /v1/models)",
            param="model",
            code="model_not_found",
            status=404,
        )


def _check_model(body: dict, served: ServedModel) -> None:
    model = body.get("model")
    if model is None:
        raise APIError(
            f"you must provide a model parameter; this server serves {served.name!r}", param="model"
        )
    if not isinstance(model, str):
        raise _bad_type("model", model, "a string")
    _check_model_name(model, served)


def _sampling(body: dict, served: ServedModel, prompts: list[list[int]], *, chat: bool) -> SamplingParams:
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    temperature = _checked(http.temperature, temperature, "temperature", maximum=MAX_TEMPERATURE)
    top_p = body.get("top_p")
    top_p = 1.0 if top_p is None else _checked(http.top_p, top_p, "top_p")
    n = body.get("n")
    n = 1 if n is None else _checked(http.bounded_int, n, "n", 1, MAX_N)
    if n * len(prompts) > MAX_SEQUENCES:
        raise APIError(
            f"{len(prompts)} prompts x n={n} is {n * len(prompts)} sequences; one request may ask for at most "
            f"{MAX_SEQUENCES}: split it",
            param="prompt",
        )
    best_of = body.get("best_of")
    if best_of is not None and (not is_int(best_of) or best_of != n):
        raise APIError(f"best_of must equal n ({n}) or be omitted, got {_show(best_of)}", param="best_of")
    seed = body.get("seed")
    if seed is not None:
        seed = _checked(http.seed, seed, "seed")
    stop_ids = body.get("stop_token_ids")
    stop_ids = (
        [] if stop_ids is None else _checked(http.token_ids, stop_ids, "stop_token_ids", served.vocab_size)
    )
    if chat:
        stop_ids = [*stop_ids, *served.chat_stop_ids]

    names = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
    given = {k: body[k] for k in names if body.get(k) is not None}
    for key, value in given.items():
        _checked(http.bounded_int, value, key, 1, http.MAX_NEW_TOKENS)
    if len(set(given.values())) > 1:
        raise APIError(
            f"max_tokens={given['max_tokens']} and max_completion_tokens={given['max_completion_tokens']} differ; "
            "give one of them",
            param="max_completion_tokens",
        )
    longest = max(len(p) for p in prompts)
    room = None if served.max_positions is None else served.max_positions - longest
    if given:
        max_tokens = next(iter(given.values()))
        if room is not None and max_tokens > room:
            key = next(iter(given))
            raise APIError(
                f"this model's maximum context length is {served.max_positions} tokens; the prompt has {longest} "
                f"and {key}={max_tokens} asks for {longest + max_tokens}. Lower {key} to at most {room}, or "
                "shorten the prompt",
                param=key,
                code="context_length_exceeded",
            )
    elif chat:
        # The rest of the context, written as the whole context: a default that depended on the prompt's
        # length would split requests into separate generate calls (only identical SamplingParams share one),
        # and the engine ends each sequence at the model's context anyway ("length").
        max_tokens = served.max_positions if served.max_positions is not None else 256
    else:
        max_tokens = 16  # likewise not cut to the room the prompt leaves: the engine does that
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        n=n,
        stop_token_ids=tuple(sorted(set(stop_ids))),
        seed=seed,
    )


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad_type("stop", stop, "a string or an array of strings")
    if len(stops) > MAX_STOPS:
        raise APIError(f"stop has {len(stops)} strings; give at most {MAX_STOPS}", param="stop")
    if any(s == "" for s in stops):
        raise APIError("stop strings must not be empty", param="stop")
    for stop in stops:
        _checked(http.unicode_text, stop, "stop")
    return tuple(dict.fromkeys(stops))


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad_type("stream", stream, "a boolean")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise APIError("stream_options is only allowed with stream: true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _bad_type("stream_options", options, 'an object like {"include_usage": true}')
        include_usage = options.get("include_usage")
        include_usage = False if include_usage is None else include_usage
        if not isinstance(include_usage, bool):
            raise _bad_type("stream_options.include_usage", include_usage, "a boolean")
    return bool(stream), include_usage


def _encode(text: str, where: str, param: str, served: ServedModel) -> list[int]:
    """Token ids of ``text``; 400 for text no tokenizer takes (a lone surrogate such as ``"\\ud800"``)."""
    _check_text(text, where, param, served)
    return list(served.tokenizer(text, add_special_tokens=False)["input_ids"])


def _check_text(text: str, where: str, param: str, served: ServedModel) -> None:
    """Before tokenizing: valid Unicode, and not so long that it cannot fit in the context (see
    ``max_prompt_chars`` in app/rollout/http_common.py)."""
    try:
        http.unicode_text(text, where)
    except FieldError as exc:
        raise APIError(exc.message, param=param) from None
    length = len(text)
    if served.max_prompt_chars is not None and length > served.max_prompt_chars:
        raise APIError(
            f"this model's maximum context length is {served.max_positions} tokens and {where} has {length} "
            f"characters, more than any text of that many tokens ({served.max_prompt_chars} characters at "
            "most); shorten it",
            param=param,
            code="context_length_exceeded",
        )


def _check_prompt_ids(ids: list[int], where: str, served: ServedModel) -> list[int]:
    if not ids:
        raise APIError(f"{where} is empty; every prompt needs at least one token", param="prompt")
    bad = [t for t in ids if not 0 <= t < served.vocab_size]
    if bad:
        raise APIError(f"{where} has token ids outside [0, {served.vocab_size}): {bad[:5]}", param="prompt")
    if served.max_positions is not None and len(ids) >= served.max_positions:
        raise APIError(
            f"this model's maximum context length is {served.max_positions} tokens and {where} has {len(ids)}, "
            "leaving no room for a completion; shorten it",
            param="prompt",
            code="context_length_exceeded",
        )
    return ids


def parse_completion(body: Any, served: ServedModel) -> _Parsed:
    """Validate a ``/v1/completions`` body; APIError (400/404) if it is malformed or unsupported."""
    body = _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    _check_model(body, served)
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError("prompt is required: a string, an array of strings, or token ids", param="prompt")
    if isinstance(prompt, str):
        raw = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raw = list(prompt)
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        raw = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        if not all(all(is_int(t) for t in p) for p in prompt):
            raise _bad_type("prompt", prompt, "token ids (an array of arrays of integers)")
        raw = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise APIError("prompt is an empty array; give at least one prompt", param="prompt")
    else:
        raise _bad_type("prompt", prompt, "a string, an array of strings, an array of token ids or of arrays")
    if len(raw) > MAX_SEQUENCES:  # before tokenizing them all; _sampling counts prompts x n
        raise APIError(
            f"{len(raw)} prompts; one request may ask for at most {MAX_SEQUENCES} sequences: split it",
            param="prompt",
        )
    for i, item in enumerate(raw):  # every text checked before any is tokenized
        if isinstance(item, str):
            _check_text(item, "prompt" if len(raw) == 1 else f"prompt[{i}]", "prompt", served)
    prompts = []
    for i, item in enumerate(raw):
        where = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise APIError(f"{where} is an empty string; give some text", param="prompt")
            ids = _encode(item, where, "prompt", served)
            if not ids:
                raise APIError(f"{where} encodes to zero tokens; give some text", param="prompt")
        else:
            ids = list(item)
        prompts.append(_check_prompt_ids(ids, where, served))
    logprobs = body.get("logprobs")
    if logprobs is not None and (not is_int(logprobs) or logprobs < 0):
        raise APIError(f"logprobs must be an integer >= 0, got {_show(logprobs)}", param="logprobs")
    if logprobs:
        raise APIError(
            f"logprobs={logprobs}: top alternatives are not computed by the built-in server; "
            "logprobs=0 returns the logprob of each sampled token",
            param="logprobs",
        )
    stream, include_usage = _stream_flags(body)
    return _Parsed(
        prompts=prompts,
        params=_sampling(body, served, prompts, chat=False),
        stops=_stops(body),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs is not None,
        chat=False,
    )


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise APIError(
                    f'{where}.content[{j}] must be a text part {{"type": "text", "text": ...}}; '
                    f"only text is supported, got {_show(part)}",
                    param=f"{where}.content",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise _bad_type(f"{where}.content", content, "a string or an array of text parts")


def parse_chat(body: Any, served: ServedModel) -> _Parsed:
    """Validate a ``/v1/chat/completions`` body and render its messages with the chat template."""
    body = _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    _check_model(body, served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(
            f'messages must be a non-empty array of {{"role", "content"}} objects, got {_show(messages)}',
            param="messages",
        )
    rendered = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad_type(where, message, 'an object {"role": ..., "content": ...}')
        role = message.get("role")
        if role not in _ROLES:
            raise APIError(
                f"{where}.role must be one of {sorted(_ROLES)}, got {_show(role)}"
                + (
                    " (tool messages need function calling, which is not supported)" if role == "tool" else ""
                ),
                param=f"{where}.role",
            )
        if message.get("tool_calls"):
            raise APIError(
                f"{where}.tool_calls: function calling is not supported", param=f"{where}.tool_calls"
            )
        rendered.append({"role": _ROLES[role], "content": _message_text(message.get("content"), where)})
    for i, message in enumerate(rendered):
        try:
            http.unicode_text(message["content"], f"messages[{i}].content")
        except FieldError as exc:
            raise APIError(exc.message, param="messages") from None
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise APIError(
            f'response_format must be {{"type": "text"}}: constrained decoding is not supported, got '
            f"{_show(response_format)}",
            param="response_format",
        )
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad_type("chat_template_kwargs", kwargs, "an object")
    if "chat_template" in kwargs:  # a client's own Jinja could loop for ever, holding a worker thread (a DoS)
        raise APIError(
            "chat_template_kwargs.chat_template is refused: messages are rendered with the model's own template",
            param="chat_template_kwargs",
        )
    tokenizer = served.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            f"the model {served.name!r} has no chat template, so /v1/chat/completions cannot render messages; "
            "use /v1/completions with a prompt",
            param="messages",
        )
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja raises its own types for a template's checks
        raise APIError(f"the chat template refused these messages: {exc}", param="messages") from None
    ids = _check_prompt_ids(_encode(text, "the chat", "messages", served), "the chat", served)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad_type("logprobs", logprobs, "a boolean")
    stream, include_usage = _stream_flags(body)
    return _Parsed(
        prompts=[ids],
        params=_sampling(body, served, [ids], chat=True),
        stops=_stops(body),
        stream=stream,
        include_usage=include_usage,
        logprobs=bool(logprobs),
        chat=True,
    )


# ---------------------------------------------------------------------------------------------- text


class _TextTracker:
    """The decoded text of one sample as its tokens arrive: stop strings and what is safe to send.

    ``push`` runs in the generating thread (the ``on_token`` hook); nothing else touches the tracker until the
    sample is finished, so it needs no lock.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # a stop string may be forming at the end
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.matched: str | None = None

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.stops:
            # A new match ends in the new text (a few characters of margin: a trailing partial UTF-8 character
            # of the previous text may have decoded differently).
            start = max(0, len(self.text) - self.hold - 4)
            hits = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
            if hits:
                cut, self.matched = min(hits)
                text = text[:cut]
        self.text = text

    def take(self, final: bool) -> str:
        """Text not sent yet that can no longer change (all of it once the sample is finished)."""
        end = len(self.text)
        if not final and self.matched is None:
            end -= self.hold
            while end > self.sent and self.text[end - 1] == "\ufffd":  # an incomplete UTF-8 character
                end -= 1
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : end], end
        return delta


# ---------------------------------------------------------------------------------------------- responses


def _finish(completion: Completion | None, tracker: _TextTracker | None) -> str:
    if completion is None:
        return "abort"
    if tracker is not None and tracker.matched is not None:
        return "stop"
    return completion.finish_reason


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def _completion_logprobs(tokenizer, ids: list[int], logprobs: list[float], offset: int = 0) -> dict:
    tokens = [_token_text(tokenizer, t) for t in ids]
    offsets, position = [], offset
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


def _chat_logprobs(tokenizer, ids: list[int], logprobs: list[float]) -> dict:
    content = []
    for token, logprob in zip(ids, logprobs, strict=True):
        text = _token_text(tokenizer, token)
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


def _completion_tokens(completions: list[Completion | None]) -> int:
    return sum(len(c.output_ids) for c in completions if c is not None)


def _usage(parsed: _Parsed, completion_tokens: int) -> dict:
    prompt_tokens = sum(len(p) for p in parsed.prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# ---------------------------------------------------------------------------------------------- the app


@dataclass
class _Run:
    """One request in flight: one future per prompt on the scheduler, one text tracker per sample."""

    parsed: _Parsed
    futures: list[asyncio.Future]
    trackers: list[list[_TextTracker | None]]
    events: asyncio.Queue | None
    cancelled: threading.Event


def _submit(app: FastAPI, parsed: _Parsed, served: ServedModel) -> _Run:
    """Queue the request's prompts on the scheduler with token hooks: every request can be cancelled; streams
    and stop strings also follow the decoded text."""
    loop = asyncio.get_running_loop()
    n = parsed.params.n
    track = parsed.stream or bool(parsed.stops)
    events: asyncio.Queue | None = asyncio.Queue() if parsed.stream else None
    cancelled = threading.Event()
    trackers: list[list[_TextTracker | None]] = [
        [_TextTracker(served.tokenizer, parsed.stops) if track else None for _ in range(n)]
        for _ in parsed.prompts
    ]

    def hook(i: int) -> Callable[[int, int, float, str | None], bool]:
        def on_token(k: int, token: int, logprob: float, finish: str | None) -> bool:
            if cancelled.is_set():
                return True
            tracker = trackers[i][k]
            if tracker is None:
                return False
            tracker.push(token)
            halt = tracker.matched is not None
            if events is not None:
                reason = "stop" if halt else finish
                delta = tracker.take(final=reason is not None)
                loop.call_soon_threadsafe(events.put_nowait, (i * n + k, delta, token, logprob, reason))
            return halt

        return on_token

    scheduler = app.state.scheduler
    # A seeded request runs alone, so its samples are what generate_sync gives these prompts with that seed.
    key = uuid.uuid4().hex if parsed.params.seed is not None else None
    futures = [
        scheduler.enqueue(ids, parsed.params, on_token=hook(i), request_key=key)
        for i, ids in enumerate(parsed.prompts)
    ]
    scheduler.stats.requests += 1
    return _Run(parsed, futures, trackers, events, cancelled)


def _cancel(run: _Run) -> None:
    """The client went away: end running samples at the next step, drop queued ones."""
    run.cancelled.set()
    for future in run.futures:
        if not future.done():
            future.cancel()


async def _results(run: _Run) -> list[Completion | None]:
    """Completions in choice order (prompt-major, n per prompt); None for an aborted sample."""
    try:
        per_prompt = await asyncio.gather(*run.futures)
    except Exception as exc:  # noqa: BLE001 - a failure inside the engine
        raise APIError(
            f"generation failed: {type(exc).__name__}: {exc}", status=500, type="server_error"
        ) from None
    n = run.parsed.params.n
    return [c for group in per_prompt for c in (group if group is not None else [None] * n)]


async def _results_unless_disconnected(request: Request, run: _Run) -> list[Completion | None] | None:
    """``_results(run)``, or None once the client has gone away: its samples are then ended at the next step
    (a streamed request gets the same from Starlette, which cancels the stream when the client leaves)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":  # the body was read: only this comes
            pass

    results, gone = asyncio.ensure_future(_results(run)), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
        return results.result() if results.done() else None
    finally:
        _cancel(run)  # nothing to do once the results are in; ends the samples of a client that went away
        gone.cancel()
        results.cancel()


def _text(served: ServedModel, completion: Completion | None, tracker: _TextTracker | None) -> str:
    if completion is None:
        return ""
    if tracker is not None:
        return tracker.text
    return served.tokenizer.decode(completion.output_ids, skip_special_tokens=True)


def _response(served: ServedModel, run: _Run, completions: list[Completion | None]) -> dict:
    parsed, n = run.parsed, run.parsed.params.n
    choices = []
    for index, completion in enumerate(completions):
        tracker = run.trackers[index // n][index % n]
        text = _text(served, completion, tracker)
        logprobs = None
        if parsed.logprobs and completion is not None:
            maker = _chat_logprobs if parsed.chat else _completion_logprobs
            logprobs = maker(served.tokenizer, completion.output_ids, completion.output_logprobs)
        choice: dict[str, Any] = {"index": index}
        if parsed.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = _finish(completion, tracker)
        choices.append(choice)
    return {
        "id": f"{'chatcmpl' if parsed.chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if parsed.chat else "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": choices,
        "usage": _usage(parsed, _completion_tokens(completions)),
    }


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _stream(app: FastAPI, served: ServedModel, parsed: _Parsed) -> AsyncIterator[str]:
    """Server-sent events of one streamed request, token by token (see the module docstring)."""
    chat, n = parsed.chat, parsed.params.n
    total = len(parsed.prompts) * n
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": served.name,
    }

    def chunk(
        index: int, text: str | None, finish: str | None, logprobs: dict | None = None, role=False
    ) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return _sse({**head, "choices": [choice]})

    finished: set[int] = set()

    def emit(event: tuple) -> list[str]:
        index, delta, token, logprob, reason = event
        if index in finished:
            return []
        logprobs = None
        if parsed.logprobs:
            maker = _chat_logprobs if chat else _completion_logprobs
            logprobs = maker(served.tokenizer, [token], [logprob])
        if reason is not None:
            finished.add(index)
        if not chat:
            return [chunk(index, delta, reason, logprobs)]
        out = [chunk(index, delta, None, logprobs)] if delta or logprobs else []
        return out + ([chunk(index, None, reason)] if reason is not None else [])

    async with app.state.lock.read():
        run = _submit(app, parsed, served)
        results = asyncio.ensure_future(_results(run))
        getter: asyncio.Future | None = None
        try:
            if chat:
                for index in range(total):
                    yield chunk(index, None, None, role=True)
            while len(finished) < total:
                getter = asyncio.ensure_future(run.events.get())
                await asyncio.wait({getter, results}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    break  # the batch is over; its last events were queued before its results (drained below)
                for line in emit(getter.result()):
                    yield line
            if len(finished) == total:
                # Every sample has sent its last token: end now, not when the rest of its batch (other
                # requests' sequences) is done. Each tracker was pushed every token of its sample.
                completion_tokens = sum(len(tracker.ids) for group in run.trackers for tracker in group)
            else:  # some samples ended without a last event (aborted before they ran, or a failed hook)
                try:
                    completions = await results
                except APIError as exc:
                    yield _sse(exc.body())
                    yield _sse("[DONE]")
                    return
                while not run.events.empty():
                    for line in emit(run.events.get_nowait()):
                        yield line
                for index, completion in enumerate(completions):
                    if index not in finished:
                        tracker = run.trackers[index // n][index % n]
                        rest = tracker.take(final=True) if completion is not None else ""
                        if chat and rest:
                            yield chunk(index, rest, None)
                        yield chunk(index, None if chat else rest, _finish(completion, tracker))
                completion_tokens = _completion_tokens(completions)
            if parsed.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(parsed, completion_tokens)})
            yield _sse("[DONE]")
        finally:
            if getter is not None:
                getter.cancel()  # a client that went away left it waiting on the queue
            _cancel(run)  # nothing to do for a finished request; ends the samples of a client that went away
            results.cancel()


def create_openai_app(
    engine: EmbeddedEngine,
    tokenizer,
    *,
    model_name: str,
    model_path: str,
    max_batch_size: int = 256,
    batch_window_ms: float = 5.0,
    aliases: tuple[str, ...] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The built-in CPU server (native SGLang routes) plus the OpenAI-compatible ``/v1`` routes.

    ``model_name`` is what ``/v1/models`` lists; requests may also name any of ``aliases``. ``max_body_bytes``:
    the largest request body read, on every route (a larger one answers 413).
    """
    app = create_app(  # it also warms the tokenizer up before it is used from several threads
        engine,
        model_path=model_path,
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        tokenizer=tokenizer,
        served_model_name=model_name,
        max_body_bytes=max_body_bytes,
    )
    served = ServedModel(
        name=model_name,
        root=model_path,
        tokenizer=tokenizer,
        chat_stop_ids=_chat_stop_ids(engine, tokenizer),
        vocab_size=engine.vocab_size,
        max_positions=engine.max_positions,
        max_prompt_chars=app.state.max_prompt_chars,
        aliases=tuple(a for a in aliases if a != model_name),
    )
    app.state.served = served

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    native_http_error = app.exception_handlers.get(StarletteHTTPException)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if not request.url.path.startswith("/v1"):
            if native_http_error is not None:
                return await native_http_error(request, exc)
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message += "; the routes are POST /v1/completions, POST /v1/chat/completions, GET /v1/models"
        return APIError(message, code=code, status=exc.status_code).response()

    async def body_of(request: Request) -> Any:
        try:
            return await http.read_json(request, max_body_bytes)
        except http.BodyError as exc:
            code = "request_too_large" if exc.status == 413 else None
            raise APIError(exc.message, status=exc.status, code=code) from None

    async def generate(request: Request, parse: Callable[[Any, ServedModel], _Parsed]):
        # Parsed in a worker thread: tokenizing a long prompt or rendering a long chat takes a while, and
        # other clients must not wait for it.
        parsed = await asyncio.to_thread(parse, await body_of(request), served)
        if parsed.stream:
            return StreamingResponse(
                _stream(request.app, served, parsed),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        async with request.app.state.lock.read():
            run = _submit(request.app, parsed, served)
            completions = await _results_unless_disconnected(request, run)
        if completions is None:
            return APIError("the client closed the connection", status=499).response()  # read by no one
        return JSONResponse(_response(served, run, completions))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, parse_chat)

    def model_card() -> dict:
        return {
            "id": served.name,
            "object": "model",
            "created": served.created,
            "owned_by": "trustbatch",
            "root": served.root,
            "max_model_len": served.max_positions,
        }

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        _check_model_name(model_id, served)
        return model_card()

    return app


def _chat_stop_ids(engine: EmbeddedEngine, tokenizer) -> tuple[int, ...]:
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    eos = getattr(getattr(engine.model, "generation_config", None), "eos_token_id", None)
    for token in eos if isinstance(eos, (list, tuple)) else [eos]:
        if isinstance(token, int):
            ids.add(token)
    return tuple(sorted(t for t in ids if t < engine.vocab_size))


def build_app(
    model_dir: Path,
    *,
    model_name: str,
    max_batch_size: int = 256,
    batch_window_ms: float = 5.0,
    aliases: tuple[str, ...] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """Load ``model_dir`` (HF format) into the built-in engine and return the OpenAI-compatible app."""
    from transformers import AutoTokenizer

    engine = EmbeddedEngine.from_pretrained(model_dir, max_batch_size=max_batch_size)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return create_openai_app(
        engine,
        tokenizer,
        model_name=model_name,
        model_path=str(model_dir),
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        aliases=aliases,
        max_body_bytes=max_body_bytes,
    )


def served_name(ref: str) -> str:
    """The default model name clients send: the reference without its scheme (``models:/q@best`` -> ``q@best``).

    SGLang refuses a served model name with a colon (reserved for ``model:adapter``), so the scheme goes.
    """
    for scheme in ("models:/", "runs:/"):
        if ref.startswith(scheme):
            return ref[len(scheme) :]
    return ref


# ---------------------------------------------------------------------------------------------- engines


EngineChoice = Literal["auto", "builtin", "sglang"]


def choose_engine(
    requested: EngineChoice, *, sglang_python: str | None = None
) -> Literal["builtin", "sglang"]:
    """``auto``: SGLang when CUDA is available and SGLang is installed, else the built-in CPU engine.

    ``sglang_python``: the interpreter of another environment that has SGLang (it pins its own torch); it is
    trusted to have it, and makes ``auto`` choose SGLang when CUDA is available.
    """
    if requested not in ("auto", "builtin", "sglang"):
        raise ValueError(f"--engine {requested!r}: choose auto, builtin or sglang")
    if requested == "builtin":
        return "builtin"
    if sglang_python is not None and not Path(sglang_python).is_file():
        raise ValueError(
            f"--sglang-python {sglang_python!r} does not exist; give the interpreter of an environment with "
            "SGLang installed (e.g. .venv-sglang/bin/python)"
        )
    has_sglang = sglang_python is not None or importlib.util.find_spec("sglang") is not None
    if requested == "sglang":
        if not has_sglang:
            raise ValueError(
                "--engine sglang: SGLang is not installed in this environment; install the GPU extra "
                "(pip install 'trustbatch[gpu]', as the Docker image does), point --sglang-python at an "
                "environment that has it, or use --engine builtin"
            )
        return "sglang"
    import torch

    if torch.cuda.is_available():
        if has_sglang:
            return "sglang"
        logger.warning(
            "CUDA is available but SGLang is not installed: serving with the built-in CPU engine; "
            "install trustbatch[gpu] to serve with SGLang"
        )
    return "builtin"


def sglang_command(
    model_dir: Path,
    *,
    host: str,
    port: int,
    served_model_name: str,
    extra_args: str = "",
    python: str | None = None,
) -> list[str]:
    """The SGLang launch command (SGLang's own OpenAI-compatible server on ``host:port``)."""
    return [
        python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served_model_name,
        *shlex.split(extra_args),
    ]


def serve(
    ref: str,
    *,
    tracking_uri: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    engine: EngineChoice = "auto",
    served_model_name: str | None = None,
    max_batch_size: int = 256,
    batch_window_ms: float = 5.0,
    sglang_args: str = "",
    sglang_python: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    announce: Callable[[str], None] = print,
) -> None:
    """Resolve ``ref`` and serve it until interrupted (SGLang replaces this process; see the module docstring).

    Raises ModelRefError / ValueError for a reference or an option that cannot work, before anything starts.
    """
    from app.models import fetch, lookup

    if not 1 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port; give one in 1-65535")
    if max_batch_size < 1:
        raise ValueError(f"--max-batch-size {max_batch_size} must be >= 1")
    if batch_window_ms < 0:
        raise ValueError(f"--batch-window-ms {batch_window_ms} must be >= 0")
    if max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes {max_body_bytes} must be >= 1")
    kind = choose_engine(engine, sglang_python=sglang_python)
    source = lookup(ref, tracking_uri=tracking_uri)
    model_dir = fetch(source, tracking_uri=tracking_uri)
    name = served_model_name or served_name(ref)
    announce(f"model: {source.label} -> {model_dir}")
    if kind == "sglang":
        if ":" in name:
            raise ValueError(
                f"the served model name {name!r} has a colon, which SGLang refuses (it means model:adapter); "
                "pass --served-model-name NAME"
            )
        command = sglang_command(
            model_dir,
            host=host,
            port=port,
            served_model_name=name,
            extra_args=sglang_args,
            python=sglang_python,
        )
        announce(f"engine: SGLang ({shlex.join(command)})")
        sys.stdout.flush()
        os.execv(command[0], command)  # SGLang's server takes over this process (signals, exit code)
    import uvicorn

    app = build_app(
        model_dir,
        model_name=name,
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        aliases=(ref,),  # the reference as typed is accepted too
        max_body_bytes=max_body_bytes,
    )
    announce(f"engine: built-in CPU server; OpenAI API at http://{host}:{port}/v1 as model {name!r}")
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(app, host=host, port=port, log_level="warning")
