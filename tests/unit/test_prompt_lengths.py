"""Prompt lengths checked at start-up, on the token ids the rollout engines get (chat template included)."""

import json
from pathlib import Path

import pytest

from app.config import load_config
from app.data import DatasetError, load_prompts
from app.data.prepare import ModelText, encode_rows
from app.training.setup import run_prompts
from trainer.model import build_tiny_tokenizer, encode_prompt

CONTEXT = 64
MAX_NEW = 8  # a prompt may have CONTEXT - MAX_NEW = 56 tokens; the tiny tokenizer spends one per ASCII character


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def short(i: int) -> dict:
    return {"prompt": f"{i}+1=", "answer": str(i + 1), "id": f"s{i}"}


def long(i: int) -> dict:
    return {"prompt": "1+" * 40 + f"{i}=", "answer": "0", "id": f"l{i}"}


def config(tmp_path, train, evaluation, *extra):
    return load_config(
        None,
        [
            f"data.train={write(tmp_path / 'train.jsonl', train)}",
            f"data.eval={write(tmp_path / 'eval.jsonl', evaluation)}",
            f"rollout.max_new_tokens={MAX_NEW}",
            *extra,
        ],
    )


def prepare(cfg):
    rows = {split: load_prompts(getattr(cfg.data, split)) for split in ("train", "eval")}
    return run_prompts(cfg, ModelText(build_tiny_tokenizer(), CONTEXT, "tiny"), rows["train"], rows["eval"])


def test_encode_rows_gives_the_ids_encode_prompt_gives():
    tokenizer = build_tiny_tokenizer()
    rows = load_prompts(Path(__file__).parent.parent / "fixtures" / "prompts_small.jsonl")
    assert any(r.messages for r in rows) and any(r.prompt for r in rows)
    assert encode_rows(tokenizer, rows) == [encode_prompt(tokenizer, r.prompt, r.messages) for r in rows]


def test_a_long_training_prompt_stops_the_run_with_the_file_row_and_fix(tmp_path):
    cfg = config(tmp_path, [short(0), long(1), short(2)], [short(3)])
    with pytest.raises(DatasetError) as info:
        prepare(cfg)
    message = str(info.value)
    assert message.startswith(f"data.train='{tmp_path / 'train.jsonl'}': 1 prompt(s) longer than 56 tokens")
    assert f"{tmp_path / 'train.jsonl'}: line 2: prompt has 82 tokens" in message
    assert "context is 64 tokens" in message and "rollout.max_new_tokens=8" in message
    assert "data.on_long_prompt=drop" in message


def test_the_limit_leaves_room_for_max_new_tokens(tmp_path):
    exactly = {"prompt": "7" * 56, "answer": "7"}
    one_more = {"prompt": "7" * 57, "answer": "7"}
    assert len(prepare(config(tmp_path, [exactly], [short(0)])).train.rows) == 1
    with pytest.raises(DatasetError, match="line 1: prompt has 57 tokens"):
        prepare(config(tmp_path, [one_more], [short(0)]))


def test_chat_rows_are_measured_with_the_chat_template(tmp_path):
    text = "9" * 50  # 50 tokens as a plain prompt; the ChatML wrapping adds more than 6
    plain = {"prompt": text, "answer": "9"}
    chat = {"messages": [{"role": "user", "content": text}], "answer": "9"}
    assert len(prepare(config(tmp_path, [plain], [short(0)])).train.rows) == 1
    with pytest.raises(DatasetError, match=r"line 1: prompt has \d+ tokens"):
        prepare(config(tmp_path, [chat], [short(0)]))


def test_a_long_eval_prompt_is_an_error_too(tmp_path):
    cfg = config(tmp_path, [short(0)], [short(1), long(2)], "eval.num_prompts=2")
    with pytest.raises(DatasetError, match=r"(?s)^data\.eval=.*line 2: prompt has 82 tokens"):
        prepare(cfg)


def test_eval_rows_past_eval_num_prompts_are_not_checked(tmp_path):
    cfg = config(tmp_path, [short(0)], [short(1), short(2), long(3)], "eval.num_prompts=2")
    sets = prepare(cfg)
    assert [r.id for r in sets.eval.rows] == ["s1", "s2"] and sets.dropped == {"train": 0, "eval": 0}


def test_drop_skips_long_prompts_of_both_splits_and_counts_them(tmp_path):
    cfg = config(
        tmp_path,
        [short(0), long(1), short(2), long(3)],
        [long(4), short(5), long(6), short(7), short(8), short(9)],
        "eval.num_prompts=3",
        "data.on_long_prompt=drop",
    )
    sets = prepare(cfg)
    assert [r.id for r in sets.train.rows] == ["s0", "s2"]
    assert [r.id for r in sets.eval.rows] == ["s5", "s7", "s8"]  # the first three that fit
    assert sets.dropped == {"train": 2, "eval": 2}
    tokenizer = build_tiny_tokenizer()
    assert sets.train.ids == [encode_prompt(tokenizer, r.prompt) for r in sets.train.rows]
    assert sets.eval.ids == [encode_prompt(tokenizer, r.prompt) for r in sets.eval.rows]


def test_drop_that_leaves_nothing_is_an_error(tmp_path):
    cfg = config(tmp_path, [long(0), long(1)], [short(2)], "data.on_long_prompt=drop")
    with pytest.raises(DatasetError, match=r"^data\.train=.*every prompt is longer than 56 tokens"):
        prepare(cfg)
    cfg = config(tmp_path, [short(0)], [long(1)], "data.on_long_prompt=drop")
    with pytest.raises(DatasetError, match=r"^data\.eval=.*every prompt is longer than 56 tokens"):
        prepare(cfg)


def test_chat_rows_for_a_tokenizer_without_a_chat_template_are_a_dataset_error(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    path = write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}])
    rows = load_prompts(str(path))
    with pytest.raises(DatasetError, match=r"chat\.jsonl.*cannot tokenize its messages"):
        encode_rows(tokenizer, rows)
