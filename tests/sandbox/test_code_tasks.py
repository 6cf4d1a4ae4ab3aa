"""Code tasks graded in the real sandbox, on every backend this machine has: builtin:python_functions (each
template's reference solution passes, wrong code and a missing code block do not), and HumanEval files
(data.format=humaneval: a small fixture here, and the real 164 problems when `make humaneval` has cached them)."""

import gzip
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from app.data import DatasetError, load_prompts
from app.data.tasks import FUNCTION_TEMPLATES, PythonFunctionsConfig, python_function_prompts
from app.fetch import humaneval_path
from rewards import RewardsConfig, VerifierInput, build_verifier
from rewards.config import VerifierSpec
from rewards.runner import RewardRunner

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "humaneval_small.jsonl"


def fenced(code: str) -> str:
    return f"Here is the function:\n```python\n{code}```\nIt works."


@pytest.fixture
def verify(backend):
    return build_verifier("code", backend=backend, require_code_block=True)


def score(verify, row, completion):
    return verify(VerifierInput(prompt="", completion=completion, reference=row.tests, metadata=row.metadata))


def graded(verify, pairs: list) -> list:
    """Scores of (row, completion) pairs, two at a time (one per core), as the reward runner's threads call it."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda pair: score(verify, *pair), pairs))


def one_problem_per_template() -> list:
    """The first problem of each template, from whichever split holds one (a one-problem template has one)."""
    rows = []
    for name in FUNCTION_TEMPLATES:
        cfg = PythonFunctionsConfig(templates=[name])
        for split in ("test", "train"):
            try:
                rows += python_function_prompts(cfg, split, 1)
                break
            except ValueError:  # this split has none of the template's problems
                continue
    return rows


def test_every_templates_reference_solution_passes_in_the_sandbox_and_wrong_code_does_not(verify):
    rows = one_problem_per_template()
    assert len(rows) == len(FUNCTION_TEMPLATES)
    for row, right in zip(rows, graded(verify, [(row, fenced(row.metadata["solution"])) for row in rows]), strict=True):
        assert right.correct and right.reward == 1.0, (row.metadata["key"], right.breakdown)
        assert right.breakdown["extracted"] is not None
    # A constant function: the tests cover at least two values, so it passes at most some of them.
    for row in rows[:10]:
        name = row.messages[0]["content"].split("`")[1]
        wrong = score(verify, row, fenced(f"def {name}:\n    return {row.tests[0]['code'].split(' == ')[1].split(',')[0]}\n"))
        assert not wrong.correct and wrong.reward < 1.0, row.metadata["key"]


def test_a_completion_without_a_code_block_is_a_format_failure_counted_apart(backend):
    [row] = python_function_prompts(PythonFunctionsConfig(templates=["times_k"]), "train", 1)
    plain = row.metadata["solution"]  # right code, but not in a fenced block as the prompt asks
    strict = build_verifier("code", backend=backend, require_code_block=True)
    lenient = build_verifier("code", backend=backend)
    miss = score(strict, row, plain)
    assert miss.reward == 0.0 and miss.error is None
    assert miss.breakdown["reason"] == "no code block" and miss.breakdown["extracted"] is None
    assert score(lenient, row, plain).correct  # without require_code_block the whole text is the program

    spec = VerifierSpec(name="code", tasks=["code"], params={"backend": backend, "require_code_block": True})
    runner = RewardRunner(RewardsConfig(verifiers=[spec], num_workers=0))
    inputs = [VerifierInput("", text, row.tests, {}) for text in (plain, fenced(plain), fenced("x = 1\n"))]
    scores, metrics = runner.score(inputs, ["code"] * 3)
    assert [s.reward for s in scores] == [0.0, 1.0, 0.0]
    assert metrics["reward/code/answer_rate"] == pytest.approx(2 / 3)  # the no-block sample, counted apart
    assert metrics["reward/code/correct"] == pytest.approx(1 / 3)


# ---------------------------------------------------------------------------------------------- HumanEval


def canonical(raw: dict) -> str:
    """The problem's canonical solution as a chat answer: the function from its `def` line, without imports."""
    prompt = raw["prompt"]
    return fenced(prompt[prompt.index(f"def {raw['entry_point']}") :] + raw["canonical_solution"])


def test_humaneval_rows_pose_the_function_and_grade_it_with_check_and_the_prompts_prelude(verify):
    rows = load_prompts(FIXTURE, "humaneval")
    raws = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert [r.id for r in rows] == ["Fixture/0", "Fixture/1", "Fixture/2"]
    for row, raw in zip(rows, raws, strict=True):
        [message] = row.messages
        assert raw["prompt"].strip() in message["content"] and "```python block" in message["content"]
        [test] = row.tests
        assert test["code"].rstrip().endswith(f"check({raw['entry_point']})") and row.task == "code"
        assert row.metadata["entry_point"] == raw["entry_point"] and "canonical_solution" in row.metadata
        # The canonical solution passes, though the answer omits the imports and helpers the prompt gives
        # (List, shift()): the prelude runs first, as in HumanEval's own harness.
        result = score(verify, row, canonical(raw))
        assert result.correct, (row.id, result.breakdown)
    assert rows[0].tests[0]["prelude"].strip() == "from typing import List"
    assert "def shift(" in rows[1].tests[0]["prelude"]
    assert "prelude" not in rows[2].tests[0]  # nothing before its def
    wrong = score(verify, rows[2], fenced("def middle(numbers):\n    return numbers[0]\n"))
    assert not wrong.correct and wrong.breakdown["failed"][0]["why"] == "wrong_answer"


def test_humaneval_reads_gzip_and_refuses_bad_rows_with_file_line_field_and_fix(tmp_path):
    gz = tmp_path / "he.jsonl.gz"
    gz.write_bytes(gzip.compress(FIXTURE.read_bytes()))
    assert [r.id for r in load_prompts(gz, "humaneval")] == ["Fixture/0", "Fixture/1", "Fixture/2"]

    raws = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    del raws[1]["test"]
    raws[2]["prompt"] = "def other():\n    pass\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in raws) + "\n")
    with pytest.raises(DatasetError) as err:
        load_prompts(bad, "humaneval")
    message = str(err.value)
    assert f"{bad}: line 2: field 'test' must be a non-empty string" in message and "HumanEval rows hold" in message
    assert f"{bad}: line 3: field 'prompt' does not define the entry point: no line 'def middle('" in message

    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gz.read_bytes()[:40])
    with pytest.raises(DatasetError, match="not a complete gzip file"):
        load_prompts(cut, "humaneval")


@pytest.mark.slow
def test_all_164_humaneval_canonical_solutions_pass_the_sandboxed_grader(backend):
    """The real HumanEval (`make humaneval`): every canonical solution passes, so the grader is fair."""
    path = humaneval_path()
    if not path.is_file():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"no {path}; CI runs `make humaneval` before the tests, so it must be there")
        pytest.skip(f"no {path}; fetch it with: make humaneval")
    rows = load_prompts(path, "humaneval")
    raws = [json.loads(line) for line in gzip.open(path, "rt")]
    assert len(rows) == 164
    verify = build_verifier("code", backend=backend, require_code_block=True, wall_s=10.0, cpu_s=10.0)
    scores = graded(verify, [(row, canonical(raw)) for row, raw in zip(rows, raws, strict=True)])
    failed = [row.id for row, got in zip(rows, scores, strict=True) if not got.correct]
    assert not failed
