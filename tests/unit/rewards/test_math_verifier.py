"""Table-driven cases for the math verifier, on the real math-verify (never mocked)."""


import pytest

from rewards import VerifierInput, build_verifier
from rewards.math import extract_answer, last_answer_tag, last_boxed, last_line, looks_like_math


@pytest.fixture(scope="module")
def verify():
    return build_verifier("math", timeout_s=3.0)  # room for sympy's first calls on two busy cores


# (completion, gold, correct)
CASES = [
    # boxed answers
    ("The sum is \\boxed{14}.", "14", True),
    ("\\boxed{14}", "15", False),
    ("First \\boxed{3}, wait, recheck: \\boxed{4}", "4", True),  # the last \boxed wins
    ("First \\boxed{4}, wait, recheck: \\boxed{3}", "4", False),  # math-verify alone would take the first
    ("\\fbox{12}", "12", True),
    ("\\boxed {7}", "7", True),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),
    # fractions vs decimals
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", True),
    ("\\boxed{1/2}", "\\frac12", True),
    ("\\boxed{2}", "\\frac{1}{2}", False),  # looks right: the denominator
    ("\\boxed{0.333}", "\\frac{1}{3}", False),  # a truncated decimal is not 1/3
    ("\\boxed{0.3333333333}", "\\frac{1}{3}", True),  # within float_rounding=6
    # plain integers and negatives on the last line
    ("14", "14", True),
    ("Let me think.\n\n42\n", "42", True),
    ("-3", "-3", True),
    ("3", "-3", False),
    ("\\boxed{-7}", "-7", True),
    ("The answer is 14.", "14", True),
    ("Answer: 9", "9", True),
    ("**Final Answer:** 21", "21", True),
    ("so the result is 14", "14", True),
    ("1,000", "1000", True),
    ("x = 5", "5", True),
    ("<answer>7</answer>", "7", True),
    ("14\n15", "14", False),  # the last line is the answer
    # sets, intervals, tuples
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", True),
    ("\\boxed{\\{1,2,3\\}}", "\\{1,2\\}", False),
    ("\\boxed{(0,1]}", "(0,1]", True),
    ("\\boxed{(0,1)}", "(0,1]", False),
    ("\\boxed{[2, \\infty)}", "[2,\\infty)", True),
    # roots, constants, infinity
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{\\sqrt{2}}", "2", False),
    ("\\boxed{\\infty}", "\\infty", True),
    ("\\boxed{-\\infty}", "\\infty", False),
    ("$\\pi$", "\\pi", True),
    ("3.14", "\\pi", False),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
    # currency: an escaped dollar sign is a unit, not a math delimiter
    ("\\boxed{\\$42}", "42", True),
    ("\\boxed{\\$42.00}", "42", True),
    ("The total is \\boxed{\\$42}.", "43", False),
    ("$\\boxed{\\$42}$", "42", True),
    ("\\boxed{$42}", "42", True),
    # huge numbers
    ("\\boxed{10^{100}}", "10^{100}", True),
    ("\\boxed{10^{100}+1}", "10^{100}", False),
    ("\\boxed{123456789012345678901234567890}", "123456789012345678901234567890", True),
    # empty, garbage, malformed
    ("", "1", False),
    ("   \n\n  ", "1", False),
    (
        "\\boxed{\\frac{1}{2",
        "\\frac{1}{2}",
        False,
    ),  # unclosed \boxed: falls back to the last line, not parseable
    ("\\boxed{}", "0", False),
    ("}}}{{{\\\\\\frac", "1", False),
    ("I don't know.", "4", False),
    ("\x00\xff\ud7ff", "1", False),
    (
        "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
        "1",
        False,
    ),  # 5,000 nested braces: too long, not parsed
]


@pytest.mark.parametrize(
    ("completion", "gold", "correct"), CASES, ids=[f"{i}:{c[:30]!r}" for i, (c, _, _) in enumerate(CASES)]
)
def test_math_case(verify, completion, gold, correct):
    score = verify(VerifierInput("q", completion, gold, {}))
    assert score.error is None
    assert score.correct is correct
    assert score.reward == (1.0 if correct else 0.0)


def test_at_least_40_cases():
    assert len(CASES) >= 40


def test_numeric_reference_and_list_of_accepted_answers(verify):
    assert verify(VerifierInput("q", "\\boxed{14}", 14, {})).correct is True
    assert verify(VerifierInput("q", "\\boxed{0.5}", ["\\frac{1}{3}", "\\frac{1}{2}"], {})).correct is True


def test_missing_reference_is_an_error_not_a_wrong_answer(verify):
    score = verify(VerifierInput("q", "\\boxed{1}", None, {}))
    assert score.error is not None and "no reference" in score.error


def test_hanging_expression_is_stopped_by_the_time_limit():
    verify = build_verifier("math", timeout_s=0.5)
    score = verify(VerifierInput("q", "\\boxed{9^{9^{9^{9}}}}", "5", {}))  # would run for hours unstopped
    assert score.error is not None and score.error.startswith("timeout")
    # The timeout is cached: a second copy of the same answer is judged from the cache, not checked again.
    assert len(verify._verdicts) == 1
    again = verify(VerifierInput("q", "\\boxed{9^{9^{9^{9}}}}", "5", {}))
    assert again.error == score.error and len(verify._verdicts) == 1
    assert verify._verdicts.get_item(next(iter(verify._verdicts))) == (None, score.error)


def test_boxed_extraction_is_balanced_and_takes_the_last():
    assert last_boxed("\\boxed{\\frac{1}{2}} and \\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert last_boxed("\\boxed{1} \\boxed{2") == "1"  # the unclosed last one is skipped
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("\\boxed{\\boxed{1}}", "1"),  # the last-opened complete group
        ("}}} \\boxed{a{b}c} {{", "a{b}c"),  # stray braces outside do not matter
        ("\\fbox {x}", "x"),
        ("\\\\boxed{3}", "3"),
        ("\\boxed{", None),
        ("\\boxed{2} " + "\\boxed{x " * 500, "2"),  # a repetition loop of unclosed boxes after the answer
    ],
)
def test_boxed_extraction_edge_cases(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("text", "tag"),
    [
        ("<answer>1</answer> x <Answer>2</ANSWER>", "2"),
        ("<answer>1</answer><answer>2", "1"),
        ("<answer><answer>3</answer>", "<answer>3"),  # tags pair left to right, as a non-greedy regex would
        ("<answer>4</answer>" + "<answer>x " * 500, "4"),
        ("no tags", None),
    ],
)
def test_answer_tag_extraction(text, tag):
    assert last_answer_tag(text) == tag


def test_only_the_tail_is_scanned():
    text = "\\boxed{7}" + " filler" * 20_000
    assert extract_answer(text, ["boxed"]) == ("boxed", "7")
    assert extract_answer(text, ["boxed"], max_scan_chars=1000) is None
    assert extract_answer(text + "\\boxed{8}", ["boxed"], max_scan_chars=1000) == ("boxed", "8")
    with pytest.raises(ValueError, match="max_scan_chars"):
        build_verifier("math", max_scan_chars=0)


def test_last_line_drops_answer_prefix_and_period():
    assert last_line("work\n\nThe answer is 14.\n") == "14"
    assert last_line("Answer: \\frac{3}{4}") == "\\frac{3}{4}"
    assert last_line("3.5") == "3.5"
    assert last_line("") is None


def test_extraction_order_is_configurable():
    text = "\\boxed{1}\nso 2"
    assert extract_answer(text, ["boxed", "last_line"]) == ("boxed", "1")
    assert extract_answer(text, ["last_line", "boxed"]) == ("last_line", "so 2")
    assert looks_like_math("x^2 + \\frac{1}{2}") and not looks_like_math("so 2")


def test_math_verify_own_extraction_is_available_and_differs_on_several_boxed(verify):
    own = build_verifier("math", extraction=["latex"])
    sample = VerifierInput("q", "\\boxed{4} then \\boxed{3}", "3", {})
    # math-verify 0.9 merges several \boxed{} into one set {3, 4}, which equals neither answer; ours takes the last.
    assert own(sample).correct is False
    assert verify(sample).correct is True
    assert own(VerifierInput("q", "We get $\\frac{1}{2}$", "0.5", {})).correct is True


def test_bad_params_fail_at_build_time():
    with pytest.raises(ValueError, match="extraction"):
        build_verifier("math", extraction=["boxd"])
    with pytest.raises(ValueError, match="unknown parameter"):
        build_verifier("math", timeout=3)


@pytest.mark.parametrize(
    ("answer", "gold"),
    [("7", "7"), ("07", "7"), ("-0", "0"), ("+5", "5"), ("-12", "-12"), ("12", "-12"), ("10", "1"),
     ("123456789012345678901234567890", "123456789012345678901234567890"), ("100", "1000")],
)
def test_integer_fast_path_agrees_with_math_verify(verify, answer, gold):
    """Integer-vs-integer answers skip math-verify; the verdict must be the one math-verify gives."""
    import math_verify

    expected = math_verify.verify(math_verify.parse(f"${gold}$"), math_verify.parse(f"${answer}$"))
    assert verify(VerifierInput("", answer, gold, {})).correct is bool(expected)


@pytest.mark.parametrize(
    ("completion", "gold", "default", "numeric"),
    [
        ("2+7", "9", True, False),  # the question echoed back: equal symbolically, not an answer
        ("3*3", "9", True, False),
        ("9", "9", True, True),
        ("-4", "-4", True, True),
        ("0.5", "1/2", True, True),
        ("1/2", "0.5", True, True),
        ("\\frac{1}{2}", "0.5", True, True),
        ("\\boxed{9}", "9", True, True),
        ("x", "9", False, False),
    ],
)
def test_numeric_answer_rejects_expressions(completion, gold, default, numeric):
    plain = build_verifier("math")
    strict = build_verifier("math", numeric_answer=True)
    assert plain(VerifierInput("", completion, gold, {})).correct is default
    score = strict(VerifierInput("", completion, gold, {}))
    assert score.correct is numeric and score.reward == float(numeric)
