"""The `trustbatch` command as a user runs it: exit codes, messages, no tracebacks."""

import os
import subprocess
import sys

import pytest

from app.config import load_config, to_yaml

from .conftest import REPO


def trustbatch(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_print_config_prints_the_resolved_config():
    out = trustbatch("print-config", "configs/quickstart.yaml", "optim.lr=1e-4")
    assert out.returncode == 0, out.stderr
    assert out.stdout == to_yaml(load_config(REPO / "configs/quickstart.yaml", ["optim.lr=1e-4"]))


def test_print_config_without_a_file_prints_the_defaults():
    out = trustbatch("print-config")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (REPO / "configs" / "base.yaml").read_text()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["print-config", "configs/quickstart.yaml", "optim.lrr=1"], "Did you mean"),
        (["train", "configs/quickstart.yaml", "run.steps=abc"], "run.steps"),
        (["train", "configs/quickstart.yaml", "objective.name=grpo"], "objective.name"),
        (["train", "configs/quickstart.yaml", "rollout.group_size=1"], "rollout.group_size"),
        (["train", "configs/nope.yaml"], "does not exist"),
        (["train", "configs/base.yaml"], "model.path"),
        # issue 11: these passed the config stage and failed late, with a traceback (or never)
        (["train", "configs/quickstart.yaml", "rollout.temperature=nan"], "rollout.temperature=nan must be a finite"),
        (
            ["train", "configs/quickstart.yaml", "rewards.verifiers=[{name: math, params: {bogus: 1}}]"],
            "rewards.verifiers[0].params={'bogus': 1}",
        ),
        (["train", "configs/quickstart.yaml", "rewards.verifiers=[{name: math"], "`rewards.verifiers` is not valid YAML"),
        (["train", "configs/quickstart.yaml", "run.name=../../../x"], "run.name='../../../x' is not a valid name"),
    ],
)
def test_bad_config_exits_2_with_one_clear_message(args, fragment):
    out = trustbatch(*args)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert fragment in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
