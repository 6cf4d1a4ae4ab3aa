"""Prompt datasets: file loading and row validation, the built-in arithmetic task, DataConfig sources."""

import json
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from app.data import (
    BUILTIN_TASKS,
    ArithmeticConfig,
    DataConfig,
    DatasetError,
    PromptRow,
    arithmetic_prompts,
    evaluate_expression,
    limit_prompt_lengths,
    load_prompts,
    load_split,
    split_of,
    worked_solution,
)
from trainer.model import TinyModelConfig, build_tiny_tokenizer, encode_prompt

FIXTURE = Path(__file__).parent.parent / "fixtures" / "prompts_small.jsonl"
GOOD = {"prompt": "1+1=", "answer": "2"}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------- files


def test_jsonl_fixture_loads_every_row_shape():
    rows = load_prompts(FIXTURE)
    assert [r.id for r in rows] == ["math-1", "math-2", "code-1", "code-2"]
    math1, math2, code1, code2 = rows
    assert math1 == PromptRow("What is 2+3? Answer with a number.", None, "5", None, "math", "math-1", {})
    assert math2.prompt is None and math2.messages[1] == {"role": "user", "content": "7*6="}
    assert math2.answer == "42" and math2.metadata == {"source": "fixture"}  # a number is kept as its text
    assert code1.task == "code" and code1.tests == ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
    assert code2.task == "code_stdio" and code2.metadata == {"difficulty": "easy"}


def test_parquet_loads_like_jsonl(tmp_path):
    table = pa.Table.from_pylist(
        [
            {"prompt": "2*3=", "answer": "6", "messages": None, "tests": None, "level": 1},
            {
                "prompt": None,
                "messages": [{"role": "user", "content": "hi"}],
                "answer": None,
                "tests": ["assert f() == 1"],
                "level": 2,
            },
        ]
    )
    pq.write_table(table, tmp_path / "p.parquet")
    first, second = load_prompts(tmp_path / "p.parquet")
    assert first == PromptRow("2*3=", None, "6", None, "math", "p.parquet:1", {"level": 1})
    assert second.messages == [{"role": "user", "content": "hi"}] and second.prompt is None
    assert second.tests == ["assert f() == 1"] and second.task == "code" and second.id == "p.parquet:2"


def test_default_ids_use_line_numbers_and_skip_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(GOOD) + "\n")
    assert [r.id for r in load_prompts(path)] == ["d.jsonl:1", "d.jsonl:3"]


BAD_ROWS = [
    ({"answer": "1"}, "prompt/messages", "neither"),
    (
        {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "answer": "1"},
        "prompt/messages",
        "both",
    ),
    ({"prompt": "", "answer": "1"}, "prompt", "non-empty string"),
    ({"prompt": 3, "answer": "1"}, "prompt", "non-empty string"),
    ({"messages": [], "answer": "1"}, "messages", "non-empty list"),
    ({"messages": "hi", "answer": "1"}, "messages", "non-empty list"),
    ({"messages": ["hi"], "answer": "1"}, "messages[0]", "must be an object"),
    ({"messages": [{"role": "robot", "content": "x"}], "answer": "1"}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user"}], "answer": "1"}, "messages[0].content", "must be a string"),
    ({"prompt": "x"}, "answer/tests", "neither"),
    ({"prompt": "x", "answer": ["1"]}, "answer", "must be a string"),
    ({"prompt": "x", "answer": True}, "answer", "must be a string"),
    ({"prompt": "x", "tests": []}, "tests", "non-empty list"),
    ({"prompt": "x", "tests": "assert 1"}, "tests", "non-empty list"),
    ({"prompt": "x", "answer": "1", "task": ""}, "task", "non-empty string"),
    ({"prompt": "x", "answer": "1", "task": 5}, "task", "non-empty string"),
    ({"prompt": "x", "answer": "1", "id": 1.5}, "id", "string or an integer"),
    ({"prompt": "x", "answer": "1", "metadata": [1]}, "metadata", "must be an object"),
    ({"prompt": "x", "answer": "1", "level": 1, "metadata": {"level": 2}}, "metadata", "keep one"),
    (["prompt", "x"], "row", "not an object"),
    # A JSON escape of half a surrogate pair loads as a str that no tokenizer, log or store can encode.
    ({"prompt": "a\ud800b", "answer": "1"}, "prompt", "lone surrogate '\\ud800' at character 1"),
    ({"messages": [{"role": "user", "content": "\udfff"}], "answer": "1"}, "messages[0].content", "lone surrogate"),
    ({"prompt": "x", "answer": "\ud800"}, "answer", "lone surrogate"),
    ({"prompt": "x", "tests": ["ok", "assert f('\udc80')"]}, "tests[1]", "lone surrogate"),
    ({"prompt": "x", "answer": "1", "metadata": {"src": {"\ud800": 1}}}, "metadata.src (a key)", "lone surrogate"),
    ({"prompt": "x", "answer": "1", "note": "\ud800"}, "note", "write the character itself"),
]


@pytest.mark.parametrize(("row", "field", "why"), BAD_ROWS, ids=[f"{f}-{w}" for _, f, w in BAD_ROWS])
def test_bad_row_names_file_line_field_and_fix(tmp_path, row, field, why):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, row])
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    message = str(info.value)
    assert f"{path}: line 3: field '{field}'" in message and why in message, message
    assert "line 1" not in message and "line 2" not in message


def test_surrogate_pairs_and_other_unicode_are_fine(tmp_path):
    path = tmp_path / "unicode.jsonl"
    path.write_text('{"prompt": "smile \\ud83d\\ude00 caf\u00e9 \u4e2d", "answer": "1"}\n', encoding="utf-8")
    (row,) = load_prompts(path)
    assert row.prompt == "smile \U0001f600 caf\u00e9 \u4e2d"


def test_rows_remember_where_they_came_from(tmp_path):
    path = write_jsonl(tmp_path / "o.jsonl", [GOOD, {**GOOD, "id": "named"}])
    assert [r.origin for r in load_prompts(path)] == [f"{path}: line 1", f"{path}: line 2"]
    pq.write_table(pa.Table.from_pylist([GOOD]), tmp_path / "o.parquet")
    assert load_prompts(tmp_path / "o.parquet")[0].origin == f"{tmp_path / 'o.parquet'}: row 1"


def _rows(n: int, long: set[int]) -> tuple[list[PromptRow], list[list[int]]]:
    rows = [PromptRow(f"p{i}", None, "1", None, "math", f"r{i}", {}, origin=f"f.jsonl: line {i + 1}") for i in range(n)]
    return rows, [[0] * (11 if i in long else 10) for i in range(n)]


LIMIT = dict(max_prompt_tokens=10, source_key="data.train", source="f.jsonl", why="context 18, 8 new tokens")


def test_prompts_within_the_limit_pass_untouched():
    rows, ids = _rows(3, set())
    assert limit_prompt_lengths(rows, ids, on_long_prompt="error", **LIMIT) == (rows, ids, 0)


def test_a_long_prompt_is_an_error_naming_the_key_the_file_the_row_and_the_fix():
    rows, ids = _rows(4, {1, 3})
    with pytest.raises(DatasetError) as info:
        limit_prompt_lengths(rows, ids, on_long_prompt="error", **LIMIT)
    message = str(info.value)
    assert message.startswith("data.train='f.jsonl': 2 prompt(s) longer than 10 tokens (context 18, 8 new tokens)")
    assert "f.jsonl: line 2: prompt has 11 tokens" in message and "f.jsonl: line 4: prompt has 11 tokens" in message
    assert "line 1:" not in message and "data.on_long_prompt=drop" in message


def test_many_long_prompts_are_listed_up_to_twenty():
    rows, ids = _rows(30, set(range(30)))
    with pytest.raises(DatasetError) as info:
        limit_prompt_lengths(rows, ids, on_long_prompt="error", **LIMIT)
    assert "30 prompt(s)" in str(info.value) and "line 20:" in str(info.value) and "... and 10 more" in str(info.value)


def test_drop_leaves_long_prompts_out_and_counts_them():
    rows, ids = _rows(5, {0, 2})
    kept, kept_ids, dropped = limit_prompt_lengths(rows, ids, on_long_prompt="drop", **LIMIT)
    assert [r.id for r in kept] == ["r1", "r3", "r4"] and kept_ids == [ids[1], ids[3], ids[4]] and dropped == 2


def test_bad_parquet_row_names_row_number(tmp_path):
    pq.write_table(pa.Table.from_pylist([GOOD, {"prompt": "x", "answer": None}]), tmp_path / "b.parquet")
    with pytest.raises(DatasetError, match=r"b\.parquet: row 2: field 'answer/tests' neither"):
        load_prompts(tmp_path / "b.parquet")


def test_all_bad_rows_reported_together(tmp_path):
    path = write_jsonl(tmp_path / "many.jsonl", [{"prompt": "x"}] * 25)
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    message = str(info.value)
    assert "25 invalid field(s)" in message and "line 20:" in message and "... and 5 more" in message
    assert isinstance(info.value, ValueError)


def test_invalid_json_names_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + '{"prompt": "x", "answer": }\n')
    with pytest.raises(DatasetError, match=r"broken\.jsonl: line 2: invalid JSON"):
        load_prompts(path)


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match=r"unsupported file extension '\.csv'.*\.jsonl"):
        load_prompts(tmp_path / "data.csv")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(DatasetError, match="no rows"):
        load_prompts(tmp_path / "empty.jsonl")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(DatasetError, match="no rows"):
        load_prompts(tmp_path / "empty.parquet")
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="cannot read as Parquet"):
        load_prompts(tmp_path / "fake.parquet")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DatasetError, match="UTF-8"):
        load_prompts(tmp_path / "latin1.jsonl")


# ---------------------------------------------------------------------------------------------- arithmetic


def test_splits_never_overlap():
    cfg = ArithmeticConfig()
    train = arithmetic_prompts(cfg, "train", 20000)
    test = arithmetic_prompts(cfg, "test", 2000)
    train_prompts, test_prompts = {r.prompt for r in train}, {r.prompt for r in test}
    assert len(train_prompts) == 20000 and len(test_prompts) == 2000  # unique within a split
    assert not train_prompts & test_prompts
    # The assignment is by the text alone, so another seed's train never meets this test split either.
    other = arithmetic_prompts(ArithmeticConfig(seed=7), "train", 5000)
    assert not {r.prompt for r in other} & test_prompts
    assert all(split_of(r.prompt[:-1]) == "test" for r in test)


def test_deterministic_from_seed_and_prefix_stable():
    cfg = ArithmeticConfig(seed=3)
    a = arithmetic_prompts(cfg, "train", 300)
    assert a == arithmetic_prompts(ArithmeticConfig(seed=3), "train", 300)
    assert arithmetic_prompts(cfg, "train", 100) == a[:100]
    assert [r.prompt for r in arithmetic_prompts(ArithmeticConfig(seed=4), "train", 300)] != [
        r.prompt for r in a
    ]


def test_answers_are_exact():
    cfg = ArithmeticConfig(max_ops=5, max_operand=99)
    rows = arithmetic_prompts(cfg, "train", 3000) + arithmetic_prompts(cfg, "test", 300)
    for row in rows:
        expr = row.prompt.removesuffix("=")
        assert row.answer == str(eval(expr, {"__builtins__": {}}))  # Python itself as the oracle
        assert row.task == "math" and row.completion == row.answer  # data.arithmetic.solutions=answer
        assert 1 <= row.metadata["num_ops"] <= 5 and row.prompt.endswith("=")
    assert len({r.id for r in rows}) == len(rows)


def test_expression_shape_follows_config():
    rows = arithmetic_prompts(
        ArithmeticConfig(min_ops=2, max_ops=2, operators="*", max_operand=5), "train", 50
    )
    for row in rows:
        operands = row.prompt[:-1].split("*")
        assert len(operands) == 3 and all(0 <= int(x) <= 5 for x in operands)


def test_evaluate_expression_precedence():
    assert evaluate_expression("7+5*3-4") == 18
    assert evaluate_expression("2*3*4-10-1") == 13
    assert evaluate_expression("0-9*9") == -81
    with pytest.raises(ValueError):
        evaluate_expression("1+")


def test_too_small_space_names_config_keys():
    cfg = ArithmeticConfig(max_ops=1, max_operand=2, operators="+")  # 9 expressions in all
    with pytest.raises(ValueError, match=r"only 9 expressions exist.*data\.arithmetic\.max_operand"):
        arithmetic_prompts(cfg, "train", 10)
    with pytest.raises(
        ValueError, match=r"test split has \d expressions, 9 requested.*data\.arithmetic\.max_ops"
    ):
        arithmetic_prompts(cfg, "test", 9)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"min_ops": 0}, "data.arithmetic.min_ops"),
        ({"min_ops": 3, "max_ops": 2}, "data.arithmetic.max_ops"),
        ({"max_operand": 0}, "data.arithmetic.max_operand"),
        ({"operators": "+/"}, "data.arithmetic.operators"),
        ({"operators": ""}, "data.arithmetic.operators"),
    ],
)
def test_arithmetic_config_validation(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        ArithmeticConfig(**kwargs)


def test_prompts_fit_the_tiny_tokenizer():
    tokenizer = build_tiny_tokenizer()
    max_len = TinyModelConfig().max_position_embeddings
    cfg = ArithmeticConfig()
    for row in arithmetic_prompts(cfg, "train", 500) + arithmetic_prompts(cfg, "test", 100):
        ids = encode_prompt(tokenizer, row.prompt)
        completion = tokenizer(row.completion, add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        assert tokenizer.decode(ids) == row.prompt
        assert len(ids) == len(row.prompt)  # one token per ASCII character
        assert len(ids) + len(completion) < max_len


# ---------------------------------------------------------------------------------------------- DataConfig


def test_load_split_builtin_and_file(tmp_path):
    cfg = DataConfig(num_train=50, num_eval=20)
    train, evaluation = load_split(cfg, "train"), load_split(cfg, "eval")
    assert len(train) == 50 and len(evaluation) == 20
    assert {r.metadata.pop("data_source") for r in train + evaluation} == {"arithmetic"}  # its source's name
    assert train == arithmetic_prompts(cfg.arithmetic, "train", 50)
    assert evaluation == arithmetic_prompts(cfg.arithmetic, "test", 20)
    file_cfg = DataConfig(train=str(FIXTURE), eval=str(FIXTURE))
    assert [r.id for r in load_split(file_cfg, "eval")] == ["math-1", "math-2", "code-1", "code-2"]
    with pytest.raises(DatasetError, match="no such file"):
        load_split(DataConfig(train=str(tmp_path / "nope.jsonl")), "train")


def test_data_config_is_omegaconf_structured():
    merged = OmegaConf.merge(
        OmegaConf.structured(DataConfig),
        OmegaConf.from_dotlist(["num_train=10", "arithmetic.max_ops=2", "arithmetic.seed=5"]),
    )
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, DataConfig) and isinstance(cfg.arithmetic, ArithmeticConfig)
    assert cfg.num_train == 10 and asdict(cfg.arithmetic)["max_ops"] == 2
    with pytest.raises(ValueError, match=r"data\.arithmetic\.max_ops"):
        OmegaConf.to_object(OmegaConf.merge(merged, OmegaConf.from_dotlist(["arithmetic.max_ops=0"])))
    assert set(BUILTIN_TASKS) == {"arithmetic", "word_problems", "python_functions"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"train": "builtin:sudoku"}, r"data\.train='builtin:sudoku': unknown built-in task"),
        ({"eval": "prompts.txt"}, r"data\.eval='prompts.txt' is neither"),
        ({"num_train": 0}, r"data\.num_train=0"),
        ({"num_eval": -1}, r"data\.num_eval=-1"),
    ],
)
def test_data_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


def test_worked_arithmetic_solutions_end_in_the_answer():
    cfg = ArithmeticConfig(max_ops=4, max_operand=20, solutions="worked")
    rows = arithmetic_prompts(cfg, "train", 2000)
    for row in rows:
        assert row.completion.endswith(f"\\boxed{{{row.answer}}}")
        assert row.completion == worked_solution(row.prompt.removesuffix("="))
    assert worked_solution("7+5*3-4") == "5*3=15. 7+15=22. 22-4=18. \\boxed{18}"
    assert worked_solution("9-8-7") == "9-8=1. 1-7=-6. \\boxed{-6}"
    with pytest.raises(ValueError, match="data.arithmetic.solutions"):
        ArithmeticConfig(solutions="steps")


def test_on_long_prompt_takes_error_or_drop():
    base = OmegaConf.structured(DataConfig)
    assert OmegaConf.to_object(base).on_long_prompt == "error"
    assert OmegaConf.to_object(OmegaConf.merge(base, {"on_long_prompt": "drop"})).on_long_prompt == "drop"
    with pytest.raises(Exception, match="truncate"):
        OmegaConf.merge(base, {"on_long_prompt": "truncate"})


# ---------------------------------------------------------------------------------------------- GSM8K files

GSM8K_FIXTURE = Path(__file__).parent.parent / "fixtures" / "gsm8k_small.jsonl"


def test_gsm8k_rows_become_chat_word_problems_with_the_final_number_as_answer():
    from app.data import WORD_PROBLEM_INSTRUCTION

    rows = load_prompts(GSM8K_FIXTURE, "gsm8k")
    assert [r.answer for r in rows] == ["72", "10", "1450", "5"]
    first = rows[0]
    assert first.prompt is None and first.task == "math" and first.id == "gsm8k_small.jsonl:1"
    assert first.messages == [
        {"role": "system", "content": WORD_PROBLEM_INSTRUCTION},
        {"role": "user", "content": json.loads(GSM8K_FIXTURE.read_text().splitlines()[0])["question"]},
    ]
    assert first.metadata["solution"].endswith("#### 72")
    cfg = DataConfig(train=str(GSM8K_FIXTURE), eval=str(GSM8K_FIXTURE), format="gsm8k")
    assert [r.answer for r in load_split(cfg, "eval")] == ["72", "10", "1450", "5"]


def test_gsm8k_rows_without_a_final_number_are_reported_with_their_lines(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [
        {"question": "How many?", "answer": "It is 4.\n#### 4"},
        {"question": "How many?", "answer": "no final line"},
        {"question": "", "answer": "#### 3"},
        {"prompt": "1+1=", "answer": "2"},
        ["not", "an", "object"],
    ])  # fmt: skip
    with pytest.raises(DatasetError) as err:
        load_prompts(path, "gsm8k")
    message = str(err.value)
    assert "5 invalid field(s)" in message
    assert "line 2: field 'answer' must be a GSM8K solution ending in '#### <number>'" in message
    assert "line 3: field 'question' must be a non-empty string" in message
    assert "line 4: field 'question'" in message and "line 4: field 'answer'" in message  # a plain row
    assert "line 5: field '(row)' must be a JSON object" in message
    with pytest.raises(ValueError, match="data.format='gsm'"):
        DataConfig(format="gsm")


def test_jsonl_gz_files_are_read_like_jsonl_and_named_in_config_checks(tmp_path):
    import gzip

    plain = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
    packed = tmp_path / "p.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    rows = load_prompts(packed)
    assert [r.answer for r in rows] == ["2", "4"] and rows[1].origin == f"{packed}: line 2"
    cfg = DataConfig(train=str(packed), eval=str(packed))
    assert len(load_split(cfg, "train")) == 2
    with pytest.raises(ValueError, match=r"\.jsonl / \.jsonl\.gz / \.json / \.parquet / \.csv / \.arrow"):
        DataConfig(train=str(tmp_path / "p.json.gz"))
    with pytest.raises(DatasetError, match="unsupported file extension"):
        load_prompts(tmp_path / "p.gz")
