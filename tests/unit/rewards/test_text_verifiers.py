"""The format verifier's default pattern: the same verdicts as the plain ``\\boxed\\{.+\\}`` it replaces."""

import re

import pytest

from rewards import VerifierInput, build_verifier

PLAIN = re.compile(r"\\boxed\{.+\}", re.DOTALL)
TEXTS = [
    "\\boxed{1}",
    "The answer is \\boxed{5}",
    "x \\boxed{} y}",
    "\\boxed{}",
    "\\boxed{1",
    "a \\boxed{ \\boxed{2}",
    "\\boxed{\n}",
    "\\boxed{5} and more",
    "no box at all",
    "\\boxed {1}",
]


@pytest.mark.parametrize("full_match", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_default_pattern_agrees_with_the_plain_regex(text, full_match):
    verify = build_verifier("format", full_match=full_match)
    expected = PLAIN.fullmatch(text.strip()) if full_match else PLAIN.search(text.strip())
    assert verify(VerifierInput("", text, None, {})).reward == float(bool(expected))


def test_a_repetition_loop_is_judged_and_only_the_tail_is_searched():
    verify = build_verifier("format", max_scan_chars=1000)
    loop = "\\boxed{x " * 100_000  # quadratic for the plain regex: minutes; here one pass
    assert verify(VerifierInput("", loop, None, {})).reward == 0.0
    assert verify(VerifierInput("", loop + "\\boxed{1}", None, {})).reward == 1.0
    assert verify(VerifierInput("", "\\boxed{1}" + " " * 2000 + "x", None, {})).reward == 0.0  # outside the tail
