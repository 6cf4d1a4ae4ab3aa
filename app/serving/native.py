"""SGLang's native HTTP API on the built-in server: the subset of SGLang 0.5.23 that trustbatch uses.

One SGLang client (app/rollout/sglang.py) drives either this server (``trustbatch rollout-server``) or a real
``sglang.launch_server``; the request and response shapes follow SGLang's own server
(``sglang/srt/entrypoints/http_server.py`` and ``io_struct.py`` in 0.5.23) and what a live 0.5.23 server was seen
to answer (tests/sglang checks the client against one). The sampling is ``EmbeddedEngine.generate_sync``
through the batching scheduler (app/serving/scheduler.py).

Endpoints:
- ``POST|PUT /generate``: ``input_ids`` ([int] or [[int]]) or ``text`` (str or [str], needs a tokenizer),
  ``sampling_params`` (dict or one dict per prompt), ``return_logprob`` (bool or [bool]), ``rid``,
  ``logprob_start_len`` (with ``return_logprob``, ``>= 0`` adds ``meta_info.input_token_logprobs``, one
  ``[logprob, id, null]`` per prompt token from that position on, ``null`` for the first token). Unknown
  top-level keys are ignored and unknown ``sampling_params`` keys answer 400 ``{"error": "unknown field ..."}``,
  as in SGLang. Fields SGLang accepts but this server cannot honour (``regex``, ``json_schema``, penalties, a
  finite ``top_k``, ``stop`` strings, ``ignore_eos``, ``stream``,
  ``top_logprobs_num > 0``...) answer 400 naming the field, rather than being silently ignored. One prompt with
  n = 1 answers one dict; a batch or n > 1 answers a flat prompt-major list ``[p0s0, p0s1, p1s0, ...]``.
- ``GET /health``, ``GET /health_generate`` (a one-token generation, straight on the engine), ``GET /ready``.
- ``GET /model_info`` (alias ``/get_model_info``), ``GET /server_info`` (alias ``/get_server_info``; holds the
  batching counters under ``"trustbatch"``).
- ``POST /update_weights_from_disk``, ``GET|POST /flush_cache``, ``POST /pause_generation``,
  ``POST /continue_generation``.
- The distributed weight update (gloo): ``POST /init_weights_update_group``, ``/begin_weight_update``,
  ``/update_weights_from_distributed``, ``/end_weight_update``, ``/destroy_weights_update_group``
  (app/serving/weight_updates.py).
- ``POST /abort_request`` (``{"rid": str, "abort_all": bool}``, an empty 200): the queued prompts of that
  ``rid`` (every queued prompt with ``abort_all``) are answered at once with ``finish_reason {"type":
  "abort"}``; a running batch finishes. An empty ``rid`` without ``abort_all``, or an ``rid`` no queued request
  has, is ignored, as in SGLang.

Requests are checked by the same code as on the ``/v1`` API (app/sampling.py, app/serving/requests.py; the
sequence limit is ``MAX_SEQUENCES`` here, higher than ``/v1``'s, for rollout batches): 413 for a body over
``max_body_bytes``, 400 ``{"error": ...}`` naming the field for anything malformed (the keep-alive connection
stays open), more than ``MAX_SEQUENCES`` sequences (prompts x n) included.

Code layout: each endpoint is a module-level handler that reads the one ``NativeState`` on ``app.state.native``
(engine, tokenizer, scheduler, lock, version label); ``ROUTES`` lists them and ``create_app`` only builds the
state and mounts the table. app/serving/openai.py adds its routes and state to the same app.

Weight updates take the state's write lock (every ``/generate`` holds a read lock; ``/health_generate`` does
not, and runs beside them), so an update waits for
the requests in flight, which finish on the old weights. While generation is paused the update runs at once,
without the lock; the queued requests then run on the new weights after ``/continue_generation``. With
``abort_all_requests: true`` the queued requests are answered with an abort first.

Choices where SGLang had no CPU equivalent:
- ``text`` in, decoded ``text`` out need a tokenizer; without one ``text`` input answers 400 and output
  ``text`` is ``""`` (SGLang's skip-tokenizer-init).
- ``weight_version`` is a string, as in SGLang. Completions carry the engine's integer ``policy_version``; a
  new version that parses as an int becomes that int, any other string becomes the previous int + 1. An update
  without ``weight_version`` keeps the version. ``weight_versions`` is one span ``{"version", "start": 0,
  "end": completion_tokens}``, since weights never change inside one generation here.
- ``index`` is the item's position in the flat response list; ``meta_info.id`` is the request's ``rid`` (with
  ``_k`` appended per output when a request has several) or a fresh uuid.
- ``/pause_generation`` returns once the running batch has finished, in every mode; mode ``"abort"`` also
  answers the queued requests with an abort, ``"retract"``/``"in_place"`` keep them queued. There is no KV
  cache across requests, so ``/flush_cache`` always succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from app.rollout.base import Completion, SamplingParams, WeightSource
from app.sampling import RequestError, check_sampling, check_supported, describe, empty, is_int, unicode_text
from app.serving.requests import (
    DEFAULT_MAX_BODY_BYTES,
    ClientGone,
    ServedModel,
    client_gone,
    printable,
    read_json,
)
from app.serving.scheduler import ReaderWriterLock, Scheduler, Stats
from app.serving.weight_updates import WEIGHT_UPDATE_ROUTES, weight_version_of

SERVER_VERSION = "trustbatch-local"
MAX_SEQUENCES = 1 << 16
"""Most sequences (prompts x n) one ``/generate`` may ask for; more is refused rather than left to hog the server."""

# SGLang 0.5.23 api_types.SamplingParams, in its order. Unknown keys are rejected; the engine's own fields
# (SAMPLING) are checked by app/sampling.py, the rest must keep their neutral value (app.sampling.UNSUPPORTED).
SGLANG_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark",
    "choice",
)  # fmt: skip
SAMPLING = {k: k for k in ("max_new_tokens", "temperature", "top_p", "n", "stop_token_ids")} | {
    "sampling_seed": "seed"
}
"""SGLang's name -> the engine's (SamplingParams) name."""
_TEXT_ONLY = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")  # bools that shape text
_STOP_STRINGS = ("stop", "stop_regex")  # refused here (the /v1 API has stop strings)


def _type_name(value: Any) -> str:
    return {dict: "map", list: "sequence", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _expect(cond: bool, where: str, value: Any, expected: str) -> None:
    if not cond:
        raise RequestError(
            f"invalid type: {_type_name(value)} {describe(value)} at {where}, expected {expected}"
        )


def error_response(exc: RequestError) -> JSONResponse:
    return JSONResponse({"error": printable(exc.message)}, status_code=exc.status)


# ---------------------------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class _TextOptions:
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


@dataclass
class _Prompt:
    input_ids: list[int]
    params: SamplingParams
    text_options: _TextOptions
    return_logprob: bool
    seeded: bool
    rid: str | None
    logprob_start_len: int = -1
    """With ``return_logprob``: input-token logprobs from this prompt position on (-1: none, SGLang's default)."""


def parse_sampling_params(
    raw: Any, where: str = "sampling_params", *, vocab_size: int
) -> tuple[SamplingParams, _TextOptions, bool]:
    """SGLang ``sampling_params`` -> (engine SamplingParams, text options, seeded?); RequestError if invalid."""
    raw = {} if raw is None else raw
    _expect(isinstance(raw, dict), where, raw, "a map of sampling parameters")
    for key in raw:
        if key not in SGLANG_SAMPLING_FIELDS:
            raise RequestError(
                f"unknown field `{key}` in {where}, expected one of {', '.join(SGLANG_SAMPLING_FIELDS)}"
            )
    for key in _STOP_STRINGS:
        if not empty(raw.get(key)):
            raise RequestError(f"{where}.{key} = {describe(raw[key])}: stop strings are not supported by the "
                               "built-in server's native API; use stop_token_ids (or the /v1 API)")  # fmt: skip
    check_supported(raw, prefix=f"{where}.")
    kwargs = check_sampling(
        {ours: (f"{where}.{theirs}", raw.get(theirs)) for theirs, ours in SAMPLING.items()},
        vocab_size=vocab_size,
        max_n=MAX_SEQUENCES,
    )
    text = {}
    for key in _TEXT_ONLY:
        if raw.get(key) is not None:
            _expect(isinstance(raw[key], bool), f"{where}.{key}", raw[key], "a boolean")
            text[key] = raw[key]
    if raw.get("stream_interval") is not None:  # meaningful only for streaming, which is refused anyway
        _expect(
            is_int(raw["stream_interval"]), f"{where}.stream_interval", raw["stream_interval"], "an integer"
        )
    options = _TextOptions(**{k: v for k, v in text.items() if k in _TextOptions.__dataclass_fields__})
    return SamplingParams(**kwargs), options, "seed" in kwargs


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(
                f"{name} has {len(value)} entries but there are {count} prompts; give one per prompt"
            )
        return value
    return [value] * count


def parse_generate(body: Any, model: ServedModel) -> tuple[list[_Prompt], bool]:
    """Validate a ``/generate`` body (SGLang's GenerateRequest; unknown top-level keys ignored) into its prompts
    and whether one prompt was given flat ([int] or str). Everything cheap is checked before any text is
    tokenized; this may take a while for a large body, so the server runs it in a worker thread."""
    _expect(isinstance(body, dict), "the request body", body, "a JSON object (GenerateRequest)")
    if body.get("stream"):
        raise RequestError("stream = true is not supported by the built-in CPU server; send stream = false")
    for key in ("input_embeds", "image_data", "audio_data", "video_data", "lora_path", "session_params"):
        if not empty(body.get(key)):
            raise RequestError(f"{key} is not supported by the built-in CPU server")
    for key in ("return_hidden_states", "return_entropy", "return_routed_experts"):
        if body.get(key):
            raise RequestError(f"{key} = true is not supported by the built-in CPU server")
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise RequestError("give exactly one of input_ids ([int] or [[int]]) or text (str or [str])")
    if has_ids:
        ids = body["input_ids"]
        _expect(isinstance(ids, list) and len(ids) > 0, "input_ids", ids, "a non-empty [int] or [[int]]")
        single = not isinstance(ids[0], list)
        raw = [ids] if single else ids
        wheres = ["input_ids"] if single else [f"input_ids[{i}]" for i in range(len(raw))]
        for where, prompt in zip(wheres, raw, strict=True):
            _expect(isinstance(prompt, list) and all(is_int(t) for t in prompt), where, prompt, "[int]")
            if not prompt:
                raise RequestError(f"{where} is empty; every prompt needs at least one token")
    else:
        if model.tokenizer is None:
            raise RequestError(
                "text input needs a tokenizer and this server has none (skip-tokenizer-init); send input_ids"
            )
        text = body["text"]
        single = isinstance(text, str)
        raw = [text] if single else text
        _expect(
            isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw),
            "text",
            text,
            "str or [str]",
        )
        wheres = ["text"] if single else [f"text[{i}]" for i in range(len(raw))]
        for where, item in zip(wheres, raw, strict=True):
            model.check_text(item, where, "text")
    count = len(raw)

    raw_params = body.get("sampling_params")
    per_params = raw_params if isinstance(raw_params, list) else None
    if per_params is not None and len(per_params) != count:
        raise RequestError(f"sampling_params has {len(per_params)} entries but there are {count} prompts")
    logprob_flags = _per_prompt(body.get("return_logprob", False), count, "return_logprob")
    for flag in logprob_flags:
        _expect(isinstance(flag, bool) or flag is None, "return_logprob", flag, "bool or [bool]")
    starts = _per_prompt(body.get("logprob_start_len"), count, "logprob_start_len")
    for value in starts:
        _expect(value is None or is_int(value), "logprob_start_len", value, "int or [int]")
    for value in _per_prompt(body.get("top_logprobs_num"), count, "top_logprobs_num"):
        _expect(value is None or is_int(value), "top_logprobs_num", value, "int or [int]")
        if value not in (None, 0):
            raise RequestError(
                f"top_logprobs_num = {describe(value)} is not supported by the built-in CPU server (sampled tokens' "
                "logprobs only)"
            )
    if not empty(body.get("token_ids_logprob")):
        raise RequestError("token_ids_logprob is not supported by the built-in CPU server")
    rids = _per_prompt(body.get("rid"), count, "rid")
    for rid in rids:
        _expect(rid is None or isinstance(rid, str), "rid", rid, "str or [str]")
        if rid is not None:
            unicode_text(rid, "rid")  # it comes back as meta_info.id
    sampling = [
        parse_sampling_params(
            per_params[i] if per_params is not None else raw_params,
            f"sampling_params[{i}]" if per_params is not None else "sampling_params",
            vocab_size=model.vocab_size,
        )
        for i in range(count)
    ]
    sequences = sum(params.n for params, _, _ in sampling)
    if sequences > MAX_SEQUENCES:
        raise RequestError(
            f"this request asks for {sequences} sequences (prompts x n); one request may ask for at most "
            f"{MAX_SEQUENCES}: split it"
        )
    if has_text:
        raw = [
            model.encode(t, where, "text", special_tokens=True) for t, where in zip(raw, wheres, strict=True)
        ]
    prompts = [model.check_ids(ids, where, "input_ids") for ids, where in zip(raw, wheres, strict=True)]
    for ids, start, where in zip(prompts, starts, wheres, strict=True):
        if start is not None and start >= len(ids):
            raise RequestError(
                f"logprob_start_len = {start} is not below the length of {where} ({len(ids)} tokens); give -1 "
                "(output logprobs only) or a position inside the prompt"
            )
    starts = [
        start if flag and start is not None and start >= 0 else -1
        for start, flag in zip(starts, logprob_flags, strict=True)
    ]
    return [
        _Prompt(ids, params, options, bool(flag), seeded, rid, start)
        for ids, (params, options, seeded), flag, rid, start in zip(
            prompts, sampling, logprob_flags, rids, starts, strict=True
        )
    ], single


# ---------------------------------------------------------------------------------------------- the state


@dataclass
class NativeState:
    """What the routes share (``app.state.native``); the scheduler and its lock exist while the app runs."""

    model: ServedModel
    model_path: str
    served_model_name: str
    weight_version: str
    max_batch_size: int
    batch_window_ms: float
    max_body_bytes: int
    labels: dict[int, str] = field(default_factory=dict)
    """The engine's int policy versions -> SGLang's string weight versions."""
    tokenizer_path: str = ""
    startup_time: float = field(default_factory=time.time)
    scheduler: Scheduler | None = None
    lock: ReaderWriterLock | None = None
    weight_groups: dict[str, Any] = field(default_factory=dict)
    """Weight-update process groups joined by name (app/serving/weight_updates.py)."""
    update_session: bool = False
    """Between /begin_weight_update and /end_weight_update."""

    def label(self, version: int) -> str:
        return self.labels.get(version, str(version))

    async def load_weights(self, source: WeightSource, version: str | int | None, *, complete: bool = True) -> None:
        """Load new weights as SGLang does: under the write lock, so requests in flight finish on the old weights
        (at once while generation is paused); ``version`` labels them (None keeps the label). ``complete=False``
        accepts part of the model (one bucket of a distributed update). Raises ValueError or OSError, leaving the
        old weights in place."""
        engine = self.model.engine
        new_int = engine.policy_version
        if version is not None:
            text = str(version)
            new_int = int(text) if text.lstrip("-").isdigit() else engine.policy_version + 1
        async with contextlib.nullcontext() if self.scheduler.paused else self.lock.write():
            await asyncio.to_thread(engine.update_weights_sync, source, new_int, complete=complete)
            if version is not None:
                self.labels[new_int] = self.weight_version = str(version)


def _state(request: Request) -> NativeState:
    return request.app.state.native


async def _body(request: Request, *, allow_empty: bool = False) -> Any:
    return await read_json(request, _state(request).max_body_bytes, allow_empty=allow_empty)


def _decode(state: NativeState, ids: list[int], options: _TextOptions) -> str:
    if state.model.tokenizer is None:
        return ""
    return state.model.tokenizer.decode(
        ids,
        skip_special_tokens=options.skip_special_tokens,
        spaces_between_special_tokens=options.spaces_between_special_tokens,
    )


def _output(
    state: NativeState,
    prompt: _Prompt,
    completion: Completion | None,
    rid: str,
    start: float,
    input_logprobs: list[float] | None = None,
) -> dict:
    if completion is None:  # aborted before it ran
        ids: list[int] = []
        logprobs: list[float] = []
        finish: dict = {
            "type": "abort",
            "message": "Abort before prefill",
            "status_code": 200,
            "err_type": None,
        }
        version = state.weight_version
    else:
        ids, logprobs = completion.output_ids, completion.output_logprobs
        if completion.finish_reason == "stop":
            finish = {"type": "stop", "matched": ids[-1]}
        else:
            finish = {"type": "length", "length": len(ids)}
        version = state.label(completion.policy_version)
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
    if input_logprobs is not None:  # SGLang: one [logprob, id, text] per prompt token from logprob_start_len on;
        scored = [None, *input_logprobs]  # the first token of the prompt has none
        first = prompt.logprob_start_len
        meta["input_token_logprobs"] = [[scored[t], prompt.input_ids[t], None] for t in range(first, len(scored))]
    return {"text": _decode(state, ids, prompt.text_options), "output_ids": list(ids), "meta_info": meta}


# ---------------------------------------------------------------------------------------------- the routes


async def generate(request: Request) -> JSONResponse:
    start, state = time.perf_counter(), _state(request)
    # In a worker thread: tokenizing a long text takes a while, and other clients must not wait for it.
    prompts, single = await asyncio.to_thread(parse_generate, await _body(request), state.model)
    key = uuid.uuid4().hex  # a seeded request runs alone, so it reproduces generate_sync(its prompts, params)
    async with state.lock.read():
        state.scheduler.stats.requests += 1
        # Input-token logprobs (logprob_start_len >= 0): one forward of each such prompt, on the weights that
        # also sample it (the read lock holds weight updates back until the request is answered).
        scored = [
            await asyncio.to_thread(state.model.engine.score_sync, p.input_ids) if p.logprob_start_len >= 0 else None
            for p in prompts
        ]
        futures = [
            state.scheduler.enqueue(p.input_ids, p.params, request_key=key if p.seeded else None, rid=p.rid)
            for p in prompts
        ]
        try:
            results = await asyncio.gather(*futures)
        except Exception as exc:  # noqa: BLE001
            raise RequestError(f"generation failed: {type(exc).__name__}: {exc}", status=500) from None
    items = []
    for prompt, completions, score in zip(prompts, results, scored, strict=True):
        n, rid = prompt.params.n, prompt.rid
        inputs = None if score is None else score[0]
        for k, completion in enumerate(completions if completions is not None else [None] * n):
            item_rid = uuid.uuid4().hex if rid is None else (f"{rid}_{k}" if n > 1 else rid)
            items.append(_output(state, prompt, completion, item_rid, start, inputs))
    if single and prompts[0].params.n == 1:  # SGLang: a list for a batch or for n > 1
        return JSONResponse(items[0])
    for index, item in enumerate(items):
        item["index"] = index
    return JSONResponse(items)


async def health(request: Request) -> JSONResponse:
    scheduler = _state(request).scheduler
    ok = scheduler is not None and scheduler.alive
    return JSONResponse({} if ok else {"error": "scheduler not running"}, status_code=200 if ok else 503)


async def health_generate(request: Request) -> JSONResponse:
    engine = _state(request).model.engine
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    try:
        async with asyncio.timeout(20):
            await asyncio.to_thread(engine.generate_sync, [[0]], greedy)
    except Exception as exc:  # noqa: BLE001
        return error_response(
            RequestError(f"health generation failed: {type(exc).__name__}: {exc}", status=503)
        )
    return JSONResponse({})


async def model_info(request: Request) -> dict:
    state = _state(request)
    config = state.model.engine.model.config
    return {
        "model_path": state.model_path,
        "tokenizer_path": state.tokenizer_path,
        "served_model_name": state.served_model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.weight_version,
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
    }


async def server_info(request: Request) -> dict:
    state = _state(request)
    scheduler = state.scheduler
    stats = scheduler.stats if scheduler is not None else Stats()
    param = next(state.model.engine.model.parameters())
    return {
        "model_path": state.model_path,
        "served_model_name": state.served_model_name,
        "max_batch_size": state.max_batch_size,
        "batch_window_ms": state.batch_window_ms,
        "max_body_bytes": state.max_body_bytes,
        "skip_tokenizer_init": state.model.tokenizer is None,
        "device": str(param.device),
        "dtype": str(param.dtype).removeprefix("torch."),
        "startup_time": state.startup_time,
        "version": SERVER_VERSION,
        "frontend": "python",
        "tp_size": 1,  # the rank count a distributed weight update gives this server (one process)
        "trustbatch": {
            "generate_calls": stats.generate_calls,
            "requests": stats.requests,
            "sequences": stats.sequences,
            "largest_batch": stats.largest_batch,
            "queued": len(scheduler.queue) if scheduler is not None else 0,
            "paused": bool(scheduler and scheduler.paused),
        },
    }


def _update_failed(message: str, status: int = 400) -> JSONResponse:
    body = {"success": False, "message": printable(message), "num_paused_requests": 0}
    return JSONResponse(body, status_code=status)


async def update_weights_from_disk(request: Request) -> JSONResponse:
    state = _state(request)
    try:
        body = await _body(request)
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("model_path"), str)
            or not body["model_path"]
        ):
            raise RequestError("the body needs model_path (str): an HF directory with *.safetensors weights")
        version = weight_version_of(body)
        unicode_text(body["model_path"], "model_path")  # it comes back in /model_info
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise RequestError(
                f"load_format {body['load_format']!r} is not supported; use 'auto' (safetensors)"
            )
        path = Path(body["model_path"])
        if not path.is_dir():
            raise RequestError(f"model_path {str(path)!r} is not a directory")
    except RequestError as exc:
        return _update_failed(exc.message, exc.status)

    if body.get("abort_all_requests"):
        state.scheduler.abort_queued()
    try:
        await state.load_weights(WeightSource(path=path), version)
    except (ValueError, OSError) as exc:
        return _update_failed(f"Failed to update weights: {exc}")
    state.model_path = state.served_model_name = str(path)
    return JSONResponse({"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})


async def flush_cache() -> PlainTextResponse:
    return PlainTextResponse("Cache flushed.\nThe built-in CPU server keeps no cache across requests.\n")


async def pause_generation(request: Request) -> JSONResponse:
    body = await _body(request, allow_empty=True)
    mode = body.get("mode", "abort") if isinstance(body, dict) else None
    if mode not in ("abort", "retract", "in_place"):
        raise RequestError(f"mode must be one of 'abort', 'retract', 'in_place', got {describe(mode)}")
    if mode == "abort":
        _state(request).scheduler.abort_queued()
    await _state(request).scheduler.pause()
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: Request) -> JSONResponse:
    await _body(request, allow_empty=True)
    _state(request).scheduler.resume()
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: Request) -> Response:
    body = await _body(request, allow_empty=True)
    _expect(isinstance(body, dict), "the request body", body, 'a JSON object {"rid": str, "abort_all": bool}')
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    _expect(rid is None or isinstance(rid, str), "rid", rid, "a string")
    _expect(isinstance(abort_all, bool), "abort_all", abort_all, "a boolean")
    if abort_all:
        _state(request).scheduler.abort_queued()
    elif rid:  # as SGLang: an empty rid without abort_all is ignored, and so is an rid no request has
        _state(request).scheduler.abort_queued(rid)
    return Response(status_code=200)  # SGLang answers an empty 200


ROUTES = [
    ("/generate", generate, ["POST", "PUT"]),
    ("/health", health, ["GET"]),
    ("/health_generate", health_generate, ["GET"]),
    ("/ready", health, ["GET"]),
    ("/model_info", model_info, ["GET"]),
    ("/get_model_info", model_info, ["GET"]),
    ("/server_info", server_info, ["GET"]),
    ("/get_server_info", server_info, ["GET"]),
    ("/update_weights_from_disk", update_weights_from_disk, ["POST"]),
    ("/flush_cache", flush_cache, ["GET", "POST"]),
    ("/pause_generation", pause_generation, ["POST"]),
    ("/continue_generation", continue_generation, ["POST"]),
    ("/abort_request", abort_request, ["POST"]),
]


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    state: NativeState = app.state.native
    state.scheduler = Scheduler(state.model.engine, state.max_batch_size, state.batch_window_ms / 1000.0)
    state.lock = ReaderWriterLock()
    state.scheduler.start()
    yield
    await state.scheduler.stop()


async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
    return error_response(exc)


def create_app(
    engine,
    *,
    model_path: str,
    weight_version: str = "0",
    max_batch_size: int = 256,
    batch_window_ms: float = 5.0,
    tokenizer=None,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """SGLang's native API around ``engine`` (an ``EmbeddedEngine``; the app owns it from now on).

    ``model_path`` is reported by ``/model_info`` (replaced by each ``/update_weights_from_disk``);
    ``weight_version`` labels the engine's current weights; ``max_batch_size`` and ``batch_window_ms`` shape the
    scheduler's batches; ``tokenizer`` enables ``text`` input and decoded ``text`` output; ``max_body_bytes``
    is the largest request body read, a larger one answers 413.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if batch_window_ms < 0:
        raise ValueError(f"batch_window_ms must be >= 0, got {batch_window_ms}")
    if not is_int(max_body_bytes) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an integer >= 1, got {max_body_bytes!r}")
    app = FastAPI(title="trustbatch built-in server (SGLang native API subset)", lifespan=_lifespan)
    app.state.native = NativeState(
        model=ServedModel(engine, tokenizer),
        model_path=str(model_path),
        served_model_name=served_model_name or str(model_path),
        tokenizer_path=str(model_path),
        weight_version=str(weight_version),
        labels={engine.policy_version: str(weight_version)},
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        max_body_bytes=max_body_bytes,
    )
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(RequestError, _request_error)
    for path, endpoint, methods in ROUTES + WEIGHT_UPDATE_ROUTES:
        app.add_api_route(path, endpoint, methods=methods)
    return app
