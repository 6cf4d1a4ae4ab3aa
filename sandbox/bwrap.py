"""The bwrap backend: bubblewrap namespaces around the host's system python, as an unprivileged uid, with rlimits.

One execution is `prlimit ... bwrap ... /usr/bin/python3 -I -X utf8 /sandbox/main.py`, about 30 ms:
- every namespace unshared (no network, private PIDs with the program as PID 1, IPC, UTS, cgroup), a user
  namespace inside which no further user namespaces may be created (--disable-userns);
- a fresh empty root (read-only once set up) with only /usr bound read-only, /proc, a minimal read-only /dev,
  size-capped tmpfs /tmp and /dev/shm, and the code as a read-only file made from a memfd (never in argv, which is capped at 128 KiB);
- started as uid `bwrap_uid_base + slot` (bwrap started as root would keep every capability), one uid per
  concurrently running sandbox (slots are flock()ed files, so they hold across processes too), so no two runs
  share an RLIMIT_NPROC count, and the host can find every process of a run by its uid;
- a minimal environment given to Popen itself (PID 1's /proc/1/environ would otherwise show the host's);
- rlimits CPU, AS, NPROC, FSIZE, NOFILE, CORE set by prlimit, soft = hard.
When PID 1 (the program) exits, the kernel kills everything else in its PID namespace, so nothing outlives a run.
On a timeout or an output overflow the host SIGKILLs bwrap's process group (--die-with-parent takes the program
down) and then every process still running as the slot's uid, and waits until none is left.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from sandbox.base import ExecutionResult, Limits, SandboxConfig, SandboxError, SandboxUnavailable
from sandbox.process import ENV, communicate, kill_group, prlimit_argv, process_result, wait_status

SLOTS = 64
CODE_PATH = "/sandbox/main.py"


class BwrapBackend:
    name = "bwrap"

    def __init__(self, cfg: SandboxConfig):
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxUnavailable("bubblewrap is not installed (apt-get install bubblewrap)")
        self.python = cfg.bwrap_python
        if not os.path.exists(self.python) or not os.path.realpath(self.python).startswith("/usr/"):
            raise SandboxUnavailable(
                f"{self.python} is missing or not under /usr, the only host directory the sandbox sees; "
                "install a system python (apt-get install python3) or set sandbox.bwrap_python"
            )
        prlimit_argv(Limits(), nproc=None)
        self.root = os.geteuid() == 0
        self.uid_base = cfg.bwrap_uid_base
        self.slot_dir = (
            "/run/trustbatch-sandbox"
            if self.root
            else os.path.join(tempfile.gettempdir(), f"trustbatch-sandbox-{os.geteuid()}")
        )
        os.makedirs(self.slot_dir, mode=0o700, exist_ok=True)
        self.next_slot = 0
        self.slot_lock = threading.Lock()
        self.system_dirs = []
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            path = "/" + name
            if os.path.islink(path):
                self.system_dirs += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                self.system_dirs += ["--ro-bind", path, path]
        smoke = self.run("print('ok')", "", Limits(wall_s=20))
        if smoke.stdout != "ok\n":
            hint = ""
            if (
                "uid map" in smoke.stderr
                or "namespace" in smoke.stderr
                or "Operation not permitted" in smoke.stderr
            ):
                hint = (
                    " Unprivileged user namespaces look disabled: sysctl -w kernel.unprivileged_userns_clone=1 "
                    "(Debian) or kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu)."
                )
            raise SandboxUnavailable(
                f"bwrap cannot start a sandbox here (exit {smoke.exit_code}): {smoke.stderr.strip()[:300]}{hint}"
            )

    def close(self) -> None:
        pass

    def _acquire_slot(self, timeout: float) -> tuple[int, int]:
        """A free slot (index, locked fd); an flock()ed file per slot makes this safe across processes."""
        deadline = time.monotonic() + timeout
        while True:
            with self.slot_lock:
                first = self.next_slot
                self.next_slot = (self.next_slot + 1) % SLOTS
            for i in range(SLOTS):
                slot = (first + i) % SLOTS
                fd = os.open(
                    os.path.join(self.slot_dir, f"slot-{slot}.lock"),
                    os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                    0o600,
                )
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return slot, fd
                except BlockingIOError:
                    os.close(fd)
            if time.monotonic() > deadline:
                raise SandboxError(f"all {SLOTS} bwrap sandbox slots stayed busy for {timeout:.0f} s")
            time.sleep(0.01)

    def _argv(self, limits: Limits, code_fd: int, code_size: int) -> list[str]:
        # fmt: off
        return [
            *prlimit_argv(limits, nproc=limits.max_processes + 1 + self._foreign_tasks(), min_fsize=code_size),
            self.bwrap,
            "--unshare-all", "--unshare-user", "--disable-userns",
            "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL",
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr", *self.system_dirs,
            "--proc", "/proc",
            # bwrap's /dev is a writable tmpfs with no size cap: give /dev/shm its own capped tmpfs and make the
            # rest read-only, so /tmp and /dev/shm (tmpfs_mb each) are the only writable places.
            "--dev", "/dev", "--size", str(limits.tmpfs_mb << 20), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
            "--size", str(limits.tmpfs_mb << 20), "--tmpfs", "/tmp",
            "--ro-bind-data", str(code_fd), CODE_PATH,
            "--remount-ro", "/",
            "--chdir", "/tmp",
            "--", self.python, "-I", "-X", "utf8", CODE_PATH,
        ]
        # fmt: on

    def _foreign_tasks(self) -> int:
        """Tasks the sandbox's uid already runs outside it: RLIMIT_NPROC counts them too. Zero for a slot uid;
        without root the sandbox runs as the caller, whose own processes must not eat the program's budget."""
        if self.root:
            return 0
        uid, count = str(os.getuid()), 0
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if fields["Uid"].split()[0] == uid:
                    count += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                continue
        return count

    def run(self, code: str, stdin: str, limits: Limits) -> ExecutionResult:
        code_bytes = code.encode("utf-8", errors="surrogatepass")
        slot, lock_fd = self._acquire_slot(timeout=60 + 10 * limits.wall_s)
        start = time.monotonic()  # the wall limit is the program's: waiting for a free slot does not count
        uid = self.uid_base + slot
        code_fd = -1
        try:
            code_fd = os.memfd_create("trustbatch-code", os.MFD_CLOEXEC)
            view = memoryview(code_bytes)
            while view:
                view = view[os.write(code_fd, view) :]
            os.lseek(code_fd, 0, os.SEEK_SET)
            ids = {"user": uid, "group": uid, "extra_groups": []} if self.root else {}
            try:
                proc = subprocess.Popen(
                    self._argv(limits, code_fd, len(code_bytes)),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=ENV,
                    cwd="/",
                    start_new_session=True,
                    pass_fds=(code_fd,),
                    **ids,
                )
            except OSError as e:
                raise SandboxError(f"could not start bwrap: {e}") from e
            os.close(code_fd)
            code_fd = -1
            with proc:
                out, err, timed_out, truncated = communicate(
                    proc, stdin.encode("utf-8", errors="surrogatepass"), limits, start + limits.wall_s
                )
                if timed_out or truncated:
                    kill_group(proc)
                returncode, cpu = wait_status(proc)
                if self.root and (timed_out or truncated):
                    self._kill_uid(uid)
        finally:
            if code_fd >= 0:
                os.close(code_fd)
            os.close(lock_fd)
        # bwrap exits with the program's status, or 128 + N when a signal N killed it.
        exit_code = -(returncode - 128) if 128 < returncode < 128 + 65 else returncode
        return process_result(
            out,
            err,
            exit_code,
            cpu,
            timed_out=timed_out,
            truncated=truncated,
            start=start,
            limits=limits,
            backend=self.name,
        )

    @staticmethod
    def _kill_uid(uid: int, timeout: float = 5.0) -> None:
        """SIGKILL every live process whose real uid is `uid` and wait until none is left (root only)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = False
            for name in os.listdir("/proc"):
                if not name.isdigit():
                    continue
                try:
                    with open(f"/proc/{name}/status") as f:
                        fields = dict(line.split(":", 1) for line in f if ":" in line)
                except OSError:
                    continue
                if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
                    found = True
                    try:
                        os.kill(int(name), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if not found:
                return
            time.sleep(0.005)
        raise SandboxError(f"processes of sandbox uid {uid} survived SIGKILL for {timeout} s")
