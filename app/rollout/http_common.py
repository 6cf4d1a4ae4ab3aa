"""HTTP pieces shared by the two built-in servers: the rollout server (app/rollout/local_server.py, SGLang's
native API) and ``trustbatch serve`` (app/serve.py, the OpenAI API on top of it).

Each server keeps its own error shape (``{"error": "..."}`` natively, ``{"error": {"message", "type", "param",
"code"}}`` on ``/v1``); what is shared is how a request is read and which values are refused:

- **The body** (``read_body`` / ``read_json``): at most ``max_body_bytes`` (``DEFAULT_MAX_BODY_BYTES``, 8 MiB,
  unless the server is given another). A ``Content-Length`` over the limit is refused before a byte of the body
  is read; a body without one (chunked) is counted as it arrives and refused as soon as it passes the limit.
  Either way the answer is 413 (``BodyError``); uvicorn discards the rest of that body (and may close the
  keep-alive connection when much of it is unread). A body that is not JSON is a 400 (``BodyError``); one over ``PARSE_INLINE_BYTES`` is
  parsed in a worker thread, so the event loop keeps serving other clients meanwhile.
- **A client that hangs up before its body is in** raises ``ClientGone``; ``client_gone`` (installed as an
  exception handler) logs one line for it, no traceback.
- **Sampling values** (``temperature``, ``top_p``, ``seed``, ``bounded_int``, ``token_ids``, ``unicode_text``):
  finite numbers only (NaN, infinities and integers too large for a float are refused), a temperature of 0 or
  at least ``MIN_TEMPERATURE`` (a denormal such as 1e-320 would turn the logits into infinities), seeds in
  ``SEED_RANGE`` (what ``torch.Generator.manual_seed`` takes), text without lone surrogates (no tokenizer
  takes them and no response could carry them). They raise ``FieldError``, which each server words its way.
- **Over-long prompts** (``max_prompt_chars``): a text of more characters than the context length times the
  longest token of the vocabulary (x4, for normalisation that merges characters, and at least
  ``MIN_CHARS_PER_TOKEN``) cannot fit in the context whatever it encodes to, so it is refused before it is
  tokenized.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from app.rollout.base import MIN_TEMPERATURE

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
"""Largest request body either server reads unless told otherwise (``max_body_bytes``)."""
PARSE_INLINE_BYTES = 256 * 1024
"""Bodies up to this size are parsed on the event loop (about a millisecond); larger ones in a worker thread."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""What ``torch.Generator.manual_seed`` accepts; a seed outside it would fail inside the engine."""
MAX_NEW_TOKENS = 2**31 - 1
"""Largest token budget taken (any budget past the context is cut to it by the engine anyway)."""
MIN_CHARS_PER_TOKEN = 32


# ---------------------------------------------------------------------------------------------- the body


class BodyError(Exception):
    """The request body could not be taken: ``status`` 413 (too large) or 400 (not JSON)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


class ClientGone(Exception):
    """The client closed the connection before its request body was complete."""


def _too_large(limit: int, size: int | None = None) -> BodyError:
    got = f"has {size} bytes" if size is not None else "is larger"
    return BodyError(
        f"the request body {got}; this server takes at most {limit} bytes (max_body_bytes): "
        "split the request or send fewer or shorter prompts",
        status=413,
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, at most ``max_bytes`` of it: BodyError(413) past that, ClientGone if the client leaves."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes, int(declared))  # not a byte of it read
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise _too_large(max_bytes)
    except ClientDisconnect:
        expected = f" of {declared}" if declared is not None else ""
        raise ClientGone(
            f"the client closed the connection before sending the whole request body ({len(body)}{expected} "
            "bytes received); nothing was done"
        ) from None
    return bytes(body)


def parse_json(raw: bytes) -> Any:
    """``json.loads`` with its failures as BodyError(400)."""
    try:
        return json.loads(raw)
    # ValueError: JSONDecodeError, UnicodeDecodeError and an integer of over 4300 digits; RecursionError: arrays
    # or objects nested too deep.
    except (ValueError, RecursionError) as exc:
        raise BodyError(f"the request body is not valid JSON: {str(exc)[:200]}") from None


async def read_json(request: Request, max_bytes: int, *, allow_empty: bool = False) -> Any:
    """The body parsed as JSON (``{}`` for an empty body when ``allow_empty``); see ``read_body``."""
    raw = await read_body(request, max_bytes)
    if allow_empty and not raw.strip():
        return {}
    if len(raw) > PARSE_INLINE_BYTES:
        return await asyncio.to_thread(parse_json, raw)
    return parse_json(raw)


async def client_gone(request: Request, exc: ClientGone) -> Response:
    """Exception handler for ClientGone: one log line; the response goes nowhere (uvicorn drops it)."""
    client = request.client
    where = f"{client.host}:{client.port}" if client else "a client"
    logger.warning("%s %s from %s: %s", request.method, request.url.path, where, exc)
    return Response(status_code=499)  # nginx's "client closed request"


def printable(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` escapes, so that it can go into a UTF-8 response."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def describe(value: Any, limit: int = 60) -> str:
    """A short JSON rendering of a client's value for an error message (ASCII; never fails)."""
    if isinstance(value, str) and len(value) > limit:
        value = value[:limit]
    elif isinstance(value, list) and len(value) > limit:
        value = value[:limit]
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------- values


class FieldError(ValueError):
    """A refused value of the request field ``field`` (a dotted path such as ``sampling_params.top_p``)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message, self.field = message, field


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def finite_number(value: Any, field: str) -> float:
    """``value`` as a finite float: FieldError for a non-number, NaN, an infinity or a too large integer."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(f"{field} must be a number, got {describe(value)}", field)
    try:
        number = float(value)
    except OverflowError:
        raise FieldError(
            f"{field} must be a finite number, got an integer of {len(str(value))} digits", field
        ) from None
    if not math.isfinite(number):
        raise FieldError(f"{field} must be a finite number, got {describe(value)}", field)
    return number


def temperature(value: Any, field: str, *, maximum: float | None = None) -> float:
    """0 (greedy) or a number in [MIN_TEMPERATURE, maximum]."""
    number = finite_number(value, field)
    if number == 0:
        return 0.0
    if number < MIN_TEMPERATURE or (maximum is not None and number > maximum):
        upper = "" if maximum is None else f", {maximum:g}"
        raise FieldError(
            f"{field} must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}{upper}{']' if upper else ', inf)'}, "
            f"got {describe(value)}",
            field,
        )
    return number


def top_p(value: Any, field: str) -> float:
    number = finite_number(value, field)
    if not 0 < number <= 1:
        raise FieldError(f"{field} must be a number in (0, 1], got {describe(value)}", field)
    return number


def seed(value: Any, field: str) -> int:
    if not is_int(value):
        raise FieldError(f"{field} must be an integer, got {describe(value)}", field)
    if not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise FieldError(f"{field} must be an integer in [-2**63, 2**64 - 1], got {describe(value)}", field)
    return value


def bounded_int(value: Any, field: str, low: int, high: int) -> int:
    if not is_int(value) or not low <= value <= high:
        raise FieldError(f"{field} must be an integer in [{low}, {high}], got {describe(value)}", field)
    return value


def token_ids(value: Any, field: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) and 0 <= t < vocab_size for t in value):
        raise FieldError(
            f"{field} must be a list of token ids in [0, {vocab_size}), got {describe(value)}", field
        )
    return value


def unicode_text(value: str, field: str) -> str:
    """``value`` if it can be encoded as UTF-8; FieldError for a lone surrogate such as ``"\\ud800"``."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError(
            f"{field} is not valid Unicode: {exc.reason} at character {exc.start} (a lone UTF-16 surrogate)",
            field,
        ) from None
    return value


def max_prompt_chars(tokenizer, max_positions: int | None) -> int | None:
    """Characters past which no text fits in ``max_positions`` tokens (None: no bound known); see the module
    docstring."""
    if tokenizer is None or max_positions is None:
        return None
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_positions * max(MIN_CHARS_PER_TOKEN, 4 * longest)
