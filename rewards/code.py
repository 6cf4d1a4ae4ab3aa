"""Code answers run in the sandbox against the sample's tests.

The program is the last fenced ```python block of the completion (else the last unlabelled fenced block, else
the whole text; with ``require_code_block`` a completion without a fenced block scores 0 as a format failure,
``"reason": "no code block"``, counted apart from wrong code). The breakdown's ``extracted`` says whether a
program was found (the answer rate of evaluations). ``reference`` holds the tests, as a list (or
``{"tests": [...]}``, or that as a JSON string):

- ``{"stdin": "1 2\\n", "stdout": "3\\n"}``: run the program with this input; its output must match.
  ``input``/``output`` are accepted as aliases.
- ``{"code": "assert add(2, 2) == 4"}``: run after the program, in its namespace, by a grader inside the sandbox
  (rewards/code_harness.py); an optional ``"prelude"`` (the problem's own imports and helper functions, such as
  HumanEval's) runs before the program in the same namespace. It passes only when that grader saw the test's
  last statement finish and says so with this run's secret nonce: exiting early, exit hooks, signal handlers and
  threads cannot earn it. The test code (and prelude) must be a non-empty string that compiles; anything else is
  a bad reference (``Score.error``).

Each stdin test is one sandbox execution with its own limits (``wall_s``, ``cpu_s``, ``memory_mb``); a
completion's assert tests share one execution of the grader (``batch_tests``, the default: limits ``wall_s``
and ``cpu_s`` times their number), or take one each (``batch_tests: false``). The reward is the
fraction of tests passed (``mode: fraction``) or 1.0 only when all pass (``mode: all``); the breakdown lists
each failed test with why: ``wrong_answer``, ``error``, ``early_exit`` (the run ended before a code test
finished), ``timeout``, ``memory`` or ``output_limit``. Completions longer than ``max_completion_chars`` are
judged wrong unread, which bounds the (linear) program extraction. The code is
never run outside ``sandbox.execute``; a sandbox that cannot run at all is a ``Score.error``, not a wrong answer.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from rewards.registry import config_from_params, register
from rewards.types import Score, Verifier, VerifierInput

_FENCE_TAG = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")
_PYTHON_TAGS = {"python", "py", "python3"}
_HARNESS = (Path(__file__).parent / "code_harness.py").read_text()
_VERDICT = re.compile(r"\x00trustbatch-test ([0-9a-f]{32}) (\d+) (pass|fail assertion|fail exit|fail error)\n")
_TEST_START = re.compile(r"\n\x00trustbatch-test-start (\d+)\n")


@dataclass
class CodeVerifierConfig:
    """Parameters of the ``code`` verifier (``rewards.verifiers[i].params``)."""

    mode: Literal["fraction", "all"] = "fraction"
    """``fraction``: reward = tests passed / tests; ``all``: 1.0 only when every test passes."""
    wall_s: float = 5.0
    """Wall-clock limit of one test run (sandbox ``Limits.wall_s``)."""
    cpu_s: float = 5.0
    """CPU-time limit of one test run (sandbox ``Limits.cpu_s``)."""
    memory_mb: int = 512
    """Memory limit of one test run (sandbox ``Limits.memory_mb``)."""
    max_output_bytes: int = 1 << 20
    """Cap on each of stdout and stderr of one test run."""
    backend: str = "auto"
    """Sandbox backend passed to ``sandbox.execute``: auto, docker or bwrap."""
    sandbox: dict[str, Any] = field(default_factory=dict)
    """If set, fields of ``sandbox.SandboxConfig`` applied with ``sandbox.configure`` in every process that
    builds this verifier (reward workers do not inherit the parent's sandbox configuration)."""
    fail_fast: bool = False
    """Stop at the first failing test and skip the rest (they count as failed): saves sandbox time where partial
    credit is not wanted, e.g. with ``mode: all``."""
    compare: Literal["lines", "exact", "tokens"] = "lines"
    """stdout comparison: ``lines`` ignores trailing whitespace per line and trailing blank lines; ``exact``
    compares the text as is; ``tokens`` compares whitespace-separated tokens."""
    max_program_chars: int = 100_000
    """A longer extracted program is not run (judged wrong)."""
    max_completion_chars: int = 1_000_000
    """A longer completion is judged wrong without being searched for a program."""
    batch_tests: bool = True
    """Run all the assert tests of a completion in one sandbox execution (one grader process; its time limits
    are ``wall_s`` and ``cpu_s`` times the number of tests): one start-up instead of one per test, about 3x
    fewer executions with 3 tests. The tests then share the program's process, so state a program keeps from
    one test to the next carries over; ``false`` gives each test its own execution."""
    require_code_block: bool = False
    """Only a fenced block counts as the program: a completion without one scores 0 unrun, as a format failure
    (``reason: no code block``, ``extracted: None``) rather than as wrong code. Off: the whole text is the
    program when it has no fenced block."""
    max_failures_reported: int = 10
    """Failed tests listed in the breakdown (the count is always complete)."""

    def __post_init__(self) -> None:
        if self.mode not in ("fraction", "all"):
            raise ValueError(f"code verifier params.mode={self.mode!r} must be 'fraction' or 'all'")
        if self.compare not in ("lines", "exact", "tokens"):
            raise ValueError(
                f"code verifier params.compare={self.compare!r} must be 'lines', 'exact' or 'tokens'"
            )
        if self.backend not in ("auto", "docker", "bwrap", "none"):
            raise ValueError(
                f"code verifier params.backend={self.backend!r} must be one of auto, docker, bwrap (or none, "
                "which needs sandbox.allow_unsandboxed)"
            )
        for name in (
            "wall_s",
            "cpu_s",
            "memory_mb",
            "max_output_bytes",
            "max_program_chars",
            "max_completion_chars",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"code verifier params.{name}={getattr(self, name)!r} must be > 0")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(tag, body)`` of each fenced block: a ``` opener, its tag up to the end of that line, the body up to the
    next ```. One forward pass of ``str.find`` (linear in the text; a regex here was quadratic on "```python "
    repeated without a newline, inside C code that no time limit can interrupt)."""
    blocks = []
    pos = 0
    while (start := text.find("```", pos)) >= 0:
        newline = text.find("\n", start + 3)
        if newline < 0:
            break
        end = text.find("```", newline + 1)
        if end < 0:
            break
        tag = _FENCE_TAG.match(text, start + 3, newline).group(1)
        blocks.append((tag, text[newline + 1 : end]))
        pos = end + 3
    return blocks


def extract_program(text: str, *, require_block: bool = False) -> str | None:
    """The last fenced python block, else the last unlabelled fenced block, else the whole text (None instead
    with ``require_block``)."""
    blocks = fenced_blocks(text or "")
    for wanted in (lambda tag: tag.lower() in _PYTHON_TAGS, lambda tag: tag == ""):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            return chosen[-1]
    return None if require_block else text or ""


def parse_tests(reference: Any) -> list[dict[str, str]]:
    """Normalise a reference into a list of tests ``{"stdin", "stdout"}`` or ``{"code"}``; ValueError if malformed."""
    if isinstance(reference, str):
        try:
            reference = json.loads(reference)
        except json.JSONDecodeError as e:
            raise ValueError(f"tests are a string but not JSON ({e})") from e
    if isinstance(reference, dict):
        if "tests" in reference:
            reference = reference["tests"]
        elif "inputs" in reference and "outputs" in reference:  # APPS-style columns
            reference = [
                {"stdin": i, "stdout": o}
                for i, o in zip(reference["inputs"], reference["outputs"], strict=True)
            ]
        else:
            reference = [reference]
    if not isinstance(reference, (list, tuple)) or not reference:
        raise ValueError(f"expected a non-empty list of tests, got {type(reference).__name__}")
    tests = []
    for i, test in enumerate(reference):
        if not isinstance(test, dict):
            raise ValueError(f"test {i} is {type(test).__name__}, not a dict")
        if "code" in test:
            parsed = {"code": _test_code(i, test["code"])}
            prelude = test.get("prelude")
            if prelude is not None and not (isinstance(prelude, str) and not prelude.strip()):  # blank = none
                parsed["prelude"] = _test_code(i, test["prelude"], "prelude")
            tests.append(parsed)
            continue
        stdin = test.get("stdin", test.get("input"))
        stdout = test.get("stdout", test.get("output"))
        if stdout is None:
            raise ValueError(f"test {i} has neither 'code' nor 'stdout' (keys: {sorted(test)})")
        tests.append({"stdin": "" if stdin is None else str(stdin), "stdout": str(stdout)})
    return tests


def _test_code(i: int, code: Any, key: str = "code") -> str:
    """A code test's source (or prelude), checked: a non-empty string that compiles (else the reference is bad)."""
    if not isinstance(code, str) or not code.strip():
        raise ValueError(f"test {i} has {key!r} {code!r}: it must be a non-empty string of Python statements")
    try:
        compile(code, f"<test {i}>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        raise ValueError(f"test {i}'s {key} does not compile ({type(e).__name__}: {e})") from e
    return code


def outputs_match(expected: str, actual: str, compare: str) -> bool:
    if compare == "exact":
        return expected == actual
    if compare == "tokens":
        return expected.split() == actual.split()
    clean = lambda text: "\n".join(line.rstrip() for line in text.rstrip().splitlines())  # noqa: E731
    return clean(expected) == clean(actual)


def _tail(text: str, limit: int = 200) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "")[-limit:]


class CodeVerifier:
    """Runs the extracted program once per test in the sandbox; see the module docstring."""

    def __init__(self, cfg: CodeVerifierConfig) -> None:
        try:
            import sandbox
        except ImportError as e:  # pragma: no cover - sandbox ships with trustbatch
            raise ValueError(f"the code verifier needs the sandbox package ({e})") from e
        if cfg.sandbox:
            sandbox.configure(sandbox.SandboxConfig(**cfg.sandbox))
        self.cfg = cfg
        self._sandbox = sandbox
        self._limits = sandbox.Limits(
            wall_s=cfg.wall_s, cpu_s=cfg.cpu_s, memory_mb=cfg.memory_mb, max_output_bytes=cfg.max_output_bytes
        )

    def _run_code_tests(self, program: str, tests: list[dict[str, str]]) -> list[tuple[str | None, str]]:
        """Assert tests sharing one prelude, in one sandbox run of the grader: ``(None, "")`` for each test that
        passed, else ``(why, detail)``; with ``fail_fast``, up to the first failure."""
        nonce = secrets.token_hex(16)
        if "prelude" in tests[0]:
            program = f"{tests[0]['prelude'].rstrip()}\n\n\n{program}"
        n = len(tests)
        job = json.dumps(
            {"nonce": nonce, "program": program, "tests": [t["code"] for t in tests], "fail_fast": self.cfg.fail_fast}
        )
        limits = replace(self._limits, wall_s=self.cfg.wall_s * n, cpu_s=self.cfg.cpu_s * n)
        result = self._sandbox.execute(_HARNESS, stdin=job, limits=limits, backend=self.cfg.backend)
        verdicts: dict[int, list[str]] = {}
        for got, index, word in _VERDICT.findall(result.stdout):
            if got == nonce:
                verdicts.setdefault(int(index), []).append(word)
        parts = _TEST_START.split(result.stderr or "")  # [before test 0, "0", test 0's stderr, "1", ...]
        stderr_of = {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}
        out: list[tuple[str | None, str]] = []
        for i in range(n):
            found = verdicts.get(i, [])
            if found == ["pass"]:
                out.append((None, ""))
                continue
            if len(found) == 1:
                why = {"fail assertion": "wrong_answer", "fail exit": "early_exit"}.get(found[0], "error")
                out.append((why, _tail(stderr_of.get(i, parts[0])) or f"exit code {result.exit_code}"))
            else:  # no verdict: the run ended before this test did
                out.append(self._run_ended(result, limits))
            if self.cfg.fail_fast:
                break
        return out

    def _run_ended(self, result: Any, limits: Any) -> tuple[str, str]:
        """Why a run ended before a test's verdict: its limits, else an early exit."""
        if result.timed_out:
            return "timeout", f"no result within {limits.wall_s:g} s wall / {limits.cpu_s:g} s CPU"
        if result.memory_exceeded:
            return "memory", f"exceeded {self.cfg.memory_mb} MB"
        if result.output_truncated:
            return "output_limit", f"output passed {self.cfg.max_output_bytes} bytes"
        return "early_exit", f"the run ended before the test finished (exit code {result.exit_code})"

    def _run_stdin_test(self, program: str, test: dict[str, str]) -> tuple[str | None, str]:
        """``(None, "")`` when the program's output on the test's stdin matches, else ``(why, detail)``."""
        result = self._sandbox.execute(program, stdin=test["stdin"], limits=self._limits, backend=self.cfg.backend)
        if result.timed_out or result.memory_exceeded or result.output_truncated:
            return self._run_ended(result, self._limits)
        if result.exit_code != 0:
            return "error", _tail(result.stderr) or f"exit code {result.exit_code}"
        if not outputs_match(test["stdout"], result.stdout, self.cfg.compare):
            return "wrong_answer", f"expected {test['stdout'][:80]!r}, got {result.stdout[:80]!r}"
        return None, ""

    def _run_tests(self, program: str, tests: list[dict[str, str]]) -> list[tuple[str | None, str]]:
        """Each test's result in order (with ``fail_fast``, up to the first failure): stdin tests one execution
        each; assert tests one execution per run of consecutive tests with the same prelude (``batch_tests``),
        else one each."""
        groups: list[list[dict[str, str]]] = []
        for test in tests:
            last = groups[-1][-1] if groups else None
            if (
                self.cfg.batch_tests
                and last is not None
                and "code" in test
                and "code" in last
                and test.get("prelude") == last.get("prelude")
            ):
                groups[-1].append(test)
            else:
                groups.append([test])
        out: list[tuple[str | None, str]] = []
        for group in groups:
            if "code" in group[0]:
                out += self._run_code_tests(program, group)
            else:
                out.append(self._run_stdin_test(program, group[0]))
            if self.cfg.fail_fast and any(why is not None for why, _ in out):
                break
        return out

    def __call__(self, sample: VerifierInput) -> Score:
        cfg = self.cfg
        try:
            tests = parse_tests(sample.reference)
        except ValueError as e:
            return Score(0.0, None, {}, error=f"code: bad tests in reference: {e}")
        total = len(tests)
        completion = sample.completion or ""
        program = (
            extract_program(completion, require_block=cfg.require_code_block)
            if len(completion) <= cfg.max_completion_chars
            else ""
        )
        if program is None or not program.strip() or len(program) > cfg.max_program_chars:
            if len(completion) > cfg.max_completion_chars:
                why = f"completion longer than {cfg.max_completion_chars} chars"
            elif program is None:
                why = "no code block"
            elif not program.strip():
                why = "no program"
            else:
                why = f"program longer than {cfg.max_program_chars} chars"
            found = None if program is None or not program.strip() else f"{len(program)} chars"
            breakdown = {"passed": 0, "total": total, "failed": [], "reason": why, "extracted": found}
            return Score(0.0, False, breakdown)
        passed = 0
        failed: list[dict[str, Any]] = []
        n_failed = 0
        try:
            for i, (why, detail) in enumerate(self._run_tests(program, tests)):
                if why is None:
                    passed += 1
                    continue
                n_failed += 1
                if len(failed) < cfg.max_failures_reported:
                    failed.append({"test": i, "why": why, "detail": detail})
                if cfg.fail_fast:
                    break
        except (self._sandbox.SandboxUnavailable, self._sandbox.SandboxError) as e:
            return Score(0.0, None, {"passed": passed, "total": total}, error=f"sandbox: {e}"[:1000])
        all_passed = passed == total
        if cfg.fail_fast:
            n_failed = total - passed  # skipped tests count as failed
        reward = passed / total if cfg.mode == "fraction" else float(all_passed)
        breakdown = {
            "passed": passed,
            "total": total,
            "num_failed": n_failed,
            "failed": failed,
            "extracted": f"{len(program)} chars",
        }
        return Score(reward, all_passed, breakdown)


@register("code", params=CodeVerifierConfig)
def code_verifier(**params: Any) -> Verifier:
    """The ``code`` verifier; ``params`` are the fields of CodeVerifierConfig."""
    return CodeVerifier(config_from_params(CodeVerifierConfig, params, "code"))
