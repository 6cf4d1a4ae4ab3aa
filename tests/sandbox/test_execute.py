"""Ordinary programs on every available backend: output, exit codes, stderr, stdin, and no state between runs."""

import threading

from sandbox import Limits, execute

LIMITS = Limits(wall_s=5, memory_mb=256, max_processes=16)


def test_hello_world(backend):
    result = execute("print('hello world')", limits=LIMITS, backend=backend)
    assert (result.stdout, result.stderr, result.exit_code) == ("hello world\n", "", 0)
    assert not (result.timed_out or result.memory_exceeded or result.output_truncated)
    assert result.backend.startswith(backend)


def test_exit_code_is_reported(backend):
    assert execute("import sys; sys.exit(7)", limits=LIMITS, backend=backend).exit_code == 7


def test_uncaught_exception_exits_1_with_traceback_on_stderr(backend):
    result = execute("raise ValueError('boom')", limits=LIMITS, backend=backend)
    assert result.exit_code == 1 and "ValueError: boom" in result.stderr and not result.memory_exceeded


def test_syntax_error_is_data(backend):
    result = execute("def f(:\n", limits=LIMITS, backend=backend)
    assert result.exit_code == 1 and "SyntaxError" in result.stderr


def test_stderr_is_separate_from_stdout(backend):
    result = execute(
        "import sys; print('out'); print('err', file=sys.stderr)", limits=LIMITS, backend=backend
    )
    assert (result.stdout, result.stderr) == ("out\n", "err\n")


def test_stdin_is_passed_through(backend):
    code = "n = int(input())\nprint(sum(int(input()) for _ in range(n)))"
    assert execute(code, stdin="3\n1\n2\n3\n", limits=LIMITS, backend=backend).stdout == "6\n"


def test_unicode_round_trips(backend):
    result = execute("s = input()\nprint(s[::-1], 'λ✓')", stdin="héllo wörld", limits=LIMITS, backend=backend)
    assert result.stdout == "dlröw olléh λ✓\n"


def test_files_in_tmp_do_not_survive_into_the_next_run(backend):
    first = execute("open('/tmp/left-behind', 'w').write('x'); print('ok')", limits=LIMITS, backend=backend)
    second = execute("import os; print(sorted(os.listdir('/tmp')))", limits=LIMITS, backend=backend)
    assert first.stdout == "ok\n" and "left-behind" not in second.stdout


def test_concurrent_runs_are_isolated(backend):
    results = {}

    def work(i):
        code = f"import os, time\nopen('/tmp/mine', 'w').write('{i}')\ntime.sleep(0.3)\nprint(open('/tmp/mine').read())"
        results[i] = execute(code, limits=LIMITS, backend=backend).stdout

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i}\n" for i in range(3)}
