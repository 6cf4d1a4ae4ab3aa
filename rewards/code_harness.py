"""The grader that runs one ``{"code": ...}`` test inside the sandbox (stdlib only; this file is the sandboxed program).

The host sends on stdin one JSON object ``{"nonce", "program", "test"}``. This harness:
1. reads all of stdin and then points fd 0 at /dev/null, so the program never sees the nonce or the test source
   there, and keeps its own references to the functions it needs later (``os.write``, ``os._exit``, ``exec``);
2. runs the program, then the test, in one fresh ``__main__`` namespace, both compiled with asserts kept
   (``optimize=0``), with any trace or profile hook removed before the test starts;
3. writes exactly one verdict line to fd 1 and leaves with ``os._exit``, so no exit hook of the program runs
   after it: ``\\0trustbatch-test <nonce> pass`` only when the test's last statement finished and no
   trace/profile hook was left installed, else ``... fail assertion`` (the test's assert failed), ``... fail
   exit`` (``SystemExit`` during the program or the test) or ``... fail error``.

The host counts a test as passed only when the verdict line carries this run's nonce, says ``pass`` and the
run exited with status 0. Exiting early (``os._exit``, ``sys.exit``, ``exit()``, ``raise SystemExit``, an
exception whose ``__str__`` exits), exit hooks (``atexit``, a replaced ``sys.excepthook``), signal handlers and
threads all end the run before a ``pass`` verdict, and a program cannot print a verdict it has not been told
the nonce of. What this does not rule out (rewards/README.md): a program that digs the nonce out of this
process's memory (frames, ``gc``, ``ctypes``), or defeats the test's assertions themselves (a returned object
whose ``__eq__`` is always true, patched builtins); stdin/stdout tests, whose expected output never enters
the sandbox, are the stricter form.
"""

import json
import os
import sys
import traceback
import types

MARKER = b"\0trustbatch-test "


def main() -> None:
    write, exit_now, compile_, exec_ = os.write, os._exit, compile, exec
    settrace, setprofile, gettrace, getprofile = sys.settrace, sys.setprofile, sys.gettrace, sys.getprofile
    print_exception = traceback.print_exception
    stdout, stderr = sys.__stdout__, sys.__stderr__
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
                stream.flush()
            except BaseException:  # the program may have closed them
                pass
        try:
            write(1, b"\n" + MARKER + nonce + b" " + word + b"\n")
        finally:
            exit_now(0 if word == b"pass" else 1)

    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    namespace = main_module.__dict__
    stage = "program"
    try:
        code = compile_(job["program"], "<program>", "exec", dont_inherit=True, optimize=0)
        exec_(code, namespace)
        stage = "test"
        code = compile_(job["test"], "<test>", "exec", dont_inherit=True, optimize=0)
        settrace(None)
        setprofile(None)
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
