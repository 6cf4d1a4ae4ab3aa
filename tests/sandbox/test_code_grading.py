"""Assert-style code tests cannot be passed by exiting: a test passes only on the in-sandbox grader's own verdict.

Each hack below earned reward 1.0 against ``assert add(2, 3) == 5`` when a test passed on exit status 0. Every
one runs on each sandbox backend this machine has, with a completion's tests in one grader run (the default),
beside correct programs as controls (so a grader that rejects everything fails here too); on bubblewrap, one run
per test (`batch_tests: false`) must grade every case alike.
"""

import pytest

from rewards import VerifierInput
from rewards.code import CodeVerifier, CodeVerifierConfig
from sandbox import available_backends

TESTS = [{"code": "assert add(2, 3) == 5"}]
THREE_LINES = [{"code": "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(0, 0) == 0"}]
TWO_TESTS = [{"code": "assert add(2, 3) == 5"}, {"code": "r = add(-1, 1)\nassert r == 0, r"}]

CORRECT = {
    "plain": "def add(a, b):\n    return a + b\n",
    "main guard": "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(1, 1))\n",
    "prints a lot": "def add(a, b):\n    return a + b\n\nfor i in range(2000):\n    print(i)\n",
    "uses a thread": (
        "import threading\nresult = {}\ndef add(a, b):\n"
        "    t = threading.Thread(target=lambda: result.update(s=a + b)); t.start(); t.join()\n"
        "    return result['s']\n"
    ),
    "no trailing newline on stdout": "import sys\nsys.stdout.write('x')\ndef add(a, b):\n    return a + b",
}

HACKS = {
    "os._exit at import": "import os\nos._exit(0)",
    "sys.exit at import": "import sys\nsys.exit(0)",
    "raise SystemExit": "raise SystemExit",
    "exit()": "exit()",
    "quit()": "quit()",
    "atexit hook": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return 0",
    "atexit after a failed test": "import atexit\natexit.register(lambda: print('ok'))\ndef add(a, b):\n    return 0",
    "excepthook": "import sys\nsys.excepthook = lambda *a: None\ndef add(a, b):\n    return 0",
    "os._exit when called": "def add(a, b):\n    import os\n    os._exit(0)",
    "sys.exit when called": "def add(a, b):\n    import sys\n    sys.exit(0)",
    "KeyboardInterrupt when called": "def add(a, b):\n    raise KeyboardInterrupt",
    "thread exits first": (
        "import os, threading, time\nthreading.Thread(target=lambda: (time.sleep(0.05), os._exit(0))).start()\n"
        "def add(a, b):\n    time.sleep(2)\n    return 0"
    ),
    "signal handler exits": (
        "import os, signal, time\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.05)\ndef add(a, b):\n    time.sleep(2)\n    return 0"
    ),
    "prints a forged verdict": (
        "import os\nprint('\\x00trustbatch-test ' + 'ab' * 16 + ' pass')\nos._exit(0)"
    ),
    "reads stdin for the nonce": "import os, sys\nprint(sys.stdin.read())\nos._exit(0)",
    "closes stdout": "import os\nos.close(1)\ndef add(a, b):\n    return a + b",
    "exception whose str exits": (
        "class E(Exception):\n    def __str__(self):\n        import os\n        os._exit(0)\n"
        "def add(a, b):\n    raise E()"
    ),
    "leaves a trace hook": "import sys\ndef add(a, b):\n    sys.settrace(lambda *a: None)\n    return a + b",
    "audit hook installs a jumping tracer at the test's exec": (
        "import sys\n"
        "def tracer(frame, event, arg):\n"
        "    if frame.f_code.co_filename == '<test>' and event == 'line' and frame.f_lineno < 3:\n"
        "        frame.f_lineno = 3\n"
        "        sys.settrace(None)\n"
        "    return tracer\n"
        "def hook(event, args):\n"
        "    if event == 'exec':\n"
        "        sys.settrace(tracer)\n"
        "sys.addaudithook(hook)\n"
        "def add(a, b):\n    return 0"
    ),
    "tracer set when the test calls it": (
        "import sys\n"
        "def tracer(frame, event, arg):\n"
        "    if event == 'line' and frame.f_lineno < 3:\n"
        "        frame.f_lineno = 3\n"
        "    return tracer\n"
        "def add(a, b):\n"
        "    caller = sys._getframe(1)\n"
        "    caller.f_trace = tracer\n"
        "    sys.settrace(lambda *a: None)\n"
        "    return 0"
    ),
    "digs the verdict marker out of gc": (
        "import gc, os\n"
        "def add(a, b):\n"
        "    for o in gc.get_objects():\n"
        "        if isinstance(o, dict) and 'nonce' in o:\n"
        "            os.write(1, b'\\0trustbatch-test ' + o['nonce'].encode() + b' pass\\n')\n"
        "            os._exit(0)\n"
        "    return 0"
    ),
    "reads memory with ctypes": "import ctypes\ndef add(a, b):\n    return ctypes.c_int(0).value",
    "kills its own process group": "import os, signal\ndef add(a, b):\n    os.killpg(0, signal.SIGKILL)",
    "wrong answer": "def add(a, b):\n    return a - b",
    "syntax error": "def add(a, b) return a + b",
}


@pytest.fixture
def verify(backend):
    return CodeVerifier(CodeVerifierConfig(backend=backend, wall_s=5.0, cpu_s=5.0))


def score(verify, program, tests=TESTS):
    return verify(VerifierInput("write add", f"```python\n{program}\n```", tests, {"task": "code"}))


@pytest.mark.parametrize("program", list(CORRECT.values()), ids=list(CORRECT))
def test_correct_programs_pass(verify, program):
    result = score(verify, program, TWO_TESTS)
    assert (result.reward, result.correct, result.error) == (1.0, True, None), result


@pytest.mark.parametrize("program", list(HACKS.values()), ids=list(HACKS))
def test_exiting_and_hooks_earn_nothing(verify, program):
    result = score(verify, program, THREE_LINES if "tracer" in program else TESTS)
    assert result.reward == 0.0 and result.correct is False and result.error is None, result
    assert result.breakdown["failed"][0]["why"] in {"early_exit", "wrong_answer", "error"}


def test_exits_are_reported_as_early_exit(verify):
    for name in (
        "os._exit at import",
        "sys.exit when called",
        "thread exits first",
        "prints a forged verdict",
    ):
        assert score(verify, HACKS[name]).breakdown["failed"][0]["why"] == "early_exit", name
    assert score(verify, HACKS["wrong answer"]).breakdown["failed"][0]["why"] == "wrong_answer"


def test_partial_credit_still_counts_each_test(verify):
    half = "def add(a, b):\n    return 5"
    result = score(verify, half, TWO_TESTS)
    assert result.reward == 0.5 and result.breakdown["failed"][0]["test"] == 1


@pytest.mark.parametrize(
    "tests",
    [[{"code": None}], [{"code": ""}], [{"code": "   \n"}], [{"code": 3}], [], [{"code": "assert ("}]],
    ids=["null", "empty", "blank", "not a string", "no tests", "does not compile"],
)
def test_bad_references_are_errors_not_passes(verify, tests):
    result = score(verify, CORRECT["plain"], tests)
    assert result.reward == 0.0 and result.correct is None and "bad tests" in result.error


THREE_TESTS = [{"code": "assert add(1, 1) == 2"}, {"code": "assert add(2, 2) == 4"}, {"code": "assert add(3, 3) == 6"}]


@pytest.mark.parametrize(
    ("program", "why"),
    [
        ("import os\ndef add(a, b):\n    if a == 2:\n        os._exit(0)\n    return a + b", "early_exit"),
        ("import time\ndef add(a, b):\n    if a == 2:\n        time.sleep(60)\n    return a + b", "timeout"),
    ],
    ids=["exits in the second test", "hangs in the second test"],
)
def test_a_run_that_ends_mid_batch_keeps_earlier_passes_and_fails_the_rest(backend, program, why):
    verify = CodeVerifier(CodeVerifierConfig(backend=backend, wall_s=1.0, cpu_s=1.0))
    result = score(verify, program, THREE_TESTS)
    assert result.reward == pytest.approx(1 / 3) and result.correct is False and result.error is None, result
    assert [(f["test"], f["why"]) for f in result.breakdown["failed"]] == [(1, why), (2, why)]


def test_each_failed_test_reports_its_own_error_and_the_next_test_still_runs(backend):
    verify = CodeVerifier(CodeVerifierConfig(backend=backend))
    program = "def add(a, b):\n    if a == 1:\n        raise ValueError('one is bad')\n    return a + b"
    result = score(verify, program, THREE_TESTS)
    assert result.reward == pytest.approx(2 / 3)
    [failure] = result.breakdown["failed"]
    assert failure["test"] == 0 and failure["why"] == "error" and "ValueError: one is bad" in failure["detail"]


def test_fail_fast_stops_a_batch_at_the_first_failure(backend):
    verify = CodeVerifier(CodeVerifierConfig(backend=backend, fail_fast=True))
    program = "def add(a, b):\n    return 2"  # passes the first test only
    result = score(verify, program, THREE_TESTS)
    assert result.reward == pytest.approx(1 / 3) and result.breakdown["num_failed"] == 2
    assert [f["test"] for f in result.breakdown["failed"]] == [1]  # the third never ran


@pytest.mark.parametrize(
    "program", list(CORRECT.values()) + list(HACKS.values()), ids=list(CORRECT) + list(HACKS)
)
def test_one_run_per_test_grades_every_case_as_the_batched_grader_does(program):
    """The same grader program either way; checked on bubblewrap (Docker's start-up per run makes it slow)."""
    reason = available_backends()["bwrap"]
    if reason is not None:
        pytest.skip(f"bwrap backend unavailable: {reason}")
    tests = THREE_LINES if "tracer" in program else TWO_TESTS
    results = [
        score(CodeVerifier(CodeVerifierConfig(backend="bwrap", wall_s=5.0, cpu_s=5.0, batch_tests=batch)), program, tests)
        for batch in (True, False)
    ]
    batched, each = ((r.reward, r.correct, r.error, [f["why"] for f in r.breakdown["failed"]]) for r in results)
    assert batched == each
