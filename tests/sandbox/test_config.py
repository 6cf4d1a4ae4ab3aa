"""Limits and SandboxConfig validation, omegaconf compatibility, and the refusal to run without a sandbox."""

from dataclasses import dataclass, field

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

import sandbox
from sandbox import Limits, SandboxConfig, SandboxUnavailable, execute


@pytest.fixture
def restore_config():
    yield
    sandbox.configure(SandboxConfig())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"wall_s": 0}, "limits.wall_s=0"),
        ({"memory_mb": 8}, "limits.memory_mb=8"),
        ({"max_processes": 0}, "limits.max_processes=0"),
        ({"max_output_bytes": "1k"}, "limits.max_output_bytes='1k' is not a number"),
        ({"cpu_s": float("nan")}, "limits.cpu_s=nan is not a number"),
        ({"tmpfs_mb": True}, "limits.tmpfs_mb=True is not a number"),
    ],
)
def test_bad_limits_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        Limits(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backend": "podman"}, "sandbox.backend='podman'"),
        ({"backend": "none"}, "sandbox.allow_unsandboxed=true"),
        ({"pool_size": 0}, "sandbox.pool_size=0"),
        ({"docker_cpus": 0}, "sandbox.docker_cpus=0"),
        ({"bwrap_python": "/root/.pyenv/shims/python3"}, "sandbox.bwrap_python="),
        ({"bwrap_uid_base": 0}, "sandbox.bwrap_uid_base=0"),
    ],
)
def test_bad_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SandboxConfig(**kwargs)


@dataclass
class Root:
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


def test_structured_config_loads_and_validates():
    base = OmegaConf.structured(Root)
    cfg = OmegaConf.to_object(
        OmegaConf.merge(base, OmegaConf.from_dotlist(["sandbox.docker_runtime=runsc", "sandbox.pool_size=2"]))
    )
    assert cfg.sandbox.docker_runtime == "runsc" and cfg.sandbox.pool_size == 2
    with pytest.raises(ValidationError, match="expected one of"):
        OmegaConf.merge(base, OmegaConf.from_dotlist(["sandbox.backend=podman"]))
    with pytest.raises(ValueError, match="sandbox.pool_size=0"):
        OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.from_dotlist(["sandbox.pool_size=0"])))


def test_backend_none_is_refused_without_allow_unsandboxed():
    with pytest.raises(SandboxUnavailable, match="allow_unsandboxed"):
        execute("print(1)", backend="none")


def test_backend_none_runs_when_explicitly_allowed(restore_config):
    sandbox.configure(SandboxConfig(allow_unsandboxed=True))
    result = execute("import sys; print(sys.stdin.read()[::-1])", stdin="abc", backend="none")
    assert (result.stdout, result.exit_code, result.backend) == ("cba\n", 0, "none")


def test_backend_none_still_enforces_the_wall_clock(restore_config):
    sandbox.configure(SandboxConfig(allow_unsandboxed=True))
    result = execute("import time; time.sleep(60)", limits=Limits(wall_s=0.5), backend="none")
    assert result.timed_out and result.wall_s < 30  # killed, not left to sleep its 60 s (slack for a busy machine)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="one of"):
        execute("print(1)", backend="podman")


def test_auto_picks_docker_else_bwrap():
    available = sandbox.available_backends()
    if all(reason is not None for reason in available.values()):
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
            execute("print(1)")
        return
    expected = "docker" if available["docker"] is None else "bwrap"
    assert execute("print(1)").backend.startswith(expected)


def test_missing_image_is_explained(restore_config):
    sandbox.configure(SandboxConfig(docker_image="trustbatch-sandbox:does-not-exist"))
    reason = sandbox.available_backends()["docker"]
    assert reason is not None and ("is missing" in reason or "no Docker engine" in reason or "SDK" in reason)
