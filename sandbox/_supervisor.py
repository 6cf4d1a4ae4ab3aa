"""The in-container supervisor for one docker execution. Runs as `python3 -I -S -c <this file> <json>` (stdlib only).

The host writes to the exec's stdin: a 32-byte nonce, then `code_len` bytes of code, then the program's stdin.
This process (uid 65534, like the program, but non-dumpable so the program cannot ptrace it or read its memory,
and the nonce with it):
1. kills every other process in the container except PID 1 and empties /tmp, /dev/shm and /dev/mqueue, so nothing a previous
   run left behind can see or touch this one;
2. forks the program (`python3 -I -X utf8 /tmp/main.py`) in its own session with rlimits and stdin inherited,
   copies its stdout/stderr to ours up to max_output_bytes each, and stops it at the cap or at wall_s (stopping
   it here, rather than by dropping the exec's stream on the host, keeps the container reusable: Docker waits
   13 s to remove a container whose exec is blocked writing to a dropped stream);
3. kills everything the program left running, empties /tmp again, and appends a trailer to stdout:
   b"\\0" + nonce + json status + b"\\n". The host trusts a run's status (and reuses the container) only when the
   trailer with its nonce arrives; otherwise (the program killed this process, or flooded its output) the host
   removes the container.
"""

import ctypes
import json
import os
import resource
import selectors
import signal
import sys
import time

ctypes.CDLL(None).prctl(
    4, 0, 0, 0, 0
)  # PR_SET_DUMPABLE=0: same-uid processes cannot ptrace us or read /proc/self/mem
cfg = json.loads(sys.argv[1])
ME = os.getpid()


def read_exact(n):
    chunks = []
    while n > 0:
        chunk = os.read(0, min(n, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def reap():
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def others():
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, ME):
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                        pids.append(int(name))
            except OSError:
                pass
    return pids


def kill_all():
    """SIGKILL every process but PID 1 and this one, until none is left (a fork bomb races kill(-1) a few times)."""
    for _ in range(400):
        if not others():
            reap()
            return True
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap()
        time.sleep(0.002)
    return False


def wipe(path):
    ok = True
    try:
        entries = list(os.scandir(path))
    except OSError:
        return False
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                os.chmod(entry.path, 0o700)
                ok = wipe(entry.path) and ok
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
        except (OSError, RecursionError):
            ok = False
    return ok


def clean():
    ok = kill_all() & wipe("/tmp")
    for path in ("/dev/shm", "/dev/mqueue"):
        ok &= not os.path.isdir(path) or wipe(path)
    return ok


def oom_kills():
    for path, key in (
        ("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill"),
        ("/sys/fs/cgroup/memory.events", "oom_kill"),
    ):
        try:
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == key:
                        return int(value)
        except OSError:
            pass
    return 0


class WallTimeout(Exception):
    pass


def on_alarm(signum, frame):
    raise WallTimeout


def forward(pipes, caps, pid):
    """Copy the program's stdout/stderr pipes to ours until they close or the program exits (a daemon it left
    may hold them open). Returns ("exited", wait status) or ("cap", None) when a stream passed its cap."""
    selector = selectors.DefaultSelector()
    for src in pipes:
        os.set_blocking(src, False)
        selector.register(src, selectors.EVENT_READ)

    def copy(fd):
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            selector.unregister(fd)
            del pipes[fd]
            return False
        dst = pipes[fd]
        room = caps[dst]
        caps[dst] -= len(chunk)
        chunk = chunk[: max(room, 0)]
        while chunk:
            chunk = chunk[os.write(dst, chunk) :]
        return True

    try:
        while pipes:
            for key, _ in selector.select(0.02):
                copy(key.fd)
                if min(caps.values()) < 0:
                    return "cap", None
            done, wait_status = os.waitpid(pid, os.WNOHANG)
            if done:
                for fd in list(pipes):  # what the program wrote before it exited
                    while fd in pipes and copy(fd) and min(caps.values()) >= 0:
                        pass
                return ("cap", None) if min(caps.values()) < 0 else ("exited", wait_status)
        return "exited", os.waitpid(pid, 0)[1]
    finally:
        selector.close()


nonce = read_exact(32)
code = read_exact(cfg["code_len"])
status = {"clean_before": clean()}
with open("/tmp/main.py", "wb") as f:
    f.write(code)
oom_before = oom_kills()
out_r, out_w = os.pipe()
err_r, err_w = os.pipe()
start = time.monotonic()
pid = os.fork()
if pid == 0:
    try:
        os.setsid()
        # The cgroup OOM killer should take the program's processes before the supervisor or PID 1. Writing our
        # own oom_score_adj needs us dumpable again; nothing else runs now (clean() above), and execve drops the
        # supervisor's memory (and the nonce) anyway.
        ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)
        for limit, value in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, limit), (value, value))
        env = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}
        os.execve("/usr/bin/python3", ["python3", "-I", "-X", "utf8", "/tmp/main.py"], env)
    finally:
        os._exit(127)
os.close(out_w)
os.close(err_w)
os.close(0)
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, cfg["wall_s"])
status.update(exit_code=None, timed_out=False, truncated=False)
try:
    outcome, wait_status = forward(
        {out_r: 1, err_r: 2}, {1: cfg["max_output_bytes"], 2: cfg["max_output_bytes"]}, pid
    )
    if outcome == "exited":
        status["exit_code"] = os.waitstatus_to_exitcode(wait_status)
    else:
        status["truncated"] = True
except WallTimeout:
    status["timed_out"] = True
signal.setitimer(signal.ITIMER_REAL, 0)
status["wall_s"] = time.monotonic() - start
status["clean"] = clean()
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
status["cpu_s"] = usage.ru_utime + usage.ru_stime
status["oom_kills"] = oom_kills() - oom_before
trailer = b"\0" + nonce + json.dumps(status).encode() + b"\n"
while trailer:
    trailer = trailer[os.write(1, trailer) :]
