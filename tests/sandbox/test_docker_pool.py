"""The docker pool's ownership of its containers, on the real engine: each backend's start-up sweep removes only
the containers of owners that are dead (whatever PID namespace they ran in), and a pool whose container vanished
from under it replaces it instead of failing, leaving nothing behind when it closes or its process exits."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import docker
import pytest

from sandbox import Limits, SandboxConfig, SandboxUnavailable, available_backends
from sandbox.container import LABEL, DockerBackend

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
LIMITS = Limits(wall_s=10, memory_mb=256, max_processes=16)
OWNER = f"{LABEL}.owner"

# Child processes: the same interpreter and sources as the test; each prints one JSON line.
WARM_AND_WAIT = """
import json, sys
from sandbox import Limits, execute
from sandbox.executor import get_backend
assert execute("print(1)", limits=Limits(memory_mb=256, max_processes=16), backend="docker").stdout == "1\\n"
(pool,) = get_backend("docker").pools.values()
print(json.dumps({"owner": pool.idle[0].labels["trustbatch.sandbox.owner"], "ids": [c.id for c in pool.idle]}))
sys.stdout.flush()
sys.stdin.readline()  # killed here
"""
SECOND_POOL = """
import json, os
from sandbox import Limits, SandboxConfig
from sandbox.container import DockerBackend
backend = DockerBackend(SandboxConfig())  # its start-up sweep runs here
result = backend.run("print(2)", "", Limits(memory_mb=256, max_processes=16))
print(json.dumps({"pid": os.getpid(), "stdout": result.stdout}))
backend.close()
"""
VANISH_THEN_EXIT = """
import json
import docker
from sandbox import Limits, execute
from sandbox.executor import get_backend
limits = Limits(memory_mb=256, max_processes=16)
assert execute("print(1)", limits=limits, backend="docker").stdout == "1\\n"
(pool,) = get_backend("docker").pools.values()
(warm,) = pool.idle
docker.from_env().containers.get(warm.id).remove(force=True)
second = execute("print(2)", limits=limits, backend="docker")  # on a replacement
# the program kills its supervisor: that container is removed and another is started in the background
execute("import os; os.kill(os.getppid(), 9)", limits=limits, backend="docker")
print(json.dumps({"owner": warm.labels["trustbatch.sandbox.owner"], "second": second.stdout}))
# and the process exits now, while that start may still be under way
"""
FORK_THEN_EXIT = """
import json, os, sys
from sandbox import Limits, execute
from sandbox.executor import get_backend
limits = Limits(memory_mb=256, max_processes=16)
assert execute("print(1)", limits=limits, backend="docker").stdout == "1\\n"
(pool,) = get_backend("docker").pools.values()
(warm,) = pool.idle
pid = os.fork()
if pid == 0:
    sys.exit(0)  # an ordinary interpreter exit, with the atexit handlers inherited from the parent
os.waitpid(pid, 0)
after = execute("print(2)", limits=limits, backend="docker")
print(json.dumps({"stdout": after.stdout, "same": [c.id for c in pool.idle] == [warm.id]}))
"""


@pytest.fixture
def client():
    reason = available_backends()["docker"]
    if reason is not None:
        required = {b.strip() for b in os.environ.get("TRUSTBATCH_SANDBOX_REQUIRE", "").split(",")}
        if "docker" in required:
            pytest.fail(f"TRUSTBATCH_SANDBOX_REQUIRE has docker, but it cannot run: {reason}")
        pytest.skip(f"docker backend unavailable: {reason}")
    client = docker.from_env(timeout=30)
    yield client
    client.close()


@pytest.fixture
def unshare_pid():
    """The command prefix that runs a process in a new PID namespace (with its own /proc), or a skip."""
    prefix = ["unshare", "--pid", "--fork", "--mount-proc"]
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a PID namespace here (needs root): {probe.stderr.strip()}")
    return prefix


def owned_by(client, owner: str, settle_s: float = 30.0) -> list[str]:
    """Ids of the owner's containers, once no removal of them is still in flight (``sparse``: listing without
    inspecting each, which raced with a removal that docker was finishing); what remains after settle_s."""
    deadline = time.monotonic() + settle_s
    while True:
        found = [c.id for c in client.containers.list(all=True, sparse=True, filters={"label": f"{OWNER}={owner}"})]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def exists(client, container_id: str) -> bool:
    try:
        client.containers.get(container_id)
        return True
    except docker.errors.NotFound:
        return False


def warm(backend: DockerBackend):
    """Run once and return the pool's one idle container."""
    assert backend.run("print('warm')", "", LIMITS).stdout == "warm\n"
    (pool,) = backend.pools.values()
    (container,) = pool.idle
    return container


def child(args: list[str], script: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [*args, sys.executable, "-c", script], cwd=REPO, text=True, stdout=subprocess.PIPE, **kwargs
    )


def test_backends_in_one_process_have_distinct_owners_and_spare_each_others_containers(client):
    first = DockerBackend(SandboxConfig(pool_size=1))
    try:
        container = warm(first)
        second = DockerBackend(SandboxConfig(pool_size=1))  # start-up sweep while the first is alive
        try:
            theirs = warm(second)
            assert container.labels[OWNER] != theirs.labels[OWNER]
            assert exists(client, container.id)
        finally:
            second.close()
        assert exists(client, container.id)
        assert first.run("print('still')", "", LIMITS).stdout == "still\n"
        # the same container, not a replacement
        assert [c.id for c in first.pools[(256, 64, 16)].idle] == [container.id]
    finally:
        first.close()


def test_a_pool_started_in_another_pid_namespace_spares_a_live_pools_container(client, unshare_pid):
    """The old `hostname:pid` label: a pool in a new PID namespace (same hostname) saw no such pid in its /proc and
    removed this live pool's warm container; the next run raised SandboxError 'No such container'."""
    first = DockerBackend(SandboxConfig(pool_size=1))
    try:
        container = warm(first)
        proc = child(unshare_pid, SECOND_POOL)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
        report = json.loads(out)
        assert report == {"pid": 1, "stdout": "2\n"}  # it really ran as PID 1 of its own namespace
        assert exists(client, container.id)
        assert first.run("print('still')", "", LIMITS).stdout == "still\n"
        assert [c.id for c in first.pools[(256, 64, 16)].idle] == [container.id]
    finally:
        first.close()


@pytest.mark.parametrize("namespace", ["same-pid-namespace", "new-pid-namespace"])
def test_a_sigkilled_owners_containers_are_removed_by_the_next_pool(client, namespace, request):
    """An owner killed before its atexit ran leaves its warm container; the next pool's sweep removes it, also
    when the owner ran in another PID namespace (where it was PID 1, a pid that is alive on the host)."""
    prefix = request.getfixturevalue("unshare_pid") if namespace == "new-pid-namespace" else []
    proc = child(prefix, WARM_AND_WAIT, stdin=subprocess.PIPE)
    try:
        report = json.loads(proc.stdout.readline())
        python = proc.pid
        if prefix:  # unshare forked the interpreter: kill that one, not unshare
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            assert len(children) == 1
            python = int(children[0])
        os.kill(python, signal.SIGKILL)
        proc.wait(timeout=60)  # unshare returns once its child is dead, so the child's lock is gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert report["ids"]
    sweeper = DockerBackend(SandboxConfig())
    try:
        assert owned_by(client, report["owner"]) == []
        from sandbox.container import lease_dir

        assert not (lease_dir() / f"{report['owner']}.lock").exists()  # its lease file is gone with it
    finally:
        sweeper.close()


def test_a_warm_container_removed_from_outside_is_replaced_and_close_leaves_none(client):
    backend = DockerBackend(SandboxConfig(pool_size=1))
    try:
        container = warm(backend)
        owner = container.labels[OWNER]
        client.containers.get(container.id).remove(force=True)  # `docker rm -f` from outside
        result = backend.run("print('replaced')", "", LIMITS)
        assert (result.stdout, result.exit_code) == ("replaced\n", 0)
        (replacement,) = backend.pools[(256, 64, 16)].idle
        assert replacement.id != container.id and replacement.labels[OWNER] == owner
    finally:
        backend.close()
    assert owned_by(client, owner) == []
    from sandbox.container import lease_dir

    assert not (lease_dir() / f"{owner}.lock").exists()  # nothing left to own: the lease is let go


def test_a_container_removed_during_a_run_is_replaced_and_the_run_retried(client):
    backend = DockerBackend(SandboxConfig(pool_size=1))
    removed = []
    try:
        container = warm(backend)
        owner = container.labels[OWNER]

        def remove_once_the_program_runs():
            for _ in range(600):
                try:
                    processes = client.containers.get(container.id).top()["Processes"] or []
                except docker.errors.APIError:
                    return
                if any("/tmp/main.py" in " ".join(p) for p in processes):
                    client.containers.get(container.id).remove(force=True)
                    removed.append(container.id)
                    return
                time.sleep(0.05)

        remover = threading.Thread(target=remove_once_the_program_runs)
        remover.start()
        try:
            result = backend.run("import time\ntime.sleep(3)\nprint('done')", "", LIMITS)
        finally:
            remover.join()
        assert removed == [container.id]
        assert (result.stdout, result.exit_code, result.timed_out) == ("done\n", 0, False)
        (replacement,) = backend.pools[(256, 64, 16)].idle
        assert replacement.id != container.id
    finally:
        backend.close()
    assert owned_by(client, owner) == []


def test_a_replacement_started_after_a_vanish_does_not_outlive_the_process(client):
    """A process whose warm container vanished runs on a replacement, and when it exits (atexit) no container of
    its owner remains, including one still being started in the background at that moment."""
    proc = child([], VANISH_THEN_EXIT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0
    report = json.loads(out)
    assert report["second"] == "2\n"
    assert owned_by(client, report["owner"]) == []


def test_a_forked_child_exiting_leaves_the_parents_containers_alone(client):
    """A forked child inherits the backend and its atexit handler; its exit must not remove the parent's warm
    container."""
    proc = child([], FORK_THEN_EXIT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0
    assert json.loads(out) == {"stdout": "2\n", "same": True}


def test_a_lease_directory_others_can_write_is_refused(client, tmp_path, monkeypatch):
    """Whoever can replace a lease file can make a live owner look dead, so such a directory is not used."""
    shared = tmp_path / "leases"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TRUSTBATCH_SANDBOX_LEASE_DIR", str(shared))
    with pytest.raises(SandboxUnavailable, match="writable only by it"):
        DockerBackend(SandboxConfig())
    assert list(shared.iterdir()) == []
