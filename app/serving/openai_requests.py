"""How the ``/v1`` API of the built-in server takes a request: what it honours, checked into a ``_Parsed``.

app/serving/openai.py answers the parsed request (the responses, the streaming, the routes); this module is the
request side it calls, and imports nothing from it.

What it honours (everything else answers 400 naming the field, never silently ignored):
- completions: ``prompt`` (str, [str], [int] or [[int]]), ``max_tokens`` (default 16), ``temperature`` (0 =
  greedy, or 1e-6 to 2), ``top_p``, ``n`` (1-128), ``stop`` (str or up to 16 strings), ``stop_token_ids``
  (SGLang's extension), ``seed``, ``stream`` + ``stream_options.include_usage``, ``logprobs: 0`` (the logprob
  of each sampled token; top alternatives are not computed), ``user`` (ignored).
- chat: ``messages`` (roles system/developer/user/assistant; string content or text parts) rendered with the
  tokenizer's chat template and the generation prompt, ``max_tokens`` or ``max_completion_tokens`` (default:
  the rest of the context), ``logprobs: true`` (``top_logprobs`` 0), ``response_format`` text, and the same
  sampling fields. The tokenizer's EOS and the usual end-of-turn tokens (``<|im_end|>``...) end a reply
  (``OpenAIState.chat_stop_ids``, from ``_chat_stop_ids``).

Values are checked by app/sampling.py and prompts by app/serving/requests.py, as on the native routes; the
routes run ``parse_completion`` / ``parse_chat`` (tokenizing, chat templates) in a worker thread. A refusal is a
``RequestError``: 400 for a malformed or unsupported request, 404 for an unknown model (code
``model_not_found``); a prompt that leaves no room in the context, or asks ``max_tokens`` beyond it, gets code
``context_length_exceeded``. ``error_body`` renders any ``RequestError`` in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``.

Code layout: ``OpenAIState`` (``app.state.openai``: the served name and its aliases, the chat stop token ids)
is what the checks read beside the ``ServedModel``; ``parse_completion`` and ``parse_chat`` check the fields
and the model and build the prompts' token ids, then share ``_parsed`` (the stream flags; ``_sampling``: the
``SamplingParams`` and the context checks; the stop strings).

Tools (chat only): ``tools`` (function schemas, at most MAX_TOOLS, shown to the model by its own chat template,
which must render them) with ``tool_choice`` ``auto`` or ``none``; ``tool`` messages and assistant messages with
``tool_calls`` are rendered for the template. The model's Hermes-style ``<tool_call>{json}</tool_call>`` blocks come
back as OpenAI ``tool_calls`` (app/serving/openai.py); the client runs the tools: serve never executes model
code. Not with ``stream``, and not ``tool_choice`` ``required`` or a named function (that needs constrained
decoding).

Not covered: the legacy ``functions``, ``echo``, ``suffix``, ``best_of > n``, penalties, ``logit_bias``,
top-k logprobs, images, embeddings, the Responses API.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from app import sampling
from app.rollout.base import SamplingParams
from app.sampling import RequestError, describe, is_int
from app.serving.requests import ServedModel, printable

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
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_TOOLS = 64
MAX_TOOLS_JSON = 1 << 16
"""Most function schemas, and most bytes of them as JSON, one request may show the model."""
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


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


def _chat_stop_ids(engine, tokenizer) -> tuple[int, ...]:
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    eos = getattr(getattr(engine.model, "generation_config", None), "eos_token_id", None)
    for token in eos if isinstance(eos, (list, tuple)) else [eos]:
        if isinstance(token, int):
            ids.add(token)
    return tuple(sorted(t for t in ids if t < engine.vocab_size))


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
    tools: bool = False
    """The model was shown tools: its tool-call blocks come back as ``tool_calls``."""


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
    tools = _tools(body)
    rendered = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad_type(where, message, 'an object {"role": ..., "content": ...}')
        role = message.get("role")
        if role not in _ROLES:
            raise RequestError(
                f"{where}.role must be one of {sorted(_ROLES)}, got {describe(role)}", f"{where}.role"
            )
        content = message.get("content")
        if role == "assistant" and message.get("tool_calls"):
            calls = _assistant_calls(message["tool_calls"], where)
            text = _message_text(content, where) if content not in (None, "") else ""
            rendered.append({"role": "assistant", "content": text, "tool_calls": calls})
            continue
        if message.get("tool_calls"):
            raise RequestError(f"{where}.tool_calls: only an assistant message has tool calls", f"{where}.tool_calls")
        rendered.append({"role": _ROLES[role], "content": _message_text(content, where)})
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
    if tools:
        kwargs = {**kwargs, "tools": tools}
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja raises its own types for a template's checks
        raise RequestError(f"the chat template refused these messages: {exc}", "messages") from None
    if tools and not all(tool["function"]["name"] in text for tool in tools):
        raise RequestError(
            f"the chat template of {served.name!r} does not show tools to the model (its rendering leaves them "
            "out), so it cannot call them; send the request without tools",
            "tools",
        )
    ids = model.check_ids(model.encode(text, "the chat", "messages"), "the chat", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad_type("logprobs", logprobs, "a boolean")
    parsed = _parsed(body, model, served, [ids], bool(logprobs), chat=True)
    if tools and parsed.stream:
        raise RequestError("stream=true with tools is not supported; set stream=false to get tool_calls", "stream")
    parsed.tools = bool(tools)
    return parsed


def _tools(body: dict) -> list[dict]:
    """The function schemas to show the model (empty: none), checked; ``tool_choice`` auto or none."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(
            f"tool_choice={describe(choice)}: only auto and none are supported (forcing a call needs constrained "
            "decoding)",
            "tool_choice",
        )
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad_type("parallel_tool_calls", parallel, "a boolean")
    if tools is None or choice == "none":
        return []
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise _bad_type("tools", tools, f"an array of 1 to {MAX_TOOLS} function schemas")
    if len(json.dumps(tools)) > MAX_TOOLS_JSON:
        raise RequestError(f"tools is over {MAX_TOOLS_JSON} bytes of JSON; send fewer or shorter schemas", "tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise _bad_type(where, tool, '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
        if not isinstance(function.get("name"), str) or not _NAME.match(function["name"]):
            raise _bad_type(f"{where}.function.name", function.get("name"), "a name of 1-64 letters, digits, _ . -")
        if not isinstance(function.get("parameters", {}), dict):
            raise _bad_type(f"{where}.function.parameters", function.get("parameters"), "a JSON schema object")
        if not isinstance(function.get("description", ""), str):
            raise _bad_type(f"{where}.function.description", function.get("description"), "a string")
    return tools


def _assistant_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates take them (arguments as an object)."""
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise _bad_type(f"{where}.tool_calls", calls, f"an array of at most {MAX_TOOLS} calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad_type(f"{where}.tool_calls[{j}]", call, '{"type": "function", "function": {"name", "arguments"}}')
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise RequestError(f"{where}.tool_calls[{j}].function.arguments is not JSON", f"{where}.tool_calls") from None
        out.append({"type": "function", "id": call.get("id"), "function": {"name": function["name"], "arguments": arguments}})
    return out
