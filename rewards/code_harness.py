"""The grader that runs a completion's ``{"code": ...}`` tests inside the sandbox (stdlib only; this file is the
sandboxed program).

The host sends on stdin one JSON object ``{"nonce", "program", "tests": [code, ...], "fail_fast"}``. This harness:
1. reads all of stdin and then points fd 0 at /dev/null, so the program never sees the nonce or the tests' source
   there, and keeps its own references to the functions it needs later (``os.write``, ``os._exit``, ``exec``);
2. installs an audit hook (which nothing can remove) that refuses, while the program and the tests run, what
   could skip a test's statements or read this harness's memory cheaply: ``sys.settrace``,
   ``sys.setprofile``, ``sys.monitoring`` callbacks, new audit hooks, ``sys._current_frames``, ``gc``'s object
   walks and all of ``ctypes``; then runs the program, then each test in turn, in one fresh ``__main__``
   namespace, all compiled with asserts kept (``optimize=0``);
3. writes one verdict line per test to fd 1 as soon as that test ends: ``\0trustbatch-test <nonce> <i> pass``
   only when test i's last statement finished and no trace/profile hook was left installed, else ``... fail
   assertion`` (its assert failed), ``... fail exit`` (``SystemExit``) or ``... fail error`` (every test gets
   the program's failure when the program itself does not load). A failed test does not stop the next one
   unless ``fail_fast``. It leaves with ``os._exit`` after the last test, so no exit hook of the program runs.

The host counts test i as passed only when a verdict line for i carries this run's nonce and says ``pass``; a
test with no verdict (the run ended first) failed. Exiting early (``os._exit``, ``sys.exit``, ``exit()``,
``raise SystemExit``, an exception whose ``__str__`` exits), exit hooks (``atexit``, a replaced
``sys.excepthook``), signal handlers and threads all end the run or the test before a ``pass`` verdict, and a
program cannot print a verdict it has not been told the nonce of. What this does not rule out
(rewards/README.md): a program that walks the call stack (``sys._getframe``, ``f_back``: logging needs them, so
they stay) to this harness's frame and reads the nonce there, or that defeats the tests' assertions themselves
(a returned object whose ``__eq__`` is always true, patched builtins, state kept from one test to the next);
stdin/stdout tests, whose expected output never enters the sandbox, are the stricter form.
"""

import json
import os
import sys
import traceback
import types

MARKER = b"\0trustbatch-test "
TEST_START = b"\n\0trustbatch-test-start "
GUARDED_EVENTS = frozenset(
    {
        "sys.settrace",  # a trace hook can jump over the test's statements (frame.f_lineno)
        "sys.setprofile",
        "sys.monitoring.register_callback",  # the same on 3.12+ through sys.monitoring
        "sys.addaudithook",  # a hook of the program's own could run at the test's "exec" and install one
        "sys._current_frames",
        "gc.get_objects",  # the cheap ways to dig this harness's state out of memory
        "gc.get_referrers",
        "gc.get_referents",
    }
)
"""Audit events refused (RuntimeError) while the program and the test run; so is every ``ctypes.*`` event."""


def _guard(event: str, args: tuple) -> None:
    if event in GUARDED_EVENTS or event.startswith("ctypes."):
        raise RuntimeError(f"{event} is not allowed while a test is graded")


def main() -> None:
    write, exit_now, compile_, exec_ = os.write, os._exit, compile, exec
    gettrace, getprofile = sys.gettrace, sys.getprofile
    print_exception = traceback.print_exception
    stdout, stderr = sys.__stdout__, sys.__stderr__
    flush = type(stdout).flush  # the class's method: a program can replace the instance attribute
    chunks = []
    while chunk := os.read(0, 1 << 20):
        chunks.append(chunk)
    job = json.loads(b"".join(chunks))
    nonce = job["nonce"].encode()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)

    def verdict(index: int, word: bytes) -> None:
        """One test's verdict line; the interpreter's own streams are flushed first (no program code runs)."""
        for stream in (stdout, stderr):
            try:
                flush(stream)
            except BaseException:  # the program may have closed them
                pass
        write(1, b"\n" + MARKER + nonce + b" " + str(index).encode() + b" " + word + b"\n")

    def failure(e: BaseException, in_test: bool) -> bytes:
        try:
            print_exception(type(e), e, e.__traceback__)  # may run the program's __str__: it may exit here
        except BaseException:
            pass
        if isinstance(e, SystemExit):
            return b"fail exit"
        return b"fail assertion" if in_test and isinstance(e, AssertionError) else b"fail error"

    tests = job["tests"]
    sys.addaudithook(_guard)  # before any program code: audit hooks cannot be removed
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    namespace = main_module.__dict__
    try:
        code = compile_(job["program"], "<program>", "exec", dont_inherit=True, optimize=0)
        exec_(code, namespace)
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the program did not load
        word = failure(e, in_test=False)
        for index in range(len(tests)):
            verdict(index, word)
        exit_now(1)
    failed = False
    for index, test in enumerate(tests):
        write(2, TEST_START + str(index).encode() + b"\n")  # where this test's stderr starts, for the report
        try:
            code = compile_(test, "<test>", "exec", dont_inherit=True, optimize=0)
            exec_(code, namespace)
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: the test did not run to its end
            verdict(index, failure(e, in_test=True))
            failed = True
            if job.get("fail_fast"):
                break
            continue
        if gettrace() is not None or getprofile() is not None:  # nothing after it can be trusted: stop here
            write(2, b"TraceHookError: a trace or profile hook was installed while the test ran\n")
            verdict(index, b"fail error")
            exit_now(1)
        verdict(index, b"pass")
    exit_now(1 if failed else 0)


if __name__ == "__main__":
    main()
