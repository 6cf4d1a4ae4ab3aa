"""How both APIs of the built-in server take a request: the body, the served model's prompt checks.

- **The body** (``read_json``): at most ``max_body_bytes`` (``DEFAULT_MAX_BODY_BYTES``, 8 MiB, unless the
  server is given another). A ``Content-Length`` over the limit is refused before a byte of the body is read; a
  body without one (chunked) is counted as it arrives and refused as soon as it passes the limit. Either way the
  answer is 413 (code ``request_too_large``); uvicorn discards the rest of that body (and may close the
  keep-alive connection when much of it is unread). A body that is not JSON is a 400; one over
  ``PARSE_INLINE_BYTES`` is parsed in a worker thread, so the event loop keeps serving other clients meanwhile.
- **A client that hangs up before its body is in** raises ``ClientGone``; ``client_gone`` (installed as an
  exception handler) logs one line for it, no traceback.
- **Prompts** (``ServedModel``): text is checked before it is tokenized (valid Unicode; not longer than
  ``max_prompt_chars``: the context length times the longest token of the vocabulary, x4 for normalisation
  that merges characters and at least ``MIN_CHARS_PER_TOKEN``, since a longer text cannot fit in the context
  whatever it encodes to), then token ids against the vocabulary and the model's context.

Every refusal is an ``app.sampling.RequestError`` (status, field, code); app/serving/native.py renders it as
SGLang's ``{"error": "..."}``, app/serving/openai.py as OpenAI's ``{"error": {"message", "type", "param",
"code"}}``. Parsing runs in a worker thread (tokenizing a long prompt takes a while).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from app.rollout.embedded import EmbeddedEngine
from app.sampling import RequestError, describe, unicode_text

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
"""Largest request body either API reads unless told otherwise (``max_body_bytes``)."""
PARSE_INLINE_BYTES = 256 * 1024
"""Bodies up to this size are parsed on the event loop (about a millisecond); larger ones in a worker thread."""
MIN_CHARS_PER_TOKEN = 32


class ClientGone(Exception):
    """The client closed the connection before its request body was complete."""


def _too_large(limit: int, size: int | None = None) -> RequestError:
    got = f"has {size} bytes" if size is not None else "is larger"
    return RequestError(
        f"the request body {got}; this server takes at most {limit} bytes (max_body_bytes): "
        "split the request or send fewer or shorter prompts",
        status=413,
        code="request_too_large",
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, at most ``max_bytes`` of it: RequestError(413) past that, ClientGone if the client leaves."""
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
    """``json.loads`` with its failures as RequestError(400)."""
    try:
        return json.loads(raw)
    # ValueError: JSONDecodeError, UnicodeDecodeError and an integer of over 4300 digits; RecursionError: arrays
    # or objects nested too deep.
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"the request body is not valid JSON: {str(exc)[:200]}") from None


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


def max_prompt_chars(tokenizer, max_positions: int | None) -> int | None:
    """Characters past which no text fits in ``max_positions`` tokens (None: no bound known)."""
    if tokenizer is None or max_positions is None:
        return None
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_positions * max(MIN_CHARS_PER_TOKEN, 4 * longest)


@dataclass
class ServedModel:
    """The engine and tokenizer behind both APIs, and the checks of a prompt against them.

    ``where`` names the prompt in a message (``prompt[1]``, ``text[0]``...), ``param`` is the field a refusal
    names (OpenAI's ``param``).
    """

    engine: EmbeddedEngine
    tokenizer: Any = None
    max_prompt_chars: int | None = field(init=False)
    """Longer texts cannot fit in the context: refused before they are tokenized."""

    def __post_init__(self) -> None:
        if self.tokenizer is not None:
            # Encode once before any request: a fast tokenizer may switch off its stored padding/truncation on
            # the first call (a mutation), which must not race with requests tokenized in worker threads or
            # with the decoding done in the generating thread.
            self.tokenizer("warm-up", add_special_tokens=False)
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_positions)

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_positions(self) -> int | None:
        return self.engine.max_positions

    def check_text(self, text: str, where: str, param: str) -> None:
        """Before tokenizing: valid Unicode, and not so long that it cannot fit in the context."""
        try:
            unicode_text(text, where)
        except RequestError as exc:
            raise RequestError(exc.message, param) from None
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise RequestError(
                f"this model's maximum context length is {self.max_positions} tokens and {where} has "
                f"{len(text)} characters, more than any text of that many tokens ({self.max_prompt_chars} "
                "characters at most); shorten it",
                param,
                code="context_length_exceeded",
            )

    def encode(self, text: str, where: str, param: str, *, special_tokens: bool = False) -> list[int]:
        """Token ids of a checked ``text`` (``special_tokens``: with the tokenizer's BOS/EOS, as SGLang's
        native ``text`` input), refused when it encodes to none."""
        self.check_text(text, where, param)
        ids = list(self.tokenizer(text, add_special_tokens=special_tokens)["input_ids"])
        if not ids:
            raise RequestError(
                f"{where} encodes to zero tokens; every prompt needs at least one token", param
            )
        return ids

    def check_ids(self, ids: list[int], where: str, param: str) -> list[int]:
        """A non-empty prompt of ids in the vocabulary that leaves room in the context for a completion."""
        if not ids:
            raise RequestError(f"{where} is empty; every prompt needs at least one token", param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"{where} has token ids outside [0, {self.vocab_size}): {describe(bad[:5])}", param
            )
        if self.max_positions is not None and len(ids) >= self.max_positions:
            raise RequestError(
                f"this model's maximum context length is {self.max_positions} tokens and {where} has {len(ids)}, "
                "leaving no room for a completion; shorten it",
                param,
                code="context_length_exceeded",
            )
        return [int(t) for t in ids]
