"""The token cache of `encode_rows` (app/data/prepare.py): keyed by the tokenizer, the tool schemas and every row's
text; a hit returns what the file holds, any change misses; small sets are never cached."""

from __future__ import annotations

import numpy as np
import pytest

from app.data.prepare import TOKEN_CACHE_FILES, TOKEN_CACHE_MIN_ROWS, _encode_rows, encode_rows
from app.data.rows import PromptRow
from trainer.model import build_tiny_tokenizer

N = TOKEN_CACHE_MIN_ROWS


def row(i, *, prompt: str | None = None, content: str | None = None) -> PromptRow:
    messages = None if content is None else [{"role": "user", "content": content}]
    return PromptRow(prompt=prompt, messages=messages, answer="0", tests=None, task="math", id=str(i))


def rows(n: int = N, *, chat: bool = False, salt: str = "") -> list[PromptRow]:
    if chat:
        return [row(i, content=f"{salt}{i}+{i % 7}=") for i in range(n)]
    return [row(i, prompt=f"{salt}{i}*{i % 5}=") for i in range(n)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUSTBATCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRUSTBATCH_TOKEN_CACHE", raising=False)
    return tmp_path / "tokens"


def only_file(cache):
    [path] = cache.glob("*.npz")
    return path


@pytest.mark.parametrize("chat", [False, True])
def test_a_second_call_reads_the_file_the_first_wrote(cache, chat):
    tokenizer = build_tiny_tokenizer()
    data = rows(chat=chat)
    first = encode_rows(tokenizer, data)
    assert first == _encode_rows(tokenizer, data, None)  # the cache changes nothing
    path = only_file(cache)
    # Plant a marker in the file: a second call returns it, so it read the file rather than tokenizing.
    with np.load(path) as saved:
        flat, offsets = saved["flat"].copy(), saved["offsets"]
    flat[0] = 255
    np.savez(path, flat=flat, offsets=offsets)
    again = encode_rows(build_tiny_tokenizer(), data)  # a new tokenizer object with the same definition
    assert again[0][0] == 255 and again[1:] == first[1:]


def test_any_change_of_text_tokenizer_or_tools_misses(cache):
    tokenizer = build_tiny_tokenizer()
    encode_rows(tokenizer, rows(chat=True))
    changed = rows(chat=True)
    changed[-1] = row("x", content="another")
    assert encode_rows(tokenizer, changed)[-1] == _encode_rows(tokenizer, changed[-1:], None)[0]
    other = build_tiny_tokenizer()
    other.chat_template = other.chat_template.replace("<|im_start|>", "<|im_start|> ")
    encode_rows(other, rows(chat=True))
    encode_rows(tokenizer, rows(chat=True), {"math": [{"type": "function", "function": {"name": "python"}}]})
    assert len(list(cache.glob("*.npz"))) == 4


def test_small_sets_and_a_disabled_cache_write_nothing(cache, monkeypatch):
    tokenizer = build_tiny_tokenizer()
    encode_rows(tokenizer, rows(N - 1))
    monkeypatch.setenv("TRUSTBATCH_TOKEN_CACHE", "0")
    encode_rows(tokenizer, rows(N))
    assert not cache.exists() or not list(cache.glob("*.npz"))


def test_the_cache_keeps_the_newest_sets_and_survives_a_damaged_file(cache):
    tokenizer = build_tiny_tokenizer()
    for k in range(TOKEN_CACHE_FILES + 2):
        encode_rows(tokenizer, rows(salt=f"{k}:"))
    assert len(list(cache.glob("*.npz"))) == TOKEN_CACHE_FILES
    newest = max(cache.glob("*.npz"), key=lambda p: p.stat().st_mtime)
    newest.write_bytes(b"not a numpy file")
    data = rows(salt=f"{TOKEN_CACHE_FILES + 1}:")
    assert encode_rows(tokenizer, data) == _encode_rows(tokenizer, data, None)
