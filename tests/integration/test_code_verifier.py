"""The code verifier: program extraction, test formats, and real sandbox runs (skipped with no backend)."""

import pytest

from rewards import VerifierInput, build_verifier
from rewards.code import extract_program, outputs_match, parse_tests

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.mark.parametrize(
    ("text", "program"),
    [
        ("Here:\n```python\nprint(1)\n```\nand better:\n```python\nprint(2)\n```\n", "print(2)\n"),
        ("```py\nx = 1\n```", "x = 1\n"),
        ("```\nprint(3)\n```", "print(3)\n"),
        ("```bash\nls\n```\n```python\nprint(4)\n```", "print(4)\n"),
        ("```bash\nls\n```", "```bash\nls\n```"),  # no python block: the whole text
        ("print(5)", "print(5)"),
        ("", ""),
    ],
)
def test_extract_program(text, program):
    assert extract_program(text) == program


def test_parse_tests_accepts_the_documented_shapes():
    want = [{"stdin": "1 2\n", "stdout": "3\n"}]
    assert parse_tests(want) == want
    assert parse_tests({"tests": want}) == want
    assert parse_tests('[{"input": "1 2\\n", "output": "3\\n"}]') == want
    assert parse_tests({"inputs": ["1 2\n"], "outputs": ["3\n"]}) == want
    assert parse_tests([{"code": "assert f(1) == 2"}]) == [{"code": "assert f(1) == 2"}]


@pytest.mark.parametrize("bad", [None, [], "not json", [{"stdin": "1"}], ["assert 1"]])
def test_parse_tests_rejects_malformed(bad):
    with pytest.raises(ValueError):
        parse_tests(bad)


def test_output_comparison_modes():
    assert outputs_match("3\n", "3", "lines") and outputs_match("a b  \nc\n\n", "a b\nc", "lines")
    assert not outputs_match("3\n", "3", "exact") and outputs_match("1 2\n3", "1\n2 3", "tokens")
    assert not outputs_match("3", "4", "lines")


def test_bad_params_fail_at_build_time():
    with pytest.raises(ValueError, match="mode"):
        build_verifier("code", mode="most")
    with pytest.raises(ValueError, match="unknown parameter"):
        build_verifier("code", timeout=3)


# ---------------------------------------------------------------- real sandbox runs


@pytest.fixture(scope="module")
def backend():
    sandbox = pytest.importorskip("sandbox")
    reasons = sandbox.available_backends()
    for name in ("bwrap", "docker"):  # bwrap first: about 30 ms a run against 150+ ms for docker exec
        if reasons.get(name) is None:
            return name
    pytest.skip(f"no sandbox backend on this machine: {reasons}")


@pytest.fixture(scope="module")
def verify(backend):
    return build_verifier("code", backend=backend, wall_s=2.0, cpu_s=2.0, memory_mb=256)


def run(verify, completion, tests):
    return verify(VerifierInput("write it", completion, tests, {"task": "code"}))


def test_stdin_stdout_tests_pass(verify):
    score = run(
        verify,
        f"```python\n{ADD}```",
        [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 5", "stdout": "10"}],
    )
    assert (score.reward, score.correct, score.error) == (1.0, True, None)
    assert score.breakdown["passed"] == 2 and score.breakdown["failed"] == []


def test_fraction_reward_and_the_failed_tests_with_reasons(verify):
    tests = [
        {"stdin": "1 2", "stdout": "3"},
        {"stdin": "1 2", "stdout": "4"},
        {"stdin": "x y", "stdout": "0"},
    ]
    score = run(verify, ADD, tests)
    assert score.reward == pytest.approx(1 / 3) and score.correct is False
    failed = {f["test"]: f for f in score.breakdown["failed"]}
    assert failed[1]["why"] == "wrong_answer" and "expected '4'" in failed[1]["detail"]
    assert failed[2]["why"] == "error" and "ValueError" in failed[2]["detail"]


def test_assert_style_tests(verify):
    program = "def square(x):\n    return x * x\n"
    tests = [{"code": "assert square(2) == 4"}, {"code": "assert square(3) == 10"}]
    score = run(verify, f"```python\n{program}```", tests)
    assert score.reward == 0.5
    assert score.breakdown["failed"] == [{"test": 1, "why": "wrong_answer", "detail": "AssertionError"}]


def test_all_or_nothing_mode_with_fail_fast(backend):
    verify = build_verifier("code", backend=backend, mode="all", fail_fast=True, wall_s=2.0)
    tests = [{"stdin": "1 1", "stdout": "3"}, {"stdin": "1 2", "stdout": "3"}]
    score = run(verify, ADD, tests)
    assert score.reward == 0.0 and score.breakdown["passed"] == 0 and len(score.breakdown["failed"]) == 1
    assert run(verify, ADD, [{"stdin": "1 2", "stdout": "3"}]).reward == 1.0


def test_infinite_loop_is_a_timeout(backend):
    verify = build_verifier("code", backend=backend, wall_s=0.5, cpu_s=0.5)
    score = run(verify, "while True:\n    pass\n", [{"stdin": "", "stdout": "1"}])
    assert score.reward == 0.0 and score.breakdown["failed"][0]["why"] == "timeout"


def test_memory_bomb_is_a_memory_failure(verify):
    score = run(verify, "x = bytearray(1 << 30)\nprint(1)\n", [{"stdin": "", "stdout": "1"}])
    assert score.reward == 0.0 and score.breakdown["failed"][0]["why"] == "memory"


def test_no_program_and_bad_tests(verify):
    empty = run(verify, "   ", [{"stdin": "", "stdout": "1"}])
    assert empty.reward == 0.0 and empty.error is None and empty.breakdown["reason"] == "no program"
    bad = run(verify, "print(1)", [{"stdin": "1"}])
    assert bad.error is not None and "bad tests" in bad.error


def test_code_verifier_in_the_reward_pool(backend):
    from rewards import RewardsConfig, VerifierSpec
    from rewards.runner import RewardRunner

    cfg = RewardsConfig(
        verifiers=[VerifierSpec(name="code", tasks=["code"], params={"backend": backend, "wall_s": 2.0})],
        num_workers=1,
    )
    tests = [{"stdin": "2 3", "stdout": "5"}]
    with RewardRunner(cfg) as runner:
        scores, metrics = runner.score(
            [
                VerifierInput("p", ADD, tests, {"task": "code"}),
                VerifierInput("p", "print(0)", tests, {"task": "code"}),
            ]
        )
    assert [s.reward for s in scores] == [1.0, 0.0]
    assert metrics["reward/code/correct"] == 0.5 and metrics["reward/error_rate"] == 0.0
