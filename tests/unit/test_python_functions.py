"""The built-in python_functions task: the template table, disjoint splits, tests checked on the reference
solutions, and a refused problem for each way a template can be wrong."""

from collections import Counter

import pytest

from app.data import DataConfig, DatasetError, load_split
from app.data.tasks import (
    FUNCTION_TEMPLATES,
    FunctionTemplate,
    PythonFunctionsConfig,
    make_problem,
    python_function_prompts,
)
from app.data.tasks.python_functions import INSTRUCTION, _pool


def all_rows(split: str) -> list:
    cfg = PythonFunctionsConfig()
    size = sum(len(_pool(t.name, split)) for t in cfg.chosen())
    return python_function_prompts(cfg, split, size)


@pytest.fixture(scope="module")
def train_rows():
    return all_rows("train")


@pytest.fixture(scope="module")
def test_rows():
    return all_rows("test")


def test_splits_never_share_a_problem_and_hold_enough_held_out_problems(train_rows, test_rows):
    train_keys = {r.metadata["key"] for r in train_rows}
    test_keys = {r.metadata["key"] for r in test_rows}
    assert len(train_keys) == len(train_rows) and len(test_keys) == len(test_rows)  # distinct within a split
    assert not train_keys & test_keys
    # Functions differ too: the function's name carries the parameters, so no test function is trained on.
    names = lambda rows: {r.messages[0]["content"].split("`")[1].split("(")[0] for r in rows}  # noqa: E731
    assert not names(train_rows) & names(test_rows)
    assert len(test_rows) >= 500  # a 500-problem evaluation, the eval command's default, fits
    assert len(train_rows) >= 500
    assert {r.metadata["category"] for r in test_rows} == {"arithmetic", "strings", "lists", "loops"}


def test_every_row_is_a_chat_request_for_a_fenced_block_with_typed_assert_tests(test_rows):
    for row in test_rows:
        [message] = row.messages
        assert message["role"] == "user" and message["content"].endswith(INSTRUCTION)
        assert row.task == "code" and row.answer is None and 2 <= len(row.tests) <= 5
        for test in row.tests:
            assert test["code"].startswith("result = ") and "assert type(result) is " in test["code"]
        assert row.metadata["solution"].startswith("def ")


def test_tests_pass_on_the_reference_and_cover_at_least_two_values(test_rows, train_rows):
    for row in test_rows + train_rows:
        namespace: dict = {}
        exec(row.metadata["solution"], namespace)
        for test in row.tests:
            exec(test["code"], dict(namespace))  # raises AssertionError if a test fails on its reference
        expected = {test["code"].split(" == ", 1)[1] for test in row.tests}
        assert len(expected) >= 2, row.tests  # no constant function passes every test
    booleans = [r for r in test_rows if "type(result) is bool" in r.tests[0]["code"]]
    assert booleans
    for row in booleans:  # True and False both tested
        values = {t["code"].split(" == ", 1)[1].split(",")[0] for t in row.tests}
        assert values == {"True", "False"}, row.tests


def test_generation_is_deterministic_and_a_longer_request_extends_a_shorter_one():
    cfg = PythonFunctionsConfig(seed=3)
    short, long = python_function_prompts(cfg, "train", 20), python_function_prompts(cfg, "train", 60)
    assert [r.messages for r in short] == [r.messages for r in long[:20]]
    assert [r.tests for r in short] == [r.tests for r in long[:20]]
    other = python_function_prompts(PythonFunctionsConfig(seed=4), "train", 20)
    assert [r.messages for r in other] != [r.messages for r in short]
    # Templates are drawn uniformly: the first 60 rows are spread over many templates.
    assert len(Counter(r.metadata["template"] for r in long)) >= 30


def test_num_tests_categories_and_templates_select_what_is_generated():
    rows = python_function_prompts(PythonFunctionsConfig(categories=["strings"], num_tests=5), "test", 40)
    assert {r.metadata["category"] for r in rows} == {"strings"} and {len(r.tests) for r in rows} == {5}
    rows = python_function_prompts(PythonFunctionsConfig(templates=["times_k", "gcd"]), "train", 10)
    assert {r.metadata["template"] for r in rows} <= {"times_k", "gcd"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"categories": ["graphs"]}, "unknown: \\['graphs'\\]"),
        ({"templates": ["nope"]}, "unknown: \\['nope'\\]"),
        ({"num_tests": 1}, "between 2 and 5"),
        ({"num_tests": 6}, "between 2 and 5"),
        ({"categories": ["strings"], "templates": ["times_k"]}, "widen one of them"),
    ],
)
def test_bad_settings_are_refused_with_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PythonFunctionsConfig(**kwargs)


def test_asking_for_more_problems_than_a_split_holds_is_a_dataset_error_with_the_fix():
    cfg = DataConfig(train="builtin:python_functions", eval="builtin:python_functions", num_train=5000)
    with pytest.raises(DatasetError, match="data.train=builtin:python_functions: 5000 .* lower data.num_train"):
        load_split(cfg, "train")


def _template(solution: str, args: str = "x:int", **kwargs) -> FunctionTemplate:
    return FunctionTemplate("broken", "arithmetic", "broken", args, "returns something", solution, **kwargs)


@pytest.mark.parametrize(
    ("template", "match"),
    [
        # The expected value's repr does not read back as an equal value: nan != nan.
        (_template("    return float('nan') if x else x"), "test \\d fails on the reference solution"),
        # A solution whose value changes from call to call.
        (_template("    import random\n    return random.randrange(10**9)"), "test \\d fails on the reference"),
        (_template("    return x +"), "the reference solution does not run"),
        (_template("    return 7"), "every test expects 7"),
    ],
)
def test_a_problem_whose_tests_fail_on_its_own_reference_is_refused(template, match):
    with pytest.raises(ValueError, match=f"template 'broken' .*{match}"):
        make_problem(template, {}, num_tests=3, seed=0)


def test_template_names_and_functions_are_valid_identifiers():
    for spec in FUNCTION_TEMPLATES.values():
        for slots in spec.problems():
            assert spec.function.format(**slots).isidentifier(), (spec.name, slots)
