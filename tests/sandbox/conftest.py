"""Backend parametrization for the sandbox tests: every test runs on each backend this machine has.

A backend that cannot run here skips with the reason (e.g. no Docker engine answers). CI sets
TRUSTBATCH_SANDBOX_REQUIRE=bwrap,docker after .ci/setup-sandbox.sh, so a missing backend fails there instead.
"""

import os

import pytest

from sandbox import available_backends

BACKENDS = [pytest.param("bwrap", id="bwrap"), pytest.param("docker", id="docker", marks=pytest.mark.docker)]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    name = request.param
    reason = available_backends()[name]
    if reason is not None:
        required = {b.strip() for b in os.environ.get("TRUSTBATCH_SANDBOX_REQUIRE", "").split(",")}
        if name in required:
            pytest.fail(f"TRUSTBATCH_SANDBOX_REQUIRE has {name}, but it cannot run: {reason}")
        pytest.skip(f"{name} backend unavailable: {reason}")
    return name


def processes_with(marker: str) -> list[int]:
    """Host-side view: pids of live (non-zombie) processes whose command line contains `marker`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != b"Z":
            found.append(int(pid))
    return found
