"""The OpenAI-compatible ``/v1`` API of the built-in server (``trustbatch serve`` with the built-in engine).

The app is the native one (app/serving/native.py: its routes stay, ``GET /health`` included) plus
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /v1/models/{id}``.
Requests from all clients join the same batching scheduler as ``/generate``; the model answers to its served
name and to any of its aliases (the reference as typed).

What the two routes honour, and how a body is checked, is in app/serving/openai_requests.py (everything else
answers 400 naming the field, never silently ignored). This module answers the checked request:
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
(type ``server_error``); openai_requests.py says which 400s and 404s the checks give.

Code layout: the request side moved to app/serving/openai_requests.py (``OpenAIState`` on ``app.state.openai``,
the checks, ``parse_completion`` / ``parse_chat`` giving a ``_Parsed``, ``error_body``). Here: ``_TextTracker``
(one sample's decoded text), the response shapes, a request in flight (``_Run``), the event stream, and
module-level handlers over the native state and ``OpenAIState``; one ``RequestError`` handler renders errors in
OpenAI's shape for ``/v1`` paths and in the native shape elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.rollout.base import Completion
from app.sampling import RequestError
from app.serving import native
from app.serving.native import NativeState
from app.serving.openai_requests import (
    OpenAIState,
    _chat_stop_ids,
    _check_model_name,
    _Parsed,
    error_body,
    parse_chat,
    parse_completion,
)
from app.serving.requests import DEFAULT_MAX_BODY_BYTES, ServedModel, read_json
from tools.formats import hermes_calls
from tools.types import ToolCall

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
        finish = _finish(completion, tracker)
        if not parsed.chat:
            content = {"text": text}
        elif parsed.tools:
            message, called = _tool_message(tokenizer, completion, text)
            content, finish = {"message": message}, "tool_calls" if called else finish
        else:
            content = {"message": {"role": "assistant", "content": text}}
        choices.append({"index": index, **content, "logprobs": logprobs, "finish_reason": finish})
    return {
        **_head(served, parsed.chat),
        "choices": choices,
        "usage": _usage(parsed, _completion_tokens(completions)),
    }


def _tool_message(tokenizer, completion: Completion | None, text: str) -> tuple[dict, bool]:
    """The assistant message of a reply to a request with tools: its Hermes-style ``<tool_call>`` blocks as OpenAI
    ``tool_calls`` (read from the text with special tokens kept, where some templates' call markers live), the
    rest as ``content``; a block whose JSON does not parse stays in the content. Nothing is executed here."""
    raw = tokenizer.decode(completion.output_ids, skip_special_tokens=False) if completion is not None else text
    rest, calls = hermes_calls(raw)
    good = [call for call in calls if isinstance(call, ToolCall)]
    if not good:
        return {"role": "assistant", "content": text}, False
    content = tokenizer.decode(tokenizer.encode(rest, add_special_tokens=False), skip_special_tokens=True).strip()
    tool_calls = [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
        for call in good
    ]  # fmt: skip
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, True


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
