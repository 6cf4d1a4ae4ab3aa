"""Ordinary programs on every available backend: output, exit codes, stderr, stdin, and no state between runs."""

import fcntl
import os
import threading
import time

import sandbox
from sandbox import Limits, SandboxConfig, bwrap, execute
from sandbox.executor import get_backend

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


def test_waiting_for_a_free_sandbox_does_not_use_up_the_wall_limit(backend):
    """More runs than sandboxes: a queued run still gets its whole wall_s (the clock starts once a bwrap slot or
    a container is its own), so a program that fits its limit is never reported timed out for having waited."""
    limits = Limits(wall_s=2.0, memory_mb=256, max_processes=16)
    code = "import time\ntime.sleep(1.5)\nprint('done')"
    if backend == "docker":  # one container for four concurrent runs: the last waits about 3 x 1.5 s
        sandbox.configure(SandboxConfig(pool_size=1))
        try:
            results = [None] * 4

            def work(i):
                results[i] = execute(code, limits=limits, backend=backend)

            threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sandbox.configure(SandboxConfig())
    else:  # every bwrap slot held for 2.5 s, longer than the run's wall limit
        slot_dir = get_backend("bwrap").slot_dir
        held = []
        for slot in range(bwrap.SLOTS):
            fd = os.open(
                os.path.join(slot_dir, f"slot-{slot}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
            held.append(fd)
        released: list[float] = []

        def free_slots() -> None:
            released.append(time.monotonic())  # before any slot is free: the run cannot start earlier
            for fd in held:
                os.close(fd)

        release = threading.Timer(2.5, free_slots)
        release.start()
        try:
            results = [execute(code, limits=limits, backend=backend)]
            ended = time.monotonic()
        finally:
            release.join()
        # Measured from acquisition, which came after the release: the run's clock reads no more than the time
        # from the release to the return, however busy the machine (one that counted the 2.5 s wait would not).
        assert results[0].wall_s <= ended - released[0], (results[0], ended - released[0])
    for result in results:
        assert (result.stdout, result.timed_out, result.exit_code) == ("done\n", False, 0), result
