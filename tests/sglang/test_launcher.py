"""The SGLang launcher (app/rollout/sglang_server.py) with real SGLang 0.5.23 on CPU.

Covered: a crashed server (its whole process group SIGKILLed) is reported by ``exited()`` and comes back on the
same URL with ``start()``, from other weights with another ``--weight-version``; servers die with the process
that launched them (PR_SET_PDEATHSIG), scheduler and detokenizer included; a server that cannot start is
reported with its log tail instead of a health-check timeout.
The config and the command line without a server: tests/sglang/test_launch_config.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from app.rollout.base import SamplingParams
from app.rollout.sglang_server import SGLangLaunchConfig, SGLangLaunchError, launch_servers
from tests.sglang.conftest import REPO, SGLANG_PYTHON, run_with_client

pytestmark = pytest.mark.sglang


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(condition, what: str, limit_s: float = 60.0) -> None:
    """Poll ``condition`` (a liveness bound, not a timing assertion: it only stops a hung test)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for: {what}"
        time.sleep(0.2)


def test_crashed_server_restarts_on_the_same_url(session_server, models):
    server = session_server
    url, pid = server.url, server.process.pid
    os.killpg(pid, signal.SIGKILL)  # the launcher, its scheduler and detokenizer: a hard crash
    wait_until(lambda: server.exited() is not None, "exited() to report the crash")
    assert server.exited() == -signal.SIGKILL
    assert server.start(model_dir=models.v1, weight_version=9) == url
    server.wait_ready()
    assert server.process.pid != pid

    async def go(client):
        completions = await client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, n=2, seed=1))
        return completions, await client.model_info()

    completions, info = run_with_client(url, go)
    assert {c.policy_version for c in completions} == {9}
    assert info["weight_version"] == "9" and info["model_path"] == str(models.v1)
    assert server.log_path.read_text().count("[trustbatch] starting:") == 2  # the restart appended to the log


CHILD = """
import sys, time
from app.rollout.sglang_server import SGLangLaunchConfig, launch_servers
cfg = SGLangLaunchConfig(num_servers=1, python=sys.argv[1], cpu=True, startup_timeout_s=300)
[server] = launch_servers(cfg, sys.argv[2], sys.argv[3])
print(server.process.pid, flush=True)
time.sleep(600)
"""


def test_servers_die_with_the_process_that_launched_them(models, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(SGLANG_PYTHON), str(models.v0), str(tmp_path)],
        stdout=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    try:
        line = child.stdout.readline()
        assert line.strip().isdigit(), f"the launching process printed {line!r} (log in {tmp_path})"
        server_pid = int(line)
        assert group_alive(server_pid)
    finally:
        child.kill()  # SIGKILL: no clean-up code runs in the parent
        child.wait()
    wait_until(lambda: not group_alive(server_pid), "the server's processes to exit after their parent died")


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen2", "architectures": ["Nope"]}')
    cfg = SGLangLaunchConfig(num_servers=1, python=str(SGLANG_PYTHON), cpu=True, startup_timeout_s=300)
    with pytest.raises(SGLangLaunchError, match="exited with code") as err:
        launch_servers(cfg, tmp_path / "model", tmp_path / "logs")
    # the log file's name and SGLang's own complaint, taken from the log
    assert "sglang-0.log" in str(err.value) and "Nope" in str(err.value)
