"""SFT rows and their tokens: the loss mask is the reply's tokens exactly, and bad rows get the file, row and fix."""

from __future__ import annotations

import json

import pytest

from app.data import (
    DataConfig,
    DatasetError,
    WordProblemsConfig,
    load_prompts,
    load_split,
    word_problem_prompts,
)
from app.data.prepare import ModelText
from app.data.rows import PromptRow
from app.data.sft import tokenize_examples
from trainer.model import TinyModelConfig, build_tiny_tokenizer, encode_prompt


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat(*turns, answer="4"):
    roles = ["system", "user", "assistant", "user", "assistant"]
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles[: len(turns)], turns, strict=False)], "answer": answer}


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return ModelText.from_dir(smollm2_dir)


def test_smollm2_mask_is_exactly_the_reply_and_its_end_of_turn(smollm2):
    """For SmolLM2's template: prompt tokens are what the rollout engines get, the target decodes to the reply
    followed by <|im_end|>, and the newline the template writes after <|im_end|> is not trained."""
    tok = smollm2.tokenizer
    rows = word_problem_prompts(WordProblemsConfig(min_ops=1), "test", 40)
    multi = PromptRow(None, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
                      "6", None, "math", "multi", completion="3 + 3 = 6. \\boxed{6}")  # fmt: skip
    plain = PromptRow("What is 3+3? ", None, "6", None, "math", "plain", completion="6")
    examples = tokenize_examples([*rows, multi, plain], smollm2)
    assert len(examples.examples) == 42
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for row, ex in zip(examples.rows, examples.examples, strict=True):
        prompt, target = list(ex.ids[: ex.start]), list(ex.ids[ex.start :])
        assert prompt == encode_prompt(tok, row.prompt, row.messages)
        if row.messages is None:
            assert target == tok(row.completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            continue
        assert target[-1] == im_end and im_end not in target[:-1]
        assert tok.decode(target) == row.completion + "<|im_end|>"
        full = tok.apply_chat_template([*row.messages, {"role": "assistant", "content": row.completion}])
        full = full["input_ids"] if not isinstance(full, list) else full
        assert list(full[: len(ex.ids)]) == list(ex.ids)
        assert tok.decode(full[len(ex.ids) :]) == "\n"  # after the end of turn: not trained


def test_messages_ending_with_the_assistant_become_prompt_and_completion(tmp_path):
    path = _write(tmp_path / "chats.jsonl", [
        _chat("Be brief.", "What is 2+2?", "2 + 2 = 4. \\boxed{4}"),
        {"prompt": "2+2=", "completion": "4"},
    ])  # fmt: skip
    rows = load_prompts(path, purpose="sft")
    assert rows[0].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert rows[0].completion == "2 + 2 = 4. \\boxed{4}" and rows[0].answer == "4"
    assert rows[1].completion == "4" and rows[1].answer is None  # an SFT row needs no reference
    with pytest.raises(DatasetError, match=r"line 2: field 'answer/tests' neither is given"):
        load_prompts(path)  # RL and evaluation still need one


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]},
         r"line 1: field 'completion' is missing: an SFT row needs the reply to learn; end \"messages\" with"),
        ({"prompt": "2+2=", "completion": ""}, r"line 1: field 'completion' must be a non-empty string"),
        ({"messages": [{"role": "assistant", "content": "4"}]}, r"line 1: field 'messages' hold only an assistant"),
        ({**_chat("s", "u", "a"), "completion": "b"}, r"field 'completion' is given and the messages also end"),
    ],
)  # fmt: skip
def test_bad_sft_rows_name_the_file_row_and_fix(tmp_path, row, match):
    path = _write(tmp_path / "bad.jsonl", [row])
    with pytest.raises(DatasetError, match=match) as info:
        load_prompts(path, purpose="sft")
    assert str(path) in str(info.value)


def _tiny(template: str | None = None, context: int | None = None) -> ModelText:
    tok = build_tiny_tokenizer()
    if template is not None:
        tok.chat_template = template
    return ModelText(tok, context or TinyModelConfig().max_position_embeddings, "tiny")


def test_a_template_that_rewrites_earlier_turns_cannot_be_masked():
    # Renders a generation prompt that the full conversation does not start with: the reply is not separable.
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant:\n{% endif %}"
    )
    row = PromptRow(None, [{"role": "user", "content": "2+2?"}], "4", None, "math", "r", origin="f.jsonl: line 3",
                    completion="4")  # fmt: skip
    with pytest.raises(DatasetError, match=r"f\.jsonl: line 3: the chat template .* cannot be told apart"):
        tokenize_examples([row], _tiny(template))


def test_a_template_without_an_end_of_turn_is_refused():
    template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    text = _tiny(template)
    row = PromptRow(None, [{"role": "user", "content": "2+2?"}], "4", None, "math", "r", origin="f.jsonl: line 1",
                    completion="4")  # fmt: skip
    # The tiny tokenizer's EOS is a stop token; this template never writes it.
    with pytest.raises(DatasetError, match=r"ends the assistant's reply with no stop token"):
        tokenize_examples([row], text)


def test_too_long_examples_are_an_error_or_a_counted_drop_never_cut():
    text = _tiny(context=40)
    rows = [
        PromptRow("1+1=", None, "2", None, "math", "short", origin="a.jsonl: line 1", completion="2"),
        PromptRow("1+1=" * 12, None, "2", None, "math", "long", origin="a.jsonl: line 2", completion="2"),
    ]
    with pytest.raises(DatasetError, match=r"1 example\(s\) .* longer than the model's context of 40 tokens"
                                           r"(.|\n)*a\.jsonl: line 2: 50 tokens(.|\n)*sft\.on_long=drop"):  # fmt: skip
        tokenize_examples(rows, text)
    kept = tokenize_examples(rows, text, on_long="drop")
    assert kept.dropped == 1 and [r.id for r in kept.rows] == ["short"]
    assert list(kept.examples[0].ids) == list(text.tokenizer("1+1=2")["input_ids"]) + [text.tokenizer.eos_token_id]


def test_builtin_tasks_give_sft_rows():
    cfg = DataConfig(train="builtin:word_problems", eval="builtin:python_functions", num_train=30, num_eval=5)
    for row in load_split(cfg, "train", "sft"):
        assert row.completion.endswith(f"\\boxed{{{row.answer}}}")
    for row in load_split(cfg, "eval", "sft"):
        assert row.completion.startswith("```python\ndef ") and row.completion.endswith("\n```")
