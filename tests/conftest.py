"""Shared test set-up: one torch thread per process (two threads on two busy cores stall), no hub access."""

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


HEAVY = "heavy"
"""The xdist group of the tests that each keep both cores busy for a minute or more (real SGLang, SmolLM2,
several processes under torchrun): `make test` runs two workers (pytest-xdist, --dist loadgroup), and these run one
after another on one of them, so that two never thrash the two cores together; everything else spreads over both."""


def _heavy(item) -> bool:
    path = str(item.path)
    if "/tests/sglang/" in path or "/tests/gpu/" in path:
        return True
    if any(name in path for name in ("test_real_model", "test_convert_gguf", "test_code_rl", "test_multinode",
                                     "test_distributed", "test_reproducibility")):  # fmt: skip
        return True
    fixtures = getattr(item, "fixturenames", ())
    return any(name.startswith("smollm2") or name in ("converted", "trained", "served", "perturbed") for name in fixtures)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the group into each test's node id
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _heavy(item):
            item.add_marker(pytest.mark.xdist_group(HEAVY))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Fail at once where pytest-xdist could not group the heavy tests: pytest 9.2 keeps a test's id where xdist
    3.8 no longer writes the group into it, and the heavy tests then ran two at a time (CI took 28 minutes)."""
    if not getattr(session.config.option, "loadgroup", False):  # set on the workers of --dist loadgroup only
        return
    lost = [item.nodeid for item in session.items if _heavy(item) and not item.nodeid.endswith(f"@{HEAVY}")]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not put {len(lost)} heavy test(s) in the {HEAVY!r} group (e.g. {lost[0]}): this "
            "pytest and pytest-xdist disagree on how a test's id is stored; install the versions pyproject.toml "
            "allows (pip install -e '.[dev]')"
        )


TIMES_ENV = "TRUSTBATCH_TEST_TIMES"
"""A file that gets one JSON line per test phase (node id, phase, worker, start, stop, duration) when set: `.ci/run`
sets it, and bench/ci_times.py tells from it where the suite's wall time goes (each worker's busy time, the heavy
group's share, the slowest tests)."""


def pytest_runtest_logreport(report):
    path = os.environ.get(TIMES_ENV)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # an xdist worker reports to the controller, which writes
        return
    node = getattr(report, "node", None)  # the xdist worker that ran it (absent without xdist)
    row = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
           "worker": getattr(getattr(node, "gateway", None), "id", "main"), "start": getattr(report, "start", None),
           "stop": getattr(report, "stop", None), "duration": report.duration}  # fmt: skip
    with open(path, "a") as out:
        out.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------ the real pretrained model (make smollm2)


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _need_smollm2(path, what: str):
    """`path` when it is there; else skip with the command that builds it, or fail under CI=true (CI builds it)."""
    from app.convert import is_converted

    ok = is_converted(path) if what == "model" else path.is_file()
    if ok:
        return path
    reason = f"no {what} of SmolLM2-135M-Instruct at {path}; build the cache with: make smollm2"
    if _under_ci():
        pytest.fail(f"{reason} (CI runs it before the tests, so it must be there)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted SmolLM2-135M-Instruct Hugging Face directory in the trustbatch cache (`make smollm2`)."""
    from app.convert import smollm2_paths

    return _need_smollm2(smollm2_paths()["model"], "model")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The SmolLM2-135M-Instruct Q4_1 GGUF file that `make smollm2` keeps in the trustbatch cache."""
    from app.convert import smollm2_paths

    return _need_smollm2(smollm2_paths()["gguf"], "GGUF file")
