"""The built-in CPU rollout server: the subset of SGLang 0.5.23's native HTTP API that trustbatch uses.

One SGLang client drives either this server or a real ``sglang.launch_server``; the request and response shapes
follow SGLang's own server (``sglang/srt/entrypoints/http_server.py`` and ``io_struct.py`` in 0.5.23) and
what a live 0.5.23 server was seen to answer (tests/sglang checks the client against one).
The sampling itself is ``EmbeddedEngine.generate_sync`` (see app/rollout/embedded.py for how it samples and
what logprob it reports).

Endpoints:
- ``POST|PUT /generate``: ``input_ids`` ([int] or [[int]]) or ``text`` (str or [str], needs a tokenizer),
  ``sampling_params`` (dict or one dict per prompt), ``return_logprob`` (bool or [bool]), ``rid``. Unknown
  top-level keys are ignored and unknown ``sampling_params`` keys answer 400 ``{"error": "unknown field ..."}``,
  as in SGLang. Fields SGLang accepts but this server cannot honour (``regex``, ``json_schema``, penalties, a
  finite ``top_k``, ``stop`` strings, ``ignore_eos``, ``stream``, ``logprob_start_len >= 0``,
  ``top_logprobs_num > 0``...) answer 400 naming the field, rather than being silently ignored. One prompt with
  n = 1 answers one dict; a batch or n > 1 answers a flat prompt-major list ``[p0s0, p0s1, p1s0, ...]``.
- ``GET /health``, ``GET /health_generate`` (a one-token generation), ``GET /ready``.
- ``GET /model_info`` (alias ``/get_model_info``), ``GET /server_info`` (alias ``/get_server_info``; holds the
  batching counters under ``"trustbatch"``).
- ``POST /update_weights_from_disk``, ``GET|POST /flush_cache``, ``POST /pause_generation``,
  ``POST /continue_generation``.
- ``POST /abort_request`` (SGLang's shape: ``{"rid": str, "abort_all": bool}``, an empty 200): the queued
  prompts of the request with that ``rid`` (every queued prompt with ``abort_all``) are answered at once with
  ``finish_reason {"type": "abort"}``; a running batch finishes, as with ``abort_all_requests`` below. An empty
  ``rid`` without ``abort_all``, or an ``rid`` no queued request has, is ignored, as in SGLang.

Requests (app/rollout/http_common.py, shared with ``trustbatch serve``): a body over ``max_body_bytes`` (8 MiB
unless the server is given another) answers 413 ``{"error": ...}`` as soon as its ``Content-Length``, or the
bytes received, pass the limit; anything malformed answers 400 ``{"error": ...}`` and leaves the keep-alive
connection open: bad JSON, wrong types, non-finite numbers, a temperature other than 0 below 1e-6 (it would
turn the logits into infinities), a ``sampling_seed`` outside [-2**63, 2**64 - 1], ``max_new_tokens`` outside
[1, 2**31 - 1], more than ``MAX_SEQUENCES`` sequences (prompts x n) in one request, stop ids outside the
vocabulary, text or ``rid`` with a lone surrogate. A ``text`` prompt longer than any text that fits in the
context is refused before it is tokenized; parsing a request (tokenizing its texts included) runs in a worker
thread, so a huge request never holds up the others. A client that hangs up before its body is in costs one
log line.

Batching: each prompt of each request becomes an item on one queue. A scheduler task waits for the first item,
then collects for ``batch_window_ms`` (measured from that item's arrival, so items that queued up behind a
running batch go at once) or until ``max_batch_size`` sequences, groups the items by identical sampling
parameters and runs one ``generate_sync`` per group in a worker thread; the event loop stays free. A request
with ``sampling_seed`` is never merged with another request, so it gets exactly what ``generate_sync`` gives
its own prompts with that seed.

Weight updates follow SGLang's writer-preferring reader/writer lock: every ``/generate`` holds a read lock for
its whole life, ``/update_weights_from_disk`` takes the write lock, so an update waits for the requests in
flight (they finish on the old weights) and new requests wait for the update. While generation is paused the
update runs at once, without the lock; the queued requests then run on the new weights after
``/continue_generation``. With ``abort_all_requests: true`` the queued (not yet running) requests are answered
with ``finish_reason {"type": "abort"}``; a running batch cannot be interrupted mid-step and finishes.

Choices where SGLang had no CPU equivalent:
- ``text`` in, decoded ``text`` out: supported when the server has a tokenizer (``serve`` loads the model
  dir's); without one ``text`` input answers 400 and output ``text`` is ``""`` (SGLang's skip-tokenizer-init).
- ``weight_version`` is a string, as in SGLang. Completions carry the engine's integer ``policy_version``; a
  new version that parses as an int becomes that int, any other string becomes the previous int + 1. An update
  without ``weight_version`` keeps the version (as SGLang does). ``weight_versions`` is one span
  ``{"version", "start": 0, "end": completion_tokens}``, since weights never change inside one generation here.
- ``index`` is the item's position in the flat response list; ``meta_info.id`` is the request's ``rid`` (with
  ``_k`` appended per output when a request has several) or a fresh uuid.
- ``/pause_generation`` stops scheduling and returns once the running batch (if any) has finished, in every
  mode; mode ``"abort"`` also answers the queued requests with an abort, ``"retract"``/``"in_place"`` keep
  them queued. There is no KV cache across requests, so ``/flush_cache`` always succeeds.
- ``/health_generate`` calls the engine directly (input_ids ``[0]``, one greedy token), not through the queue.

``trustbatch serve`` (app/serve.py) adds the OpenAI-compatible ``/v1`` routes to this app: they queue prompts on
the same scheduler (``app.state.scheduler``, under ``app.state.lock``), and a prompt's ``on_token`` hook sees
each token as it is sampled (streaming, stop strings, ending the samples of a client that went away).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from app.rollout import http_common as http
from app.rollout.base import Completion, SamplingParams, WeightSource
from app.rollout.embedded import EmbeddedEngine
from app.rollout.http_common import DEFAULT_MAX_BODY_BYTES, ClientGone, FieldError, describe, is_int

logger = logging.getLogger(__name__)

SERVER_VERSION = "trustbatch-local"
_TOP_K_ALL = 1 << 30  # SGLang's default top_k (1073741824) means "no top-k"
MAX_SEQUENCES = 1 << 16
"""Most sequences (prompts x n) one ``/generate`` may ask for; more is refused rather than left to hog the server."""

# SGLang 0.5.23 api_types.SamplingParams, in its order. Unknown keys are rejected; each key not in
# _SUPPORTED must keep its neutral value (checked by _NEUTRAL) or the request is refused with a clear message.
SGLANG_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark",
    "choice",
)  # fmt: skip


def _empty(value: Any) -> bool:
    return value is None or value == "" or value == [] or value == {}


# field -> (accepts its value?, what to tell the user). None means "not given".
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "stop": (_empty, "stop strings are not supported; use stop_token_ids"),
    "stop_regex": (_empty, "stop_regex is not supported; use stop_token_ids"),
    "top_k": (
        lambda v: v is None or v in (-1, 0, _TOP_K_ALL),
        "only top_k = all (-1 or 1073741824) is supported",
    ),
    "min_p": (lambda v: v is None or v == 0, "only min_p = 0 is supported"),
    "frequency_penalty": (lambda v: v is None or v == 0, "only frequency_penalty = 0 is supported"),
    "presence_penalty": (lambda v: v is None or v == 0, "only presence_penalty = 0 is supported"),
    "repetition_penalty": (lambda v: v is None or v == 1, "only repetition_penalty = 1 is supported"),
    "min_new_tokens": (lambda v: v is None or v == 0, "only min_new_tokens = 0 is supported"),
    "json_schema": (_empty, "constrained decoding (json_schema) is not supported"),
    "regex": (_empty, "constrained decoding (regex) is not supported"),
    "ebnf": (_empty, "constrained decoding (ebnf) is not supported"),
    "structural_tag": (_empty, "constrained decoding (structural_tag) is not supported"),
    "choice": (_empty, "constrained decoding (choice) is not supported"),
    "ignore_eos": (
        lambda v: v is None or v is False,
        "ignore_eos = true is not supported (EOS always stops)",
    ),
    "logit_bias": (_empty, "logit_bias is not supported"),
    "custom_params": (_empty, "custom_params is not supported (no custom logit processors)"),
    "beam_width": (lambda v: v is None or v in (0, 1), "beam search (beam_width > 1) is not supported"),
    "watermark": (_empty, "watermark is not supported"),
}
_TEXT_ONLY = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")  # bools that shape text
_IGNORED = ("stream_interval",)  # meaningful only for streaming, which is refused anyway


class RequestError(ValueError):
    """A malformed or unsupported request: answered with ``status`` (400 unless said) and this message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# ---- request parsing ---------------------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    return {dict: "map", list: "sequence", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _expect(cond: bool, where: str, value: Any, expected: str) -> None:
    if not cond:
        raise RequestError(
            f"invalid type: {_type_name(value)} {describe(value)} at {where}, expected {expected}"
        )


@dataclass(frozen=True)
class _TextOptions:
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


def parse_sampling_params(
    raw: Any, where: str = "sampling_params", *, vocab_size: int
) -> tuple[SamplingParams, _TextOptions, bool]:
    """SGLang ``sampling_params`` dict -> (engine SamplingParams, text options, seeded?); RequestError if invalid.

    The values go through the checks shared with ``trustbatch serve`` (app/rollout/http_common.py): finite
    numbers, a temperature of 0 or at least 1e-6, a seed the engine's generator takes, stop ids in the vocabulary.
    """
    if raw is None:
        raw = {}
    _expect(isinstance(raw, dict), where, raw, "a map of sampling parameters")
    for key in raw:
        if key not in SGLANG_SAMPLING_FIELDS:
            raise RequestError(
                f"unknown field `{key}` in {where}, expected one of {', '.join(SGLANG_SAMPLING_FIELDS)}"
            )
    for key, (accepts, message) in _NEUTRAL.items():
        if key in raw and not accepts(raw[key]):
            raise RequestError(f"{where}.{key} = {describe(raw[key])}: {message} by the built-in CPU server")
    get = {k: v for k, v in raw.items() if v is not None}
    kwargs: dict[str, Any] = {}
    try:
        if "max_new_tokens" in get:
            budget = get["max_new_tokens"]
            kwargs["max_new_tokens"] = http.bounded_int(
                budget, f"{where}.max_new_tokens", 1, http.MAX_NEW_TOKENS
            )
        if "temperature" in get:
            kwargs["temperature"] = http.temperature(get["temperature"], f"{where}.temperature")
        if "top_p" in get:
            kwargs["top_p"] = http.top_p(get["top_p"], f"{where}.top_p")
        if "n" in get:
            kwargs["n"] = http.bounded_int(get["n"], f"{where}.n", 1, MAX_SEQUENCES)
        if "stop_token_ids" in get:
            ids = http.token_ids(get["stop_token_ids"], f"{where}.stop_token_ids", vocab_size)
            kwargs["stop_token_ids"] = tuple(ids)
        if "sampling_seed" in get:
            kwargs["seed"] = http.seed(get["sampling_seed"], f"{where}.sampling_seed")
    except FieldError as exc:
        raise RequestError(exc.message) from None
    text = {}
    for key in _TEXT_ONLY:
        if key in get:
            _expect(isinstance(get[key], bool), f"{where}.{key}", get[key], "a boolean")
            text[key] = get[key]
    for key in _IGNORED:
        if key in get:
            _expect(is_int(get[key]), f"{where}.{key}", get[key], "an integer")
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        raise RequestError(f"{where}: {exc}") from None
    options = _TextOptions(**{k: v for k, v in text.items() if k in _TextOptions.__dataclass_fields__})
    return params, options, "seed" in kwargs


@dataclass
class _Prompt:
    """One prompt of a request, with everything needed to schedule it and to shape its answer."""

    input_ids: list[int]
    params: SamplingParams
    text_options: _TextOptions
    return_logprob: bool
    group: tuple
    rid: str | None = None
    """The request's ``rid`` for this prompt (what ``/abort_request`` names)."""
    future: asyncio.Future | None = None
    on_token: Callable[[int, int, float, str | None], bool] | None = None
    """Optional, called in the generating thread with (sample k, token id, its logprob, finish reason or None) as
    each token is sampled; True ends that sample now (finish "stop"). The ``/v1`` routes use it to stream, to stop
    at stop strings and to end the samples of a client that went away."""


@dataclass
class _GenerateRequest:
    prompts: list[_Prompt]
    single: bool  # one prompt given flat ([int] or str): answer a dict when n == 1
    rids: list[str | None]


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(
                f"{name} has {len(value)} entries but there are {count} prompts; give one per prompt"
            )
        return value
    return [value] * count


def parse_generate(
    body: Any, *, tokenizer, vocab_size: int, max_positions: int | None, max_chars: int | None = None
) -> _GenerateRequest:
    """Validate a ``/generate`` body (SGLang's GenerateRequest; unknown top-level keys ignored).

    Everything cheap is checked before any text is tokenized, and a text longer than ``max_chars`` characters
    (see ``http_common.max_prompt_chars``) is refused without tokenizing it. This may take a while for a large
    body (tokenizing): the server runs it in a worker thread.
    """
    _expect(isinstance(body, dict), "the request body", body, "a JSON object (GenerateRequest)")
    if body.get("stream"):
        raise RequestError("stream = true is not supported by the built-in CPU server; send stream = false")
    for key in ("input_embeds", "image_data", "audio_data", "video_data", "lora_path", "session_params"):
        if not _empty(body.get(key)):
            raise RequestError(f"{key} is not supported by the built-in CPU server")
    for key in ("return_hidden_states", "return_entropy", "return_routed_experts"):
        if body.get(key):
            raise RequestError(f"{key} = true is not supported by the built-in CPU server")
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise RequestError("give exactly one of input_ids ([int] or [[int]]) or text (str or [str])")
    texts: list[str] | None = None
    if has_ids:
        ids = body["input_ids"]
        _expect(isinstance(ids, list) and len(ids) > 0, "input_ids", ids, "a non-empty [int] or [[int]]")
        single = not isinstance(ids[0], list)
        prompts = [ids] if single else ids
        for i, prompt in enumerate(prompts):
            where = "input_ids" if single else f"input_ids[{i}]"
            _expect(isinstance(prompt, list) and all(is_int(t) for t in prompt), where, prompt, "[int]")
            if not prompt:
                raise RequestError(f"{where} is empty; every prompt needs at least one token")
        count = len(prompts)
    else:
        if tokenizer is None:
            raise RequestError(
                "text input needs a tokenizer and this server has none (skip-tokenizer-init); send input_ids"
            )
        text = body["text"]
        single = isinstance(text, str)
        texts = [text] if single else text
        _expect(
            isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts),
            "text",
            text,
            "str or [str]",
        )
        for i, item in enumerate(texts):
            where = "text" if single else f"text[{i}]"
            try:
                http.unicode_text(item, where)
            except FieldError as exc:
                raise RequestError(exc.message) from None
            if max_chars is not None and len(item) > max_chars:
                raise RequestError(
                    f"{where} has {len(item)} characters: more than any text that fits in the model's "
                    f"max_position_embeddings={max_positions} tokens ({max_chars} characters at most); shorten it"
                )
        count = len(texts)

    raw_params = body.get("sampling_params")
    per_params = raw_params if isinstance(raw_params, list) else None
    if per_params is not None and len(per_params) != count:
        raise RequestError(f"sampling_params has {len(per_params)} entries but there are {count} prompts")
    logprob_flags = _per_prompt(body.get("return_logprob", False), count, "return_logprob")
    for flag in logprob_flags:
        _expect(isinstance(flag, bool) or flag is None, "return_logprob", flag, "bool or [bool]")
    for key, neutral in (("logprob_start_len", -1), ("top_logprobs_num", 0)):
        for value in _per_prompt(body.get(key), count, key):
            _expect(value is None or is_int(value), key, value, "int or [int]")
            if value is not None and value != neutral and not (key == "logprob_start_len" and value < 0):
                raise RequestError(
                    f"{key} = {describe(value)} is not supported by the built-in CPU server (output logprobs only)"
                )
    if not _empty(body.get("token_ids_logprob")):
        raise RequestError("token_ids_logprob is not supported by the built-in CPU server")
    rid = body.get("rid")
    rids = _per_prompt(rid, count, "rid")
    for r in rids:
        _expect(r is None or isinstance(r, str), "rid", r, "str or [str]")
        if r is not None:
            try:
                http.unicode_text(r, "rid")  # it comes back as meta_info.id
            except FieldError as exc:
                raise RequestError(exc.message) from None

    sampling = []
    for i in range(count):
        where = f"sampling_params[{i}]" if per_params is not None else "sampling_params"
        raw = per_params[i] if per_params is not None else raw_params
        sampling.append(parse_sampling_params(raw, where, vocab_size=vocab_size))
    sequences = sum(params.n for params, _, _ in sampling)
    if sequences > MAX_SEQUENCES:
        raise RequestError(
            f"this request asks for {sequences} sequences (prompts x n); one request may ask for at most "
            f"{MAX_SEQUENCES}: split it"
        )

    if texts is not None:
        prompts = [list(tokenizer.encode(t)) for t in texts]
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise RequestError(f"text[{i}] encodes to zero tokens; every prompt needs at least one token")
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt {i} has token ids outside [0, {vocab_size}): {describe(bad[:5])}")
        if max_positions is not None and len(prompt) >= max_positions:
            raise RequestError(
                f"prompt {i} has {len(prompt)} tokens, leaving no room under the model's "
                f"max_position_embeddings={max_positions}; shorten it"
            )

    request_key = uuid.uuid4().hex
    parsed = []
    for i, (prompt, (params, options, seeded)) in enumerate(zip(prompts, sampling, strict=True)):
        # A seeded request runs alone so it reproduces generate_sync(its prompts, params) exactly.
        group = (params, request_key) if seeded else (params,)
        parsed.append(
            _Prompt([int(t) for t in prompt], params, options, bool(logprob_flags[i]), group, rid=rids[i])
        )
    return _GenerateRequest(parsed, single, rids)


# ---- concurrency -------------------------------------------------------------------------------------------


class _ReaderWriterLock:
    """Writer-preferring asyncio RW lock (SGLang's ``model_update_lock``): new readers queue behind a writer."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writers_waiting = 0
        self._writing = False

    @contextlib.asynccontextmanager
    async def read(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def write(self):
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._cond.notify_all()


@dataclass
class _Stats:
    generate_calls: int = 0
    """``generate_sync`` calls (one batched generation each)."""
    requests: int = 0
    sequences: int = 0
    largest_batch: int = 0


@dataclass
class _Scheduler:
    """Collects queued prompts into batches and runs them on the engine in a worker thread."""

    engine: EmbeddedEngine
    max_batch_size: int
    batch_window_s: float
    queue: deque = field(default_factory=deque)  # (arrival time, _Prompt)
    stats: _Stats = field(default_factory=_Stats)
    paused: bool = False

    def __post_init__(self) -> None:
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        # Generation has a thread of its own: requests being parsed (tokenized) in the default pool never
        # keep a batch waiting for a free worker.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-generate")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="rollout-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=False)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def submit(self, prompt: _Prompt) -> None:
        prompt.future = asyncio.get_running_loop().create_future()
        self.queue.append((time.monotonic(), prompt))
        self._wakeup.set()

    def enqueue(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        on_token: Callable[[int, int, float, str | None], bool] | None = None,
        request_key: str | None = None,
    ) -> asyncio.Future:
        """Queue one prompt for ``params.n`` samples (the ``/v1`` routes' entry point).

        The future gets the prompt's completions, or None when it was aborted before it ran; cancelling it
        before it runs drops the prompt. Prompts with a ``request_key`` run only with prompts of that key (a
        seeded request, so it reproduces ``generate_sync`` with its seed). ``on_token``: see ``_Prompt``.
        """
        group = (params,) if request_key is None else (params, request_key)
        prompt = _Prompt(list(input_ids), params, _TextOptions(), False, group, on_token=on_token)
        self.submit(prompt)
        return prompt.future

    def abort_queued(self, rid: str | None = None) -> int:
        """Answer the queued (not yet running) prompts with an abort, all of them or those of request ``rid``;
        returns how many."""
        count, kept = 0, deque()
        while self.queue:
            arrival, prompt = self.queue.popleft()
            if rid is not None and prompt.rid != rid:
                kept.append((arrival, prompt))
            elif not prompt.future.done():
                prompt.future.set_result(None)  # None = aborted
                count += 1
        self.queue.extend(kept)
        return count

    async def pause(self) -> None:
        self.paused = True
        await self._idle.wait()  # the running batch (if any) finishes first

    def resume(self) -> None:
        self.paused = False
        self._wakeup.set()

    async def _run(self) -> None:
        while True:
            while not self.queue or self.paused:
                self._wakeup.clear()
                await self._wakeup.wait()
            deadline = self.queue[0][0] + self.batch_window_s
            while self._queued_sequences() < self.max_batch_size and not self.paused:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
            if self.paused or not self.queue:
                continue
            batch = self._take()
            self._idle.clear()
            try:
                await self._execute(batch)
            finally:
                self._idle.set()

    def _queued_sequences(self) -> int:
        return sum(prompt.params.n for _, prompt in self.queue)

    def _take(self) -> list[_Prompt]:
        batch, sequences = [], 0
        while self.queue and (not batch or sequences + self.queue[0][1].params.n <= self.max_batch_size):
            _, prompt = self.queue.popleft()
            if not prompt.future.done():
                batch.append(prompt)
                sequences += prompt.params.n
        return batch

    async def _execute(self, batch: list[_Prompt]) -> None:
        groups: dict[tuple, list[_Prompt]] = {}
        for prompt in batch:
            groups.setdefault(prompt.group, []).append(prompt)
        for group in groups.values():
            params = group[0].params
            on_step = _token_hooks(group, params.n)
            try:
                completions = await asyncio.get_running_loop().run_in_executor(
                    self._executor,
                    functools.partial(
                        self.engine.generate_sync, [p.input_ids for p in group], params, on_step=on_step
                    ),
                )
            except Exception as exc:  # noqa: BLE001 - reported to the requests of this group, never kills the loop
                logger.exception("generation failed")
                for prompt in group:
                    if not prompt.future.done():
                        prompt.future.set_exception(exc)
                continue
            self.stats.generate_calls += 1
            self.stats.sequences += len(completions)
            self.stats.largest_batch = max(self.stats.largest_batch, len(completions))
            n = params.n
            for k, prompt in enumerate(group):
                if not prompt.future.done():
                    prompt.future.set_result(completions[k * n : (k + 1) * n])


def _token_hooks(group: list[_Prompt], n: int):
    """One ``on_step`` callback forwarding each sampled token to its prompt's ``on_token``; None if none has one.

    A hook that raises ends its own sample (logged) instead of failing the whole batch.
    """
    if all(prompt.on_token is None for prompt in group):
        return None

    def on_step(
        seqs: list[int], tokens: list[int], logprobs: list[float], finished: list[str | None]
    ) -> list[int]:
        halted = []
        for seq, token, logprob, reason in zip(seqs, tokens, logprobs, finished, strict=True):
            prompt, k = group[seq // n], seq % n
            if prompt.on_token is None:
                continue
            try:
                if prompt.on_token(k, token, logprob, reason):
                    halted.append(seq)
            except Exception:  # noqa: BLE001 - one request's hook must not break the batch
                logger.exception("token hook failed; ending that sample")
                halted.append(seq)
        return halted

    return on_step


# ---- the app -----------------------------------------------------------------------------------------------


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": http.printable(message)}, status_code=status)


async def _json_body(request: Request, *, allow_empty: bool = False) -> Any:
    """The request body as JSON, at most ``app.state.max_body_bytes`` of it; RequestError (400/413) if not."""
    try:
        return await http.read_json(request, request.app.state.max_body_bytes, allow_empty=allow_empty)
    except http.BodyError as exc:
        raise RequestError(exc.message, exc.status) from None


def create_app(
    engine: EmbeddedEngine,
    *,
    model_path: str,
    weight_version: str = "0",
    max_batch_size: int = 256,
    batch_window_ms: float = 5.0,
    tokenizer=None,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """An SGLang-API FastAPI app around ``engine`` (see the module docstring for the endpoints and choices).

    Args:
        engine: the sampling core; the app owns it from now on (weight updates go through the app).
        model_path: reported by ``/model_info`` (and replaced by each ``/update_weights_from_disk``).
        weight_version: the string version of the engine's current weights.
        max_batch_size: most sequences (prompts x n) the scheduler puts into one batch.
        batch_window_ms: how long the scheduler waits after a first request for others to join its batch.
        tokenizer: enables ``text`` input and decoded ``text`` output; without it output ``text`` is ``""``.
        max_body_bytes: largest request body read; a larger one answers 413 (see app/rollout/http_common.py).
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if batch_window_ms < 0:
        raise ValueError(f"batch_window_ms must be >= 0, got {batch_window_ms}")
    if not is_int(max_body_bytes) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an integer >= 1, got {max_body_bytes!r}")
    max_chars = None
    if tokenizer is not None:
        # Encode once before any request: a fast tokenizer may switch off its stored padding/truncation on the
        # first call (a mutation), which must not race with requests tokenized in worker threads or with the
        # decoding done in the generating thread.
        tokenizer("warm-up", add_special_tokens=False)
        max_chars = http.max_prompt_chars(tokenizer, engine.max_positions)
    state = {
        "model_path": str(model_path),
        "served_model_name": served_model_name or str(model_path),
        "tokenizer_path": str(model_path),
        "labels": {engine.policy_version: str(weight_version)},  # engine int version -> SGLang string
        "weight_version": str(weight_version),
        "startup_time": time.time(),
    }
    scheduler: _Scheduler | None = None
    lock: _ReaderWriterLock | None = None

    @contextlib.asynccontextmanager
    async def lifespan(server: FastAPI):
        nonlocal scheduler, lock
        scheduler = _Scheduler(engine, max_batch_size, batch_window_ms / 1000.0)
        lock = _ReaderWriterLock()
        server.state.scheduler, server.state.lock = scheduler, lock  # for the /v1 routes of app/serve.py
        scheduler.start()
        yield
        await scheduler.stop()

    app = FastAPI(title="trustbatch CPU rollout server (SGLang native API subset)", lifespan=lifespan)
    app.state.max_body_bytes = max_body_bytes
    app.state.max_prompt_chars = max_chars
    app.add_exception_handler(ClientGone, http.client_gone)

    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, exc: RequestError) -> JSONResponse:
        return _error(str(exc), exc.status)

    def label(version: int) -> str:
        return state["labels"].get(version, str(version))

    def decode(ids: list[int], options: _TextOptions) -> str:
        if tokenizer is None:
            return ""
        return tokenizer.decode(
            ids,
            skip_special_tokens=options.skip_special_tokens,
            spaces_between_special_tokens=options.spaces_between_special_tokens,
        )

    def output(prompt: _Prompt, completion: Completion | None, rid: str, start: float) -> dict:
        if completion is None:  # aborted before it ran
            ids: list[int] = []
            logprobs: list[float] = []
            finish: dict = {
                "type": "abort",
                "message": "Abort before prefill",
                "status_code": 200,
                "err_type": None,
            }
            version = state["weight_version"]
        else:
            ids, logprobs = completion.output_ids, completion.output_logprobs
            if completion.finish_reason == "stop":
                finish = {"type": "stop", "matched": ids[-1]}
            else:
                finish = {"type": "length", "length": len(ids)}
            version = label(completion.policy_version)
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(prompt.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": version,
            "weight_versions": [{"version": version, "start": 0, "end": len(ids)}],
            "e2e_latency": time.perf_counter() - start,
        }
        if prompt.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)]
            meta["output_token_logprobs_length"] = len(ids)
        return {"text": decode(ids, prompt.text_options), "output_ids": list(ids), "meta_info": meta}

    async def generate(request: Request) -> JSONResponse:
        start = time.perf_counter()
        body = await _json_body(request)
        # In a worker thread: tokenizing a long text takes a while, and other clients must not wait for it.
        parsed = await asyncio.to_thread(
            parse_generate,
            body,
            tokenizer=tokenizer,
            vocab_size=engine.vocab_size,
            max_positions=engine.max_positions,
            max_chars=max_chars,
        )
        async with lock.read():
            scheduler.stats.requests += 1
            for prompt in parsed.prompts:
                scheduler.submit(prompt)
            try:
                results = await asyncio.gather(*(p.future for p in parsed.prompts))
            except Exception as exc:  # noqa: BLE001
                return _error(f"generation failed: {type(exc).__name__}: {exc}", 500)
        items = []
        for prompt, completions, rid in zip(parsed.prompts, results, parsed.rids, strict=True):
            completions = completions if completions is not None else [None] * prompt.params.n
            for k, completion in enumerate(completions):
                item_rid = uuid.uuid4().hex if rid is None else (f"{rid}_{k}" if prompt.params.n > 1 else rid)
                items.append(output(prompt, completion, item_rid, start))
        if parsed.single and parsed.prompts[0].params.n == 1:  # SGLang: a list for a batch or for n > 1
            return JSONResponse(items[0])
        for index, item in enumerate(items):
            item["index"] = index
        return JSONResponse(items)

    app.add_api_route("/generate", generate, methods=["POST", "PUT"])

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = scheduler is not None and scheduler.alive
        return JSONResponse({} if ok else {"error": "scheduler not running"}, status_code=200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        try:
            await asyncio.wait_for(
                asyncio.to_thread(
                    engine.generate_sync, [[0]], SamplingParams(max_new_tokens=1, temperature=0.0)
                ),
                timeout=20,
            )
        except Exception as exc:  # noqa: BLE001
            return _error(f"health generation failed: {type(exc).__name__}: {exc}", 503)
        return JSONResponse({})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return await health()

    def model_info() -> dict:
        config = engine.model.config
        return {
            "model_path": state["model_path"],
            "tokenizer_path": state["tokenizer_path"],
            "served_model_name": state["served_model_name"],
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state["weight_version"],
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    app.add_api_route("/model_info", model_info, methods=["GET"])
    app.add_api_route("/get_model_info", model_info, methods=["GET"])

    def server_info() -> dict:
        stats = scheduler.stats if scheduler is not None else _Stats()
        return {
            "model_path": state["model_path"],
            "served_model_name": state["served_model_name"],
            "max_batch_size": max_batch_size,
            "batch_window_ms": batch_window_ms,
            "max_body_bytes": max_body_bytes,
            "skip_tokenizer_init": tokenizer is None,
            "device": str(next(engine.model.parameters()).device),
            "startup_time": state["startup_time"],
            "version": SERVER_VERSION,
            "frontend": "python",
            "trustbatch": {
                "generate_calls": stats.generate_calls,
                "requests": stats.requests,
                "sequences": stats.sequences,
                "largest_batch": stats.largest_batch,
                "queued": len(scheduler.queue) if scheduler is not None else 0,
                "paused": bool(scheduler and scheduler.paused),
            },
        }

    app.add_api_route("/server_info", server_info, methods=["GET"])
    app.add_api_route("/get_server_info", server_info, methods=["GET"])

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        def fail(message: str, status: int = 400) -> JSONResponse:
            return JSONResponse(
                {"success": False, "message": http.printable(message), "num_paused_requests": 0},
                status_code=status,
            )

        try:
            body = await _json_body(request)
        except RequestError as exc:
            return fail(str(exc), exc.status)
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("model_path"), str)
            or not body["model_path"]
        ):
            return fail("the body needs model_path (str): an HF directory with *.safetensors weights")
        version = body.get("weight_version")
        if version is not None and (not isinstance(version, (str, int)) or isinstance(version, bool)):
            return fail(f"weight_version must be a string, got {describe(version)}")
        try:  # both come back in /model_info and in every response
            http.unicode_text(body["model_path"], "model_path")
            if isinstance(version, str):
                http.unicode_text(version, "weight_version")
        except FieldError as exc:
            return fail(exc.message)
        if body.get("load_format") not in (None, "auto", "safetensors"):
            return fail(f"load_format {body['load_format']!r} is not supported; use 'auto' (safetensors)")
        path = Path(body["model_path"])
        if not path.is_dir():
            return fail(f"model_path {str(path)!r} is not a directory")

        async def apply() -> JSONResponse:
            new_int = engine.policy_version
            if version is not None:
                text = str(version)
                new_int = int(text) if text.lstrip("-").isdigit() else engine.policy_version + 1
            try:
                await asyncio.to_thread(engine.update_weights_sync, WeightSource(path=path), new_int)
            except (ValueError, OSError) as exc:
                return fail(f"Failed to update weights: {exc}")
            if version is not None:
                state["labels"][new_int] = str(version)
                state["weight_version"] = str(version)
            state["model_path"] = state["served_model_name"] = str(path)
            return JSONResponse(
                {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
            )

        if body.get("abort_all_requests"):
            scheduler.abort_queued()
        if scheduler.paused:  # as SGLang: a paused engine updates at once, without the lock
            return await apply()
        async with lock.write():
            return await apply()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        return PlainTextResponse("Cache flushed.\nThe built-in CPU server keeps no cache across requests.\n")

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        body = await _json_body(request, allow_empty=True)
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode not in ("abort", "retract", "in_place"):
            return _error(f"mode must be one of 'abort', 'retract', 'in_place', got {describe(mode)}")
        if mode == "abort":
            scheduler.abort_queued()
        await scheduler.pause()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        await _json_body(request, allow_empty=True)
        scheduler.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json_body(request, allow_empty=True)
        _expect(
            isinstance(body, dict), "the request body", body, 'a JSON object {"rid": str, "abort_all": bool}'
        )
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        _expect(rid is None or isinstance(rid, str), "rid", rid, "a string")
        _expect(isinstance(abort_all, bool), "abort_all", abort_all, "a boolean")
        if abort_all:
            scheduler.abort_queued()
        elif rid:  # as SGLang: an empty rid without abort_all is ignored, and so is an rid no request has
            scheduler.abort_queued(rid)
        return Response(status_code=200)  # SGLang answers an empty 200

    return app


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    max_batch_size: int = 256,
    batch_window_ms: float = 5.0,
    weight_version: str = "0",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> None:
    """Load ``model_dir`` (HF format) into an EmbeddedEngine and serve it until interrupted."""
    import uvicorn
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"--model {str(model_dir)!r} is not a directory; give an HF model directory")
    engine = EmbeddedEngine.from_pretrained(model_dir, max_batch_size=max_batch_size)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        logger.warning("%s: no loadable tokenizer; text input is refused and output text is empty", model_dir)
        tokenizer = None
    app = create_app(
        engine,
        model_path=str(model_dir),
        weight_version=weight_version,
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        tokenizer=tokenizer,
        max_body_bytes=max_body_bytes,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning")
