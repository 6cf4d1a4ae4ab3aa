"""Preparing prompts for a model: tokenized as the engines get them, checked against the context, once.

Every command that samples (`train`, `eval`; and `sft` as it comes) goes through here:
- `ModelText` is a model's tokenizer and context length (``max_position_embeddings``), looked up once per
  command, with what generation needs of the tokenizer (`decode`, `stop_token_ids`);
- `prepare_prompts` tokenizes rows (`encode_rows`: plain prompts without special tokens, chats through the chat
  template) and checks their length (`limit_prompt_lengths`): a prompt that leaves fewer than the completion
  budget (``rollout.max_new_tokens`` in training) in the model's context is an error naming the file and rows
  (``data.on_long_prompt=error``), or is dropped and counted (``drop``).

Token ids of a large set are cached by content (`encode_rows`): the key hashes the tokenizer (its whole
definition and chat template), the tool schemas and every row's text, so any change misses and a second run with
the same data and model reads them back at once ($TRUSTBATCH_CACHE_DIR/tokens; TRUSTBATCH_TOKEN_CACHE=0 turns it
off). The newest `TOKEN_CACHE_FILES` sets are kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from app.data.cache import default_cache_dir
from app.data.rows import _MAX_REPORTED_ERRORS, DatasetError, PromptRow
from trainer.model import encode_prompt

log = logging.getLogger("trustbatch")

OnLongPrompt = Literal["error", "drop"]

TOKEN_CACHE_MIN_ROWS = 2048
"""Sets smaller than this are tokenized every time (milliseconds); larger ones are cached by content."""
TOKEN_CACHE_FILES = 16
"""How many tokenized sets the cache keeps (the least recently used are removed)."""


@dataclass(frozen=True)
class ModelText:
    """A model's tokenizer and context length (None when its config states none), and where they came from."""

    tokenizer: Any
    context: int | None
    where: str
    """How messages name the model (its directory, or the config key that builds it)."""

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelText:
        """A Hugging Face directory's tokenizer and config, without loading its weights."""
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(tokenizer, context_length(AutoConfig.from_pretrained(str(path))), str(path))

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, where: str) -> ModelText:
        return cls(tokenizer, context_length(model.config), where)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Where generation ends: EOS, and the chat template's end-of-turn token when the tokenizer has one."""
        return stop_token_ids(self.tokenizer)


def context_length(config: Any) -> int | None:
    """The positions a model can attend over (``max_position_embeddings``), or None if its config has none."""
    return getattr(config, "max_position_embeddings", None)


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Where generation ends: EOS, and the chat template's end-of-turn token when the tokenizer has one."""
    vocab = tokenizer.get_vocab()
    stop = {tokenizer.eos_token_id} | {vocab[t] for t in ("<|im_end|>",) if t in vocab}
    return tuple(sorted(t for t in stop if t is not None))


@dataclass
class Prompts:
    """Rows and their token ids as the engines get them, checked against a model's context."""

    rows: list[PromptRow]
    ids: list[list[int]]
    dropped: int = 0
    """Rows left out for their length (data.on_long_prompt=drop)."""
    max_new_tokens: int = 0
    """The completion budget they were checked against (fitted, with ``fit``)."""


def encode_rows(tokenizer, rows: list[PromptRow], chat_tools: dict[str, list[dict]] | None = None) -> list[list[int]]:
    """Token ids of each row as the rollout engines get them (`encode_prompt`: plain prompts without special
    tokens, chats through the chat template, with ``chat_tools[row.task]``'s tool schemas when given); plain
    prompts are tokenized in batches (fast tokenizers run them in Rust), which gives the same ids as one at a
    time. A set of `TOKEN_CACHE_MIN_ROWS` rows or more is read from the token cache when it holds it (module
    docstring), and written there when not."""
    path = _cache_file(tokenizer, rows, chat_tools)
    if path is not None and path.is_file():
        try:
            import numpy as np

            with np.load(path) as saved:
                flat, offsets = saved["flat"], saved["offsets"]
            if len(offsets) == len(rows) + 1:
                os.utime(path)  # recently used
                return [flat[offsets[i] : offsets[i + 1]].tolist() for i in range(len(rows))]
        except (OSError, ValueError, KeyError) as exc:  # a damaged file: tokenize again and rewrite it
            log.warning("token cache %s unreadable (%s); tokenizing again", path, exc)
    out = _encode_rows(tokenizer, rows, chat_tools)
    if path is not None:
        _save_cache(path, out)
    return out


def _tokenizer_fingerprint(tokenizer) -> str | None:
    """A hash of everything that decides a tokenizer's ids: its full definition and chat template (None: a
    tokenizer with no serialisable definition, never cached)."""
    known = getattr(tokenizer, "_trustbatch_fingerprint", None)
    if known is not None:
        return known
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    digest = hashlib.sha256()
    for part in (type(tokenizer).__name__, backend.to_str(), str(getattr(tokenizer, "chat_template", None)),
                 json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str)):  # fmt: skip
        digest.update(part.encode())
        digest.update(b"\0")
    fingerprint = digest.hexdigest()
    try:
        tokenizer._trustbatch_fingerprint = fingerprint
    except AttributeError:
        pass
    return fingerprint


def _cache_file(tokenizer, rows: list[PromptRow], chat_tools) -> Path | None:
    if len(rows) < TOKEN_CACHE_MIN_ROWS or os.environ.get("TRUSTBATCH_TOKEN_CACHE", "1").lower() in ("0", "false", "no"):
        return None
    fingerprint = _tokenizer_fingerprint(tokenizer)
    if fingerprint is None:
        return None
    digest = hashlib.sha256(fingerprint.encode())
    digest.update(json.dumps(chat_tools or {}, sort_keys=True).encode())
    for row in rows:
        if row.prompt is not None:
            digest.update(b"p\0" + row.prompt.encode("utf-8", "surrogatepass") + b"\0")
        else:
            text = json.dumps(row.messages, sort_keys=True, ensure_ascii=False)
            task = row.task.encode() if chat_tools else b""
            digest.update(b"m\0" + text.encode("utf-8", "surrogatepass") + b"\0" + task + b"\0")
    return default_cache_dir() / "tokens" / f"{digest.hexdigest()[:32]}.npz"


def _save_cache(path: Path, ids: list[list[int]]) -> None:
    import numpy as np

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(x) for x in ids])
        flat = np.fromiter((t for x in ids for t in x), dtype=np.int64, count=int(offsets[-1]))
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.npz")
        with open(tmp, "wb") as f:
            np.savez(f, flat=flat, offsets=offsets)
        os.replace(tmp, path)  # atomic: a reader sees the whole file or none
    except OSError as exc:  # a read-only or full cache: the ids are still right, only not kept
        log.warning("could not write the token cache %s (%s)", path, exc)
        return
    def used(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:  # removed meanwhile by another process
            return 0.0

    for old in sorted(path.parent.glob("*.npz"), key=used, reverse=True)[TOKEN_CACHE_FILES:]:
        try:
            old.unlink(missing_ok=True)
        except OSError:
            pass


def _encode_rows(tokenizer, rows: list[PromptRow], chat_tools: dict[str, list[dict]] | None) -> list[list[int]]:
    out: list[list[int] | None] = [None] * len(rows)
    plain = [i for i, row in enumerate(rows) if row.prompt is not None]
    for start in range(0, len(plain), 4096):
        chunk = plain[start : start + 4096]
        encoded = tokenizer([rows[i].prompt for i in chunk], add_special_tokens=False)["input_ids"]
        for i, ids in zip(chunk, encoded, strict=True):
            out[i] = list(ids)
    for i, row in enumerate(rows):
        if row.prompt is None:
            try:
                out[i] = encode_prompt(tokenizer, None, row.messages, tools=(chat_tools or {}).get(row.task))
            except ValueError as exc:  # e.g. a model without a chat template for `messages` rows
                raise DatasetError(f"{row.origin or 'a row'}: cannot tokenize its messages: {exc}") from None
    return out  # type: ignore[return-value]


def prepare_prompts(
    rows: list[PromptRow],
    model: ModelText,
    *,
    max_new_tokens: int,
    on_long_prompt: OnLongPrompt,
    source_key: str,
    source: str,
    new_tokens_key: str = "rollout.max_new_tokens",
    keep: int | None = None,
    fit: bool = False,
    chat_tools: dict[str, list[dict]] | None = None,
) -> Prompts:
    """``rows`` tokenized for ``model`` and checked against its context, leaving ``max_new_tokens`` for each
    completion; a longer prompt is an error or dropped (``on_long_prompt``), and dropping every prompt is an error.

    ``source_key`` / ``source`` and ``new_tokens_key`` name the data and the budget in messages. ``keep``: only
    the first ``keep`` rows that fit are wanted, so rows are tokenized until that many are kept. ``fit``: the
    budget is ``max_new_tokens`` or less, what the longest prompt leaves of the context (at least 1).
    ``chat_tools``: per task, the tool schemas chat prompts are rendered with (hermes tool calls).
    """
    context = model.context
    if context is None:  # the model states no context length: nothing to check against
        chosen = rows[:keep]
        return Prompts(chosen, encode_rows(model.tokenizer, chosen, chat_tools), 0, max_new_tokens)
    if fit:
        ids = encode_rows(model.tokenizer, rows, chat_tools)
        max_new_tokens = max(1, min(max_new_tokens, context - max((len(p) for p in ids), default=0)))
    limit = context - max_new_tokens
    why = (
        f"the model's context is {context} tokens (max_position_embeddings of {model.where}) and "
        f"{new_tokens_key}={max_new_tokens} are kept for the completion"
    )
    check = dict(
        max_prompt_tokens=limit, on_long_prompt=on_long_prompt, source_key=source_key, source=source, why=why,
        new_tokens_key=new_tokens_key,
    )  # fmt: skip
    if fit:
        kept, kept_ids, dropped = limit_prompt_lengths(rows, ids, **check)
    else:
        # Tokenize only as many rows as are wanted (more when some are dropped).
        kept, kept_ids, dropped, start = [], [], 0, 0
        wanted = len(rows) if keep is None else keep
        while len(kept) < wanted and start < len(rows):
            chunk = rows[start : start + wanted - len(kept)]
            start += len(chunk)
            more, more_ids, more_dropped = limit_prompt_lengths(chunk, encode_rows(model.tokenizer, chunk, chat_tools), **check)
            kept += more
            kept_ids += more_ids
            dropped += more_dropped
    if not kept:
        raise DatasetError(
            f"{source_key}={source!r}: every prompt is longer than {limit} tokens ({why}), so "
            f"data.on_long_prompt=drop leaves none; use shorter prompts or lower {new_tokens_key}"
        )
    if dropped:
        log.warning(
            "%s: dropped %d of %d prompts longer than %d tokens (data.on_long_prompt=drop; %s)",
            source_key, dropped, dropped + len(kept), limit, why,
        )  # fmt: skip
    return Prompts(kept, kept_ids, dropped, max_new_tokens)


def limit_prompt_lengths(
    rows: list[PromptRow],
    ids: list[list[int]],
    *,
    max_prompt_tokens: int,
    on_long_prompt: OnLongPrompt,
    source_key: str,
    source: str,
    why: str,
    new_tokens_key: str = "rollout.max_new_tokens",
) -> tuple[list[PromptRow], list[list[int]], int]:
    """Keep the rows whose prompt has at most `max_prompt_tokens` tokens; `(rows, ids, dropped)`.

    `ids[i]` are the token ids of `rows[i]` as the rollout engines get them. With `on_long_prompt="error"` any
    longer prompt raises DatasetError naming each such row (the first 20), `why` (where the limit comes from) and
    the fixes; with `"drop"` they are left out and counted (the caller decides whether none left is an error).
    """
    long = [i for i, prompt in enumerate(ids) if len(prompt) > max_prompt_tokens]
    if not long:
        return rows, ids, 0
    if on_long_prompt == "error":
        shown = [
            f"{rows[i].origin or f'row id {rows[i].id!r}'}: prompt has {len(ids[i])} tokens"
            for i in long[:_MAX_REPORTED_ERRORS]
        ]
        more = f"\n  ... and {len(long) - len(shown)} more" if len(long) > len(shown) else ""
        raise DatasetError(
            f"{source_key}={source!r}: {len(long)} prompt(s) longer than {max_prompt_tokens} tokens ({why}):\n  "
            + "\n  ".join(shown)
            + more
            + f"\nshorten or remove these rows, set data.on_long_prompt=drop to skip them, or lower {new_tokens_key}"
        )
    keep = sorted(set(range(len(rows))) - set(long))
    return [rows[i] for i in keep], [ids[i] for i in keep], len(long)
