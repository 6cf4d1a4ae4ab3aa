"""The built-in word_problems task: GSM8K-style chat rows, disjoint splits, exact answers, the math verifier."""

import contextlib
import io
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from app.config import load_config
from app.data import (
    BUILTIN_TASKS,
    WORD_PROBLEM_INSTRUCTION,
    WORD_PROBLEM_TEMPLATES,
    DataConfig,
    WordProblemsConfig,
    load_prompts,
    load_split,
    split_of,
    word_problem_key,
    word_problem_prompts,
)
from rewards import VerifierInput, build_verifier

SMOLLM2 = Path(__file__).resolve().parents[2] / "configs" / "smollm2-reasoning.yaml"
NUMBER = re.compile(r"\d+")

# The answer of each template from the numbers its problem states, written out again independently.
ORACLE = {
    "more": lambda s: s["a"] + s["b"],
    "fewer": lambda s: s["a"] - s["b"],
    "packs": lambda s: s["packs"] * s["each"],
    "share": lambda s: s["total"] // s["friends"],
    "unit_price": lambda s: s["total"] // s["n"] * s["m"],
    "work_rate": lambda s: s["rate"] * s["hours"] * s["days"],
    "shopping": lambda s: s["a"] * s["p"] + s["b"] * s["q"],
    "shopping_change": lambda s: s["paid"] - s["a"] * s["p"] - s["b"] * s["q"],
    "travel": lambda s: s["v"] * s["t1"] + s["w"] * s["t2"],
    "travel_remaining": lambda s: s["distance"] - s["v"] * s["t1"] - s["w"] * s["t2"],
    "sharing": lambda s: (s["trays"] * s["per_tray"] - s["kept"]) // s["friends"],
    "savings": lambda s: s["start"] + s["weekly"] * s["weeks"] - s["spent"],
    "savings_goal": lambda s: (s["price"] - s["start"] - s["gift"]) // s["weekly"],
    "recipe": lambda s: s["grams"] // s["serves"] * s["guests"] - s["has"],
    "ages": lambda s: s["times"] * (s["age"] + s["older"]) + s["later"],
    "inventory": lambda s: s["boxes"] * s["per_box"] - s["sold1"] - s["sold2"] + s["delivered"],
}
# Divisions that must come out exact: (dividend, divisor) of each template that divides.
EXACT = {
    "share": lambda s: [(s["total"], s["friends"])],
    "unit_price": lambda s: [(s["total"], s["n"])],
    "sharing": lambda s: [(s["trays"] * s["per_tray"] - s["kept"], s["friends"])],
    "savings_goal": lambda s: [(s["price"] - s["start"] - s["gift"], s["weekly"])],
    "recipe": lambda s: [(s["grams"], s["serves"])],
}


STEP = re.compile(r"(\d+) ([-+×÷]) (\d+) = (-?\d+)\.")


def user_text(row) -> str:
    return row.messages[1]["content"]


def key(row) -> str:
    return word_problem_key(row.metadata["template"], row.metadata["numbers"])


@pytest.fixture(scope="module")
def sample():
    cfg = WordProblemsConfig(min_ops=1)
    return word_problem_prompts(cfg, "train", 4000) + word_problem_prompts(cfg, "test", 1000)


# ---------------------------------------------------------------------------------------------- splits


def test_splits_never_share_a_problem():
    cfg = WordProblemsConfig(min_ops=1)
    train = word_problem_prompts(cfg, "train", 20000)
    test_size = _split_size("test")
    test = word_problem_prompts(cfg, "test", test_size)  # the whole test split
    train_keys, test_keys = {key(r) for r in train}, {key(r) for r in test}
    assert len(train_keys) == 20000 and len(test_keys) == test_size == len(test)  # distinct within a split
    assert not train_keys & test_keys
    # The assignment is a hash of the canonical content alone, so no seed's train split meets the test split.
    other = word_problem_prompts(WordProblemsConfig(seed=11, min_ops=1, min_distractors=0), "train", 10000)
    assert not {key(r) for r in other} & test_keys
    assert all(split_of(key(r)) == "train" for r in train) and all(split_of(key(r)) == "test" for r in test)
    # About one problem in ten of every template is held out.
    per_template = Counter(r.metadata["template"] for r in test)
    assert set(per_template) == set(WORD_PROBLEM_TEMPLATES)
    for name, count in per_template.items():
        assert 0.07 < count / (count + _split_size("train", [name])) < 0.13, name


def _split_size(split: str, templates: list[str] | None = None) -> int:
    """Problems in a split, counted by asking for one more than exist: the error message states the count."""
    with pytest.raises(ValueError, match=rf"the {split} split has only (\d+) distinct") as info:
        word_problem_prompts(WordProblemsConfig(templates=templates or [], min_ops=1), split, 10**7)
    return int(re.search(r"has only (\d+) distinct", str(info.value)).group(1))


def test_mirror_images_are_one_problem():
    """Two purchases (or two legs of a trip) in the other order are the same problem: one canonical form."""
    cfg = WordProblemsConfig(
        templates=["shopping", "shopping_change", "travel", "travel_remaining", "inventory"]
    )
    rows = word_problem_prompts(cfg, "train", 3000)
    for row in rows:
        s = row.metadata["numbers"]
        if row.metadata["template"].startswith("shopping"):
            assert (s["a"], s["p"]) < (s["b"], s["q"])
        elif row.metadata["template"] == "inventory":
            assert s["sold1"] < s["sold2"]
        else:
            assert s["v"] < s["w"]
    # ... worded in both orders.
    shopping = [user_text(r) for r in rows if r.metadata["template"] == "shopping"]
    first_is_smaller = [
        (int(m[0]), int(m[1])) < (int(m[2]), int(m[3]))
        for m in (
            re.findall(r"buys (\d+) .*? for \$(\d+) each and (\d+) .*? for \$(\d+) each", t)[0]
            for t in shopping
        )
    ]
    assert any(first_is_smaller) and not all(first_is_smaller)


def test_deterministic_from_seed_and_prefix_stable():
    cfg = WordProblemsConfig(seed=3)
    rows = word_problem_prompts(cfg, "train", 400)
    assert rows == word_problem_prompts(WordProblemsConfig(seed=3), "train", 400)
    assert word_problem_prompts(cfg, "train", 150) == rows[:150]
    assert [user_text(r) for r in word_problem_prompts(WordProblemsConfig(seed=4), "train", 400)] != [
        user_text(r) for r in rows
    ]
    assert len({r.id for r in rows}) == 400 and rows[7].id == "word_problems-train-7"


def test_a_whole_split_can_be_drawn_exactly():
    cfg = WordProblemsConfig(templates=["travel"])
    size = _split_size("test", ["travel"])
    rows = word_problem_prompts(cfg, "test", size)
    assert len({key(r) for r in rows}) == size  # every problem once, none left over
    with pytest.raises(
        ValueError, match=rf"{size + 1} word problems requested but the test split has only {size}"
    ):
        word_problem_prompts(cfg, "test", size + 1)


# ---------------------------------------------------------------------------------------------- content


def test_answers_are_exact_positive_integers(sample):
    for row in sample:
        numbers, template = row.metadata["numbers"], row.metadata["template"]
        answer = ORACLE[template](numbers)
        assert row.answer == str(answer) and answer > 0
        # The worked solution: one "a op b = c." per operation, each right, then the answer in \boxed{}.
        boxed = row.completion.rsplit(" ", 1)[-1]
        assert boxed == f"\\boxed{{{answer}}}"
        found = STEP.findall(row.completion)
        assert len(found) == row.metadata["num_ops"], row.completion
        for a, op, b, c in found:
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "×": int(a) * int(b), "÷": int(a) / int(b)}[op] == int(c)
        assert found[-1][3] == str(answer)
        for dividend, divisor in EXACT.get(template, lambda s: [])(numbers):
            assert dividend % divisor == 0 and dividend > 0, (template, numbers)
        # Every stated number is in the text.
        stated = Counter(NUMBER.findall(user_text(row)))
        assert not Counter(str(v) for v in numbers.values()) - stated, (user_text(row), numbers)


def test_operations_within_bounds_and_config_filters_templates(sample):
    assert {r.metadata["num_ops"] for r in sample} == {1, 2, 3, 4}
    assert {r.metadata["template"] for r in sample} == set(WORD_PROBLEM_TEMPLATES)
    for row in sample:
        assert row.metadata["num_ops"] == WORD_PROBLEM_TEMPLATES[row.metadata["template"]].ops
    hard = word_problem_prompts(WordProblemsConfig(min_ops=4), "train", 300)
    assert {r.metadata["template"] for r in hard} == {"shopping_change", "travel_remaining", "inventory"}
    chosen = word_problem_prompts(WordProblemsConfig(templates=["ages", "recipe"], max_ops=3), "test", 300)
    assert {r.metadata["template"] for r in chosen} == {"ages", "recipe"}


def test_distractors_add_one_irrelevant_number_each(sample):
    counts = Counter(r.metadata["distractors"] for r in sample)
    assert set(counts) == {1, 2}  # the defaults: 1 to 2 per problem
    for row in sample:
        # Each distractor sentence states exactly one number, beside the problem's own numbers.
        assert (
            len(NUMBER.findall(user_text(row))) == len(row.metadata["numbers"]) + row.metadata["distractors"]
        )
    plain = word_problem_prompts(WordProblemsConfig(min_distractors=0, max_distractors=0), "train", 500)
    for row in plain:
        assert row.metadata["distractors"] == 0
        assert sorted(NUMBER.findall(user_text(row))) == sorted(
            str(v) for v in row.metadata["numbers"].values()
        )
    many = word_problem_prompts(WordProblemsConfig(min_distractors=4, max_distractors=4), "train", 200)
    assert all(r.metadata["distractors"] == 4 for r in many)
    assert all(len(NUMBER.findall(user_text(r))) == len(r.metadata["numbers"]) + 4 for r in many)


def test_rows_are_chat_rows_of_the_math_task(sample, tmp_path):
    for row in sample[:500]:
        assert row.prompt is None and row.task == "math" and row.tests is None
        system, user = row.messages
        assert system == {"role": "system", "content": WORD_PROBLEM_INSTRUCTION}
        assert user["role"] == "user" and user["content"].endswith("?")
        assert set(row.metadata) == {"source", "template", "num_ops", "distractors", "numbers"}
        assert row.metadata["source"] == "builtin:word_problems"
    assert "step by step" in WORD_PROBLEM_INSTRUCTION and "\\boxed{}" in WORD_PROBLEM_INSTRUCTION
    # The rows obey the dataset row schema: written as JSONL they load back unchanged.
    path = tmp_path / "wp.jsonl"
    fields = ("messages", "answer", "task", "id", "metadata")
    path.write_text("".join(json.dumps({f: getattr(r, f) for f in fields}) + "\n" for r in sample[:200]))
    loaded = load_prompts(path)
    assert [(r.messages, r.answer, r.task, r.id, r.metadata) for r in loaded] == [
        (r.messages, r.answer, r.task, r.id, r.metadata) for r in sample[:200]
    ]


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"templates": ["shoping"]}, r"data\.word_problems\.templates=\['shoping'\].*unknown: \['shoping'\]"),
        ({"templates": ["ages", "ages"]}, r"data\.word_problems\.templates=.*distinct"),
        ({"min_ops": 0}, r"data\.word_problems\.min_ops=0 must be between 1 and 4"),
        ({"max_ops": 5}, r"data\.word_problems\.max_ops=5 must be between 1 and 4"),
        (
            {"min_ops": 4, "max_ops": 3},
            r"data\.word_problems\.max_ops=3 is below data\.word_problems\.min_ops=4",
        ),
        ({"min_distractors": -1}, r"data\.word_problems\.min_distractors=-1 must be >= 0"),
        (
            {"min_distractors": 2, "max_distractors": 1},
            r"data\.word_problems\.max_distractors=1 must be between",
        ),
        ({"max_distractors": 5}, r"data\.word_problems\.max_distractors=5 must be between .* and 4"),
        (
            {"templates": ["ages"], "min_ops": 4},
            r"no template of data\.word_problems\.templates=\['ages'\] has",
        ),
    ],
)
def test_config_validation_names_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WordProblemsConfig(**kwargs)


def test_bad_requests():
    cfg = WordProblemsConfig(templates=["unit_price", "work_rate"])
    with pytest.raises(ValueError, match=r"data\.word_problems\.templates.*data\.num_train / data\.num_eval"):
        word_problem_prompts(cfg, "train", 10**6)
    with pytest.raises(ValueError, match="split='eval' must be 'train' or 'test'"):
        word_problem_prompts(cfg, "eval", 1)
    with pytest.raises(ValueError, match="n=-1"):
        word_problem_prompts(cfg, "train", -1)
    assert word_problem_prompts(cfg, "train", 0) == []


def test_a_builtin_source_configured_through_omegaconf():
    assert BUILTIN_TASKS["word_problems"].generate is word_problem_prompts
    merged = OmegaConf.merge(
        OmegaConf.structured(DataConfig),
        OmegaConf.from_dotlist(
            ["train=builtin:word_problems", "eval=builtin:word_problems", "num_train=60", "num_eval=30",
             "word_problems.templates=[savings,ages]", "word_problems.seed=2"]
        ),
    )  # fmt: skip
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg.word_problems, WordProblemsConfig) and cfg.word_problems.templates == [
        "savings",
        "ages",
    ]
    train, evaluation = load_split(cfg, "train"), load_split(cfg, "eval")
    assert {r.metadata.pop("data_source") for r in train + evaluation} == {"word_problems"}
    assert train == word_problem_prompts(cfg.word_problems, "train", 60)
    assert evaluation == word_problem_prompts(cfg.word_problems, "test", 30)
    with pytest.raises(ValueError, match=r"data\.word_problems\.max_ops"):
        OmegaConf.to_object(OmegaConf.merge(merged, OmegaConf.from_dotlist(["word_problems.max_ops=7"])))


# ---------------------------------------------------------------------------------------------- verifier


@pytest.fixture(scope="module")
def verifiers():
    """The math verifier as configs/smollm2-reasoning.yaml builds it (only \\boxed{} answers), and by default."""
    spec = load_config(SMOLLM2).rewards.verifiers[0]
    assert spec.name == "math" and spec.tasks == ["math"]
    return build_verifier("math", **dict(spec.params), timeout_s=3.0), build_verifier("math", timeout_s=3.0)


def _judge(verify, row, completion: str) -> bool:
    score = verify(VerifierInput(user_text(row), completion, row.answer, {**row.metadata, "task": row.task}))
    assert score.error is None
    return score.correct


@pytest.mark.parametrize(
    ("completion", "correct"),
    [
        ("\\boxed{{{a}}}", True),
        ("\\boxed{{{a}.0}}", True),  # math-verify: 42.0 = 42
        ("\\boxed{{\\${a}}}", True),  # a dollar sign in the box
        ("the answer is \\boxed{{{a}}} dollars", True),
        ("Step 1: add the costs. Step 2: subtract.\nSo the total is $\\boxed{{{a}}}$.", True),
        ("First I got \\boxed{{{b}}}, but rechecking gives \\boxed{{{a}}}", True),  # the last box counts
        ("\\boxed{{{b}}}", False),
        ("\\boxed{{\\${b}}}", False),
        ("The answer is {a}.", False),  # no box
        ("\\boxed{{}}", False),
        ("", False),
    ],
)
def test_math_verifier_judges_boxed_answers(sample, verifiers, completion, correct):
    boxed_only, default = verifiers
    rows = [r for r in sample if r.metadata["template"] in ("shopping", "ages", "recipe", "savings_goal")][:8]
    assert len({r.metadata["template"] for r in rows}) >= 2
    for row in rows:
        text = completion.format(a=row.answer, b=int(row.answer) + 1)
        assert _judge(boxed_only, row, text) is correct, text
        if "\\boxed" in text and text != "\\boxed{}":
            assert _judge(default, row, text) is correct, (
                text
            )  # the default extraction agrees on boxed answers


def test_default_math_extraction_also_reads_the_last_line(sample, verifiers):
    """Why the config sets extraction=[boxed]: by default an unboxed final line is judged too."""
    boxed_only, default = verifiers
    row = sample[0]
    assert _judge(default, row, f"The answer is {row.answer}.") is True
    assert _judge(boxed_only, row, f"The answer is {row.answer}.") is False


def test_worked_solutions_are_judged_correct(sample, verifiers):
    """The reply `trustbatch sft` teaches is itself a correct answer to the verifier RL uses."""
    boxed_only, _ = verifiers
    for row in sample[:200]:
        assert _judge(boxed_only, row, row.completion) is True, row.completion


def test_every_template_has_a_rendered_example():
    rows = word_problem_prompts(WordProblemsConfig(min_ops=1), "test", 800)
    by_template = {r.metadata["template"]: user_text(r) for r in rows}
    assert set(by_template) == set(WORD_PROBLEM_TEMPLATES)
    for text in by_template.values():
        assert "{" not in text and "}" not in text  # every blank filled
        assert not re.search(r"\b1 (hours|years)\b", text)


# The greedy answer of the step-21 checkpoint of the first 30-minute run, whose shaping term paid for any boxed
# number: it had learnt to box every number it wrote (and the last box, which math judges, was wrong).
GAMED = (
    "Quinn buys 5 pens for \\boxed{12} each, so she has \\boxed{12} pens.\nShe has 28 cousins, so she has "
    "\\boxed{28} cousins.\nThe total amount of money she spends is \\boxed{28} minutes * \\boxed{21} = 680 dollars."
)


@pytest.mark.parametrize(
    ("completion", "paid"),
    [
        ("5 * 6 = 30 and 7 * 2 = 14, so the total is \\boxed{44}.", True),
        ("\\boxed{44}", True),
        ("The answer is \\boxed{\\$1,200} dollars.\n", True),
        ("\\boxed{44} and then more reasoning without a box", True),  # one box, wherever it stands
        (GAMED, False),
        ("\\boxed{41} no wait \\boxed{44}", False),
        ("\\boxed{}", False),
        ("\\boxed{forty-four}", False),
        ("the answer is 44", False),
    ],
)
def test_the_configs_format_shaping_pays_for_exactly_one_boxed_number(completion, paid):
    spec = load_config(SMOLLM2).rewards.verifiers[1]
    assert spec.name == "format" and spec.weight < 1.0 and spec.params["full_match"] is True
    verify = build_verifier("format", **dict(spec.params))
    assert verify(VerifierInput("q", completion, "44", {"task": "math"})).reward == (1.0 if paid else 0.0)


def test_the_configs_format_pattern_refuses_box_spam_and_long_repetition_loops():
    """Repetition loops of boxes (where the gamed policy was heading) earn nothing, however long."""
    spec = load_config(SMOLLM2).rewards.verifiers[1]
    verify = build_verifier("format", **dict(spec.params))
    for spam in ("\\boxed{1} " * 6000, "\\boxed{1" * 8000, "\\boxed{1} " + "x" * 60000 + " \\boxed{2}"):
        assert verify(VerifierInput("q", spam, "1", {"task": "math"})).reward == 0.0


TRANSCRIPT = re.compile(r"```python\n(?P<program>.*?)\n```\n```output\n(?P<output>-?\d+)\n```\n\\boxed\{(?P<boxed>-?\d+)\}", re.S)


@pytest.mark.parametrize("solutions", ["tool", "tool_story", "tool_annotated"])
def test_tool_transcripts_print_the_answer_in_every_template(solutions):
    """Each row's program, run, prints its answer, and the output block and box say the same (both tool formats,
    every template, both orders of an `either_order` story); the programs are trustbatch's own, so `exec` runs
    them here."""
    rows = word_problem_prompts(WordProblemsConfig(min_ops=1, solutions=solutions), "train", 1600)
    assert {r.metadata["template"] for r in rows} == set(WORD_PROBLEM_TEMPLATES)
    for row in rows:
        assert row.messages[0]["content"] != WORD_PROBLEM_INSTRUCTION  # the instruction to use the tool
        match = TRANSCRIPT.fullmatch(row.completion)
        assert match, row.completion
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(match["program"], {})
        assert printed.getvalue() == f"{row.answer}\n" and match["output"] == match["boxed"] == row.answer, row


def test_a_story_program_takes_the_needed_numbers_in_the_storys_order():
    """tool_story: each number the answer needs appears once in the program and no distractor's number does; where
    a story states two groups in either order, the program takes them in the story's order (a swapped story swaps
    its program's lines); the state is named after the story's words."""
    rows = word_problem_prompts(WordProblemsConfig(min_ops=1, solutions="tool_story"), "train", 1600)
    swapped = 0
    for row in rows:
        program = TRANSCRIPT.fullmatch(row.completion)["program"]
        spec = WORD_PROBLEM_TEMPLATES[row.metadata["template"]]
        story, _, question = user_text(row).rpartition(". ")
        sentences = re.split(r"(?<=\.) ", story + ".")
        needed = [s for s in sentences if not any(_is_distractor(s, d) for d in spec.distractors)]
        stated = [int(n) for n in NUMBER.findall(" ".join(needed) + " " + question)]
        in_program = [int(n) for n in NUMBER.findall(program)]
        assert Counter(in_program) == Counter(stated), (user_text(row), program)
        if spec.either_order is not None:
            assert in_program == stated, (user_text(row), program)
            numbers, (first, second) = row.metadata["numbers"], spec.either_order
            a, b = numbers[first[0]], numbers[second[0]]
            swapped += a != b and stated.index(a) > stated.index(b)
    assert swapped > 0
    more = next(r for r in rows if r.metadata["template"] == "more")
    goods = next(g for g in ("notebooks", "pens", "apples", "sandwiches", "candles", "toy cars", "bags of rice",
                             "T-shirts") if g in user_text(more))  # fmt: skip
    assert TRANSCRIPT.fullmatch(more.completion)["program"].startswith(re.sub(r"\W+", "_", goods.lower()) + " = ")


def _is_distractor(sentence: str, distractor: str) -> bool:
    pattern = re.escape(distractor).replace(r"\{n\}", r"\d+")
    return re.fullmatch(re.sub(r"\\\{\w+\\\}", r".+", pattern), sentence) is not None


def test_an_unknown_solution_format_names_the_choices():
    with pytest.raises(ValueError, match=r"solutions='program': choose text, tool, tool_story or tool_annotated"):
        WordProblemsConfig(solutions="program")


def test_an_annotated_program_copies_every_sentence_above_its_code():
    """tool_annotated: the comments, in order, are the problem's sentences (distractors and question included);
    without them the program is the tool_story one; a distractor's comment has no code under it."""
    cfg = dict(min_ops=1, min_distractors=1, max_distractors=4)
    story = word_problem_prompts(WordProblemsConfig(**cfg, solutions="tool_story"), "train", 400)
    annotated = word_problem_prompts(WordProblemsConfig(**cfg, solutions="tool_annotated"), "train", 400)
    for plain, row in zip(story, annotated, strict=True):
        assert user_text(plain) == user_text(row)
        lines = TRANSCRIPT.fullmatch(row.completion)["program"].split("\n")
        comments = [line.removeprefix("# ") for line in lines if line.startswith("# ")]
        assert " ".join(comments) == user_text(row)
        assert [line for line in lines if not line.startswith("# ")] == (
            TRANSCRIPT.fullmatch(plain.completion)["program"].split("\n")
        )
        spec = WORD_PROBLEM_TEMPLATES[row.metadata["template"]]
        for i, line in enumerate(lines[:-1]):
            if line.startswith("# ") and any(_is_distractor(line[2:], d) for d in spec.distractors):
                assert lines[i + 1].startswith("# "), lines
