"""The OpenAI-compatible ``/v1`` API of the built-in server (``trustbatch serve`` with the built-in engine).

The app is the native one (app/serving/native.py: its routes stay, ``GET /health`` included) plus
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /v1/models/{id}``.
Requests from all clients join the same batching scheduler as ``/generate``; the model answers to its served
name and to any of its aliases (the reference as typed).

What it honours (everything else answers 400 naming the field, never silently ignored):
- completions: ``prompt`` (str, [str], [int] or [[int]]), ``max_tokens`` (default 16), ``temperature`` (0 =
  greedy, or 1e-6 to 2), ``top_p``, ``n`` (1-128), ``stop`` (str or up to 16 strings), ``stop_token_ids``
  (SGLang's extension), ``seed``, ``stream`` + ``stream_options.include_usage``, ``logprobs: 0`` (the logprob
  of each sampled token; top alternatives are not computed), ``user`` (ignored).
- chat: ``messages`` (roles system/developer/user/assistant; string content or text parts) rendered with the
  tokenizer's chat template and the generation prompt, ``max_tokens`` or ``max_completion_tokens`` (default:
  the rest of the context), ``logprobs: true`` (``top_logprobs`` 0), ``response_format`` text, and the same
  sampling fields. The tokenizer's EOS and the usual end-of-turn tokens (``<|im_end|>``...) end a reply.
- Token-by-token streaming: each sampled token reaches its request through the scheduler's ``on_token`` hook
  as the decoding step that sampled it ends, and goes out as one server-sent event ``data: {json}\\n\\n``; the
  stream ends with ``data: [DONE]\\n\\n`` as soon as its own samples have ended (not when the rest of their
  batch has). Text that could still become a stop string, or an incomplete UTF-8 character, is held back.
- A client that disconnects, streamed or not, has its sequences ended at the next step.
- Stop strings end a sequence as soon as its decoded text contains one (the text is cut before it, finish
  "stop"); the EOS or a stop token id also gives "stop", the token budget or the model's context "length".
- Logprobs are the engine's behaviour logprobs: log-softmax of logits / temperature (T = 1 for greedy) before
  top-p truncation, what SGLang reports too.

Errors follow OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed or
unsupported requests, 404 for an unknown model (code ``model_not_found``) or route, 405 for a wrong method, 413
for a body over ``max_body_bytes`` (code ``request_too_large``), 500 only for a failure inside the engine
(type ``server_error``). A prompt that leaves no room in the context, or asks ``max_tokens`` beyond it, gets
code ``context_length_exceeded``. Values are checked by app/sampling.py and prompts by app/serving/requests.py,
as on the native routes; parsing, tokenizing and chat templates run in a worker thread.

Code layout: module-level handlers over ``OpenAIState`` (``app.state.openai``: the served names, the text
tracker's stop strings) beside the native state; one ``RequestError`` handler renders errors in OpenAI's shape
for ``/v1`` paths and in the native shape elsewhere.

Not covered: tools / function calling, ``echo``, ``suffix``, ``best_of > n``, penalties, ``logit_bias``,
top-k logprobs, images, embeddings, the Responses API.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import sampling
from app.rollout.base import Completion, SamplingParams
from app.sampling import RequestError, describe, is_int
from app.serving import native
from app.serving.native import NativeState
from app.serving.requests import DEFAULT_MAX_BODY_BYTES, ServedModel, printable, read_json

MAX_N = 128
MAX_SEQUENCES = 4096
"""Most sequences (prompts x n) one request may ask for; more is refused rather than left to hog the server."""
MAX_STOPS = 16
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
"""Tokens that end an assistant turn in common chat templates; those in the vocabulary stop chat replies."""

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
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def error_body(exc: RequestError) -> dict:
    # printable: a message or param may quote a client's text, lone surrogates included.
    return {
        "error": {
            "message": printable(exc.message),
            "type": "server_error" if exc.status >= 500 else "invalid_request_error",
            "param": None if exc.field is None else printable(exc.field),
            "code": exc.code,
        }
    }


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array"}.get(
        type(value), "an object"
    )


def _bad_type(param: str, value: Any, expected: str) -> RequestError:
    return RequestError(f"{param} must be {expected}, got {_kind(value)} {describe(value)}", param)


# ---------------------------------------------------------------------------------------------- parsing


@dataclass
class OpenAIState:
    """What the ``/v1`` routes add to the native state (``app.state.openai``)."""

    name: str
    root: str
    chat_stop_ids: tuple[int, ...]
    aliases: tuple[str, ...] = ()
    """Other names accepted in requests (the reference as typed, e.g. ``models:/NAME@best``)."""
    created: int = field(default_factory=lambda: int(time.time()))


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


def _check_fields(body: Any, allowed: tuple[str, ...], route: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_kind(body)}")
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise RequestError(
            f"unrecognized request argument(s) for {route}: {', '.join(unknown)}; supported: {', '.join(allowed)}",
            unknown[0],
        )
    sampling.check_supported(body)
    return body


def _check_model_name(model: str, served: OpenAIState) -> None:
    if model != served.name and model not in served.aliases:
        raise RequestError(
            f"the model {model!r} does not exist; this server serves {served.name!r} (see GET /v1/models)",
            "model",
            code="model_not_found",
            status=404,
        )


def _check_model(body: dict, served: OpenAIState) -> None:
    model = body.get("model")
    if model is None:
        raise RequestError(f"you must provide a model parameter; this server serves {served.name!r}", "model")
    if not isinstance(model, str):
        raise _bad_type("model", model, "a string")
    _check_model_name(model, served)


def _sampling(
    body: dict, model: ServedModel, served: OpenAIState, prompts: list[list[int]], *, chat: bool
) -> SamplingParams:
    kwargs = sampling.check_sampling(
        {key: (key, body.get(key)) for key in ("temperature", "top_p", "n")},
        max_n=MAX_N,
        max_temperature=sampling.MAX_TEMPERATURE,
    )
    n = kwargs.get("n", 1)
    if n * len(prompts) > MAX_SEQUENCES:
        raise RequestError(
            f"{len(prompts)} prompts x n={n} is {n * len(prompts)} sequences; one request may ask for at most "
            f"{MAX_SEQUENCES}: split it",
            "prompt",
        )
    best_of = body.get("best_of")
    if best_of is not None and (not is_int(best_of) or best_of != n):
        raise RequestError(f"best_of must equal n ({n}) or be omitted, got {describe(best_of)}", "best_of")
    kwargs |= sampling.check_sampling(
        {key: (key, body.get(key)) for key in ("seed", "stop_token_ids")}, vocab_size=model.vocab_size
    )
    stop_ids = [*kwargs.get("stop_token_ids", ()), *(served.chat_stop_ids if chat else ())]
    kwargs["stop_token_ids"] = tuple(sorted(set(stop_ids)))

    names = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
    given = {
        k: sampling.bounded_int(body[k], k, 1, sampling.MAX_NEW_TOKENS)
        for k in names
        if body.get(k) is not None
    }
    if len(set(given.values())) > 1:
        raise RequestError(
            f"max_tokens={given['max_tokens']} and max_completion_tokens={given['max_completion_tokens']} differ; "
            "give one of them",
            "max_completion_tokens",
        )
    longest = max(len(p) for p in prompts)
    room = None if model.max_positions is None else model.max_positions - longest
    if given:
        key, max_tokens = next(iter(given.items()))
        if room is not None and max_tokens > room:
            raise RequestError(
                f"this model's maximum context length is {model.max_positions} tokens; the prompt has {longest} "
                f"and {key}={max_tokens} asks for {longest + max_tokens}. Lower {key} to at most {room}, or "
                "shorten the prompt",
                key,
                code="context_length_exceeded",
            )
    elif chat:
        # The rest of the context, written as the whole context: a default that depended on the prompt's
        # length would split requests into separate generate calls (only identical SamplingParams share one),
        # and the engine ends each sequence at the model's context anyway ("length").
        max_tokens = model.max_positions if model.max_positions is not None else 256
    else:
        max_tokens = 16  # likewise not cut to the room the prompt leaves: the engine does that
    return SamplingParams(max_new_tokens=max_tokens, **kwargs)


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad_type("stream", stream, "a boolean")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _bad_type("stream_options", options, 'an object like {"include_usage": true}')
        include_usage = options.get("include_usage")
        include_usage = False if include_usage is None else include_usage
        if not isinstance(include_usage, bool):
            raise _bad_type("stream_options.include_usage", include_usage, "a boolean")
    return bool(stream), include_usage


def _parsed(
    body: dict, model: ServedModel, served: OpenAIState, prompts, logprobs: bool, chat: bool
) -> _Parsed:
    stream, include_usage = _stream_flags(body)
    params = _sampling(body, model, served, prompts, chat=chat)
    stops = sampling.stop_strings(body.get("stop"), "stop", MAX_STOPS)
    return _Parsed(prompts, params, stops, stream, include_usage, logprobs, chat)


def parse_completion(body: Any, model: ServedModel, served: OpenAIState) -> _Parsed:
    """Validate a ``/v1/completions`` body; RequestError (400/404) if it is malformed or unsupported."""
    body = _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    _check_model(body, served)
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("prompt is required: a string, an array of strings, or token ids", "prompt")
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
        raise RequestError("prompt is an empty array; give at least one prompt", "prompt")
    else:
        raise _bad_type("prompt", prompt, "a string, an array of strings, an array of token ids or of arrays")
    if len(raw) > MAX_SEQUENCES:  # before tokenizing them all; _sampling counts prompts x n
        raise RequestError(
            f"{len(raw)} prompts; one request may ask for at most {MAX_SEQUENCES} sequences: split it",
            "prompt",
        )
    wheres = ["prompt"] if len(raw) == 1 else [f"prompt[{i}]" for i in range(len(raw))]
    for where, item in zip(wheres, raw, strict=True):  # every text checked before any is tokenized
        if isinstance(item, str):
            model.check_text(item, where, "prompt")
    prompts = [
        model.check_ids(
            model.encode(item, where, "prompt") if isinstance(item, str) else item, where, "prompt"
        )
        for where, item in zip(wheres, raw, strict=True)
    ]
    logprobs = body.get("logprobs")
    if logprobs is not None and (not is_int(logprobs) or logprobs < 0):
        raise RequestError(f"logprobs must be an integer >= 0, got {describe(logprobs)}", "logprobs")
    if logprobs:
        raise RequestError(
            f"logprobs={logprobs}: top alternatives are not computed by the built-in server; "
            "logprobs=0 returns the logprob of each sampled token",
            "logprobs",
        )
    return _parsed(body, model, served, prompts, logprobs is not None, chat=False)


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
                raise RequestError(
                    f'{where}.content[{j}] must be a text part {{"type": "text", "text": ...}}; '
                    f"only text is supported, got {describe(part)}",
                    f"{where}.content",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise _bad_type(f"{where}.content", content, "a string or an array of text parts")


def parse_chat(body: Any, model: ServedModel, served: OpenAIState) -> _Parsed:
    """Validate a ``/v1/chat/completions`` body and render its messages with the chat template."""
    body = _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    _check_model(body, served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            f'messages must be a non-empty array of {{"role", "content"}} objects, got {describe(messages)}',
            "messages",
        )
    rendered = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad_type(where, message, 'an object {"role": ..., "content": ...}')
        role = message.get("role")
        if role not in _ROLES:
            tool = " (tool messages need function calling, which is not supported)" if role == "tool" else ""
            raise RequestError(
                f"{where}.role must be one of {sorted(_ROLES)}, got {describe(role)}{tool}", f"{where}.role"
            )
        if message.get("tool_calls"):
            raise RequestError(
                f"{where}.tool_calls: function calling is not supported", f"{where}.tool_calls"
            )
        rendered.append({"role": _ROLES[role], "content": _message_text(message.get("content"), where)})
    for i, message in enumerate(rendered):
        try:
            sampling.unicode_text(message["content"], f"messages[{i}].content")
        except RequestError as exc:
            raise RequestError(exc.message, "messages") from None
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise RequestError(
            f'response_format must be {{"type": "text"}}: constrained decoding is not supported, got '
            f"{describe(response_format)}",
            "response_format",
        )
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad_type("chat_template_kwargs", kwargs, "an object")
    if "chat_template" in kwargs:  # a client's own Jinja could loop for ever, holding a worker thread (a DoS)
        raise RequestError(
            "chat_template_kwargs.chat_template is refused: messages are rendered with the model's own template",
            "chat_template_kwargs",
        )
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(
            f"the model {served.name!r} has no chat template, so /v1/chat/completions cannot render messages; "
            "use /v1/completions with a prompt",
            "messages",
        )
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja raises its own types for a template's checks
        raise RequestError(f"the chat template refused these messages: {exc}", "messages") from None
    ids = model.check_ids(model.encode(text, "the chat", "messages"), "the chat", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad_type("logprobs", logprobs, "a boolean")
    return _parsed(body, model, served, [ids], bool(logprobs), chat=True)


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


def _logprobs(tokenizer, chat: bool, ids: list[int], logprobs: list[float]) -> dict:
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    if chat:
        content = [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in zip(tokens, logprobs, strict=True)
        ]
        return {"content": content}
    offsets, position = [], 0
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


def _completion_tokens(completions: list[Completion | None]) -> int:
    return sum(len(c.output_ids) for c in completions if c is not None)


def _usage(parsed: _Parsed, completion_tokens: int) -> dict:
    prompt_tokens = sum(len(p) for p in parsed.prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _head(served: OpenAIState, chat: bool, chunk: bool = False) -> dict:
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion",
        "created": int(time.time()),
        "model": served.name,
    }


# ---------------------------------------------------------------------------------------------- a request in flight


@dataclass
class _Run:
    """One request in flight: one future per prompt on the scheduler, one text tracker per sample."""

    parsed: _Parsed
    futures: list[asyncio.Future]
    trackers: list[list[_TextTracker | None]]
    events: asyncio.Queue | None
    cancelled: threading.Event


def _submit(state: NativeState, parsed: _Parsed) -> _Run:
    """Queue the request's prompts on the scheduler with token hooks: every request can be cancelled; streams
    and stop strings also follow the decoded text."""
    loop = asyncio.get_running_loop()
    n = parsed.params.n
    track = parsed.stream or bool(parsed.stops)
    events: asyncio.Queue | None = asyncio.Queue() if parsed.stream else None
    cancelled = threading.Event()
    trackers: list[list[_TextTracker | None]] = [
        [_TextTracker(state.model.tokenizer, parsed.stops) if track else None for _ in range(n)]
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

    # A seeded request runs alone, so its samples are what generate_sync gives these prompts with that seed.
    key = uuid.uuid4().hex if parsed.params.seed is not None else None
    futures = [
        state.scheduler.enqueue(ids, parsed.params, on_token=hook(i), request_key=key)
        for i, ids in enumerate(parsed.prompts)
    ]
    state.scheduler.stats.requests += 1
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
        raise RequestError(f"generation failed: {type(exc).__name__}: {exc}", status=500) from None
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


def _response(
    state: NativeState, served: OpenAIState, run: _Run, completions: list[Completion | None]
) -> dict:
    parsed, n, tokenizer = run.parsed, run.parsed.params.n, state.model.tokenizer
    choices = []
    for index, completion in enumerate(completions):
        tracker = run.trackers[index // n][index % n]
        if completion is None:
            text = ""
        elif tracker is not None:
            text = tracker.text
        else:
            text = tokenizer.decode(completion.output_ids, skip_special_tokens=True)
        logprobs = None
        if parsed.logprobs and completion is not None:
            logprobs = _logprobs(tokenizer, parsed.chat, completion.output_ids, completion.output_logprobs)
        content = {"message": {"role": "assistant", "content": text}} if parsed.chat else {"text": text}
        choices.append(
            {"index": index, **content, "logprobs": logprobs, "finish_reason": _finish(completion, tracker)}
        )
    return {
        **_head(served, parsed.chat),
        "choices": choices,
        "usage": _usage(parsed, _completion_tokens(completions)),
    }


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _stream(state: NativeState, served: OpenAIState, parsed: _Parsed) -> AsyncIterator[str]:
    """Server-sent events of one streamed request, token by token (see the module docstring)."""
    chat, n, tokenizer = parsed.chat, parsed.params.n, state.model.tokenizer
    total = len(parsed.prompts) * n
    head = _head(served, chat, chunk=True)

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
        logprobs = _logprobs(tokenizer, chat, [token], [logprob]) if parsed.logprobs else None
        if reason is not None:
            finished.add(index)
        if not chat:
            return [chunk(index, delta, reason, logprobs)]
        out = [chunk(index, delta, None, logprobs)] if delta or logprobs else []
        return out + ([chunk(index, None, reason)] if reason is not None else [])

    async with state.lock.read():
        run = _submit(state, parsed)
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
                except RequestError as exc:
                    yield _sse(error_body(exc))
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


# ---------------------------------------------------------------------------------------------- the routes


async def _generate(request: Request, parse: Callable[[Any, ServedModel, OpenAIState], _Parsed]):
    state, served = request.app.state.native, request.app.state.openai
    body = await read_json(request, state.max_body_bytes)
    # Parsed in a worker thread: tokenizing a long prompt or rendering a long chat takes a while, and other
    # clients must not wait for it.
    parsed = await asyncio.to_thread(parse, body, state.model, served)
    if parsed.stream:
        return StreamingResponse(
            _stream(state, served, parsed),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    async with state.lock.read():
        run = _submit(state, parsed)
        completions = await _results_unless_disconnected(request, run)
    if completions is None:  # read by no one
        return JSONResponse(error_body(RequestError("the client closed the connection", status=499)), 499)
    return JSONResponse(_response(state, served, run, completions))


async def completions(request: Request):
    return await _generate(request, parse_completion)


async def chat_completions(request: Request):
    return await _generate(request, parse_chat)


def _model_card(request: Request) -> dict:
    served = request.app.state.openai
    return {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": "trustbatch",
        "root": served.root,
        "max_model_len": request.app.state.native.model.max_positions,
    }


async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(request)]}


async def get_model(request: Request, model_id: str) -> dict:
    _check_model_name(model_id, request.app.state.openai)
    return _model_card(request)


async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    if not request.url.path.startswith("/v1"):
        return native.error_response(exc)
    return JSONResponse(error_body(exc), status_code=exc.status)


async def _http_error(request: Request, exc: StarletteHTTPException):
    if not request.url.path.startswith("/v1"):
        return await http_exception_handler(request, exc)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    if exc.status_code == 404:
        message += "; the routes are POST /v1/completions, POST /v1/chat/completions, GET /v1/models"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(error_body(RequestError(message, code=code, status=exc.status_code)), exc.status_code)


def _chat_stop_ids(engine, tokenizer) -> tuple[int, ...]:
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    eos = getattr(getattr(engine.model, "generation_config", None), "eos_token_id", None)
    for token in eos if isinstance(eos, (list, tuple)) else [eos]:
        if isinstance(token, int):
            ids.add(token)
    return tuple(sorted(t for t in ids if t < engine.vocab_size))


def create_openai_app(
    engine,
    tokenizer,
    *,
    model_name: str,
    model_path: str,
    max_batch_size: int = 256,
    batch_window_ms: float = 5.0,
    aliases: tuple[str, ...] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The native app around ``engine`` (an ``EmbeddedEngine``) plus the ``/v1`` routes.

    ``model_name`` is what ``/v1/models`` lists; requests may also name any of ``aliases``. ``max_body_bytes``:
    the largest request body read, on every route (a larger one answers 413).
    """
    app = native.create_app(
        engine,
        model_path=model_path,
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        tokenizer=tokenizer,
        served_model_name=model_name,
        max_body_bytes=max_body_bytes,
    )
    app.state.openai = OpenAIState(
        name=model_name,
        root=model_path,
        chat_stop_ids=_chat_stop_ids(engine, tokenizer),
        aliases=tuple(a for a in aliases if a != model_name),
    )
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    return app
