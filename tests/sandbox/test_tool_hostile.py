"""The hostile programs of test_adversarial.py, written by the model as a tool call: through the python tool and the
tool pool, on each backend. The model only ever sees text; the host is unaffected; every call ends."""

from __future__ import annotations

import asyncio
import socket
import uuid
from pathlib import Path

import pytest

from tests.sandbox.conftest import processes_with
from tools import ToolCall, ToolPool, build_tools
from tools.config import ToolSpec

REPO = Path(__file__).resolve().parents[2]


def marked(code: str, marker: str) -> str:
    return f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {code!r}, {marker!r}])\n"


def call(code: str, backend: str, timeout_s: float = 30.0):
    tools = build_tools([ToolSpec(name="python", params={"wall_s": 2.0, "cpu_s": 2.0, "memory_mb": 256,
                                                          "max_output_bytes": 65536, "backend": backend})])  # fmt: skip
    pool = ToolPool(tools, concurrency=2, timeout_s=timeout_s)
    try:
        return asyncio.run(pool.call(ToolCall("python", {"code": code})))
    finally:
        pool.close()


def test_the_python_tool_returns_stdout_stderr_and_the_exit_status(backend):
    ok = call("print(23 + 40 - 47)", backend)
    assert (ok.status, ok.output) == ("ok", "16") and ok.detail["exit_code"] == 0
    failed = call("print('partial')\n1 / 0", backend)
    assert failed.status == "error" and failed.output.startswith("partial\nTraceback")
    assert "ZeroDivisionError: division by zero" in failed.output and failed.output.endswith("(exit status 1)")


def test_a_fork_bomb_written_as_a_tool_call_is_contained(backend):
    marker = f"toolbomb-{uuid.uuid4().hex}"
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = call(marked(bomb, marker), backend)
    assert result.status == "timeout" and "time limit of 2 s passed" in result.output
    assert processes_with(marker) == []
    assert call("print('still here')", backend).output == "still here"


@pytest.mark.parametrize(
    "code, status, says",
    [
        ("chunks = []\nwhile True:\n    chunks.append(bytearray(10 << 20))\n", "error", "memory limit of 256 MB"),
        ("while True:\n    print('x' * 1000)\n", "error", "the output passed 65536 bytes"),
        ("import time\ntime.sleep(1000)\n", "timeout", "time limit of 2 s passed"),
        ("while True:\n    pass\n", "timeout", "time limit"),
        ("import os\nos.kill(-1, 9)\nprint('survived')", None, None),
        ("import os\nos.kill(os.getppid(), 9)\nprint('after')", None, None),
    ],
    ids=["memory-bomb", "output-flood", "sleep-forever", "busy-loop", "kill-minus-one", "kill-parent"],
)
def test_resource_attacks_end_as_observations(backend, code, status, says):
    result = call(code, backend)
    if status is not None:
        assert result.status == status and says in result.output, result
    assert isinstance(result.output, str) and len(result.output) < 70_000
    assert call("print('still here')", backend).output == "still here"


def test_the_tool_sees_no_host_files_and_no_network(backend):
    secret = REPO / "pyproject.toml"
    result = call(f"print(open({str(secret)!r}).read()[:20])", backend)
    assert result.status == "error" and "[project]" not in result.output
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        result = call(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')", backend)
        assert "connected" not in result.output and result.status == "error"
    finally:
        server.close()
