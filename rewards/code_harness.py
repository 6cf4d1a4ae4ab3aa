"""The grader that runs one ``{"code": ...}`` test inside the sandbox (stdlib only; this file is the sandboxed program).

The host sends on stdin one JSON object ``{"nonce", "program", "test"}``. This harness:
1. reads all of stdin and then points fd 0 at /dev/null, so the program never sees the nonce or the test source
   there, and keeps its own references to the functions it needs later (``os.write``, ``os._exit``, ``exec``);
2. installs an audit hook (which nothing can remove) that refuses, while the program and the test run, what
   could skip the test's statements or read this harness's memory cheaply: ``sys.settrace``,
   ``sys.setprofile``, ``sys.monitoring`` callbacks, new audit hooks, ``sys._current_frames``, ``gc``'s object
   walks and all of ``ctypes``; then runs the program, then the test, in one fresh ``__main__`` namespace,
   both compiled with asserts kept (``optimize=0``);
3. writes exactly one verdict line to fd 1 and leaves with ``os._exit``, so no exit hook of the program runs
   after it: ``\\0trustbatch-test <nonce> pass`` only when the test's last statement finished and no
   trace/profile hook was left installed, else ``... fail assertion`` (the test's assert failed), ``... fail
   exit`` (``SystemExit`` during the program or the test) or ``... fail error``.

The host counts a test as passed only when the verdict line carries this run's nonce, says ``pass`` and the
run exited with status 0. Exiting early (``os._exit``, ``sys.exit``, ``exit()``, ``raise SystemExit``, an
exception whose ``__str__`` exits), exit hooks (``atexit``, a replaced ``sys.excepthook``), signal handlers and
threads all end the run before a ``pass`` verdict, and a program cannot print a verdict it has not been told
the nonce of. What this does not rule out (rewards/README.md): a program that walks the call stack
(``sys._getframe``, ``f_back``: logging needs them, so they stay) to this harness's frame and reads the nonce
there, or that defeats the test's assertions themselves (a returned object whose ``__eq__`` is always true,
patched builtins); stdin/stdout tests, whose expected output never enters the sandbox, are the stricter form.
"""

import json
import os
import sys
import traceback
import types

MARKER = b"\0trustbatch-test "
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

    def verdict(word: bytes) -> None:
        for stream in (stdout, stderr):  # the interpreter's own streams: no program code runs here
            try:
                flush(stream)
            except BaseException:  # the program may have closed them
                pass
        try:
            write(1, b"\n" + MARKER + nonce + b" " + word + b"\n")
        finally:
            exit_now(0 if word == b"pass" else 1)

    sys.addaudithook(_guard)  # before any program code: audit hooks cannot be removed
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    namespace = main_module.__dict__
    stage = "program"
    try:
        code = compile_(job["program"], "<program>", "exec", dont_inherit=True, optimize=0)
        exec_(code, namespace)
        stage = "test"
        code = compile_(job["test"], "<test>", "exec", dont_inherit=True, optimize=0)
        exec_(code, namespace)
        if gettrace() is not None or getprofile() is not None:
            write(2, b"TraceHookError: a trace or profile hook was installed while the test ran\n")
            verdict(b"fail error")
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the test did not run to its end
        try:
            print_exception(type(e), e, e.__traceback__)
        except BaseException:
            pass
        if isinstance(e, SystemExit):
            verdict(b"fail exit")
        verdict(b"fail assertion" if stage == "test" and isinstance(e, AssertionError) else b"fail error")
    verdict(b"pass")


if __name__ == "__main__":
    main()
