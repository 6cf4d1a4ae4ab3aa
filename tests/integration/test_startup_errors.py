"""Every bad config of issue 11 stops `trustbatch train` before any work: exit code 2, one message naming the key,
the value and the fix, no traceback, and no run directory written.

The table runs the real `train` command in-process through typer's CliRunner (the same code path as the
console script, without paying the CLI's import time per case); tests/integration/test_cli.py runs a few of
the same configs as real subprocesses. The base config is a tiny synchronous run, so a config that got past
the checks would fail the test in seconds rather than train for long.
"""

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import app
from trainer.model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer, save_model

from .conftest import REPO


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """An untrained tiny model directory (config.json, safetensors, tokenizer): enough to load, quick to make."""
    out = tmp_path_factory.mktemp("startup") / "tiny"
    tokenizer = build_tiny_tokenizer()
    save_model(build_tiny_model(TinyModelConfig(), tokenizer), tokenizer, out)
    return out


def small(tmp_path: Path, model_dir: Path) -> list[str]:
    return [
        f"run.dir={tmp_path / 'run'}",
        f"model.path={model_dir}",
        "model.bootstrap=false",
        "run.steps=1",
        "rollout.engine=embedded",
        "rollout.max_lag=0",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "trainer.micro_batch_size=4",
        "data.num_train=8",
        "data.num_eval=2",
        "eval.num_prompts=2",
        "eval.samples_per_prompt=1",
        "eval.greedy=false",
        "tracking.log_model=false",
        "rewards.num_workers=0",
    ]


def jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


GOOD = {"prompt": "1+1=", "answer": "2"}
LONG = {"prompt": "1+" * 5000 + "1=", "answer": "5001"}  # 10002 tokens for the byte-level tiny tokenizer

# (id, overrides (may use {tmp}), data files to write as {name: rows}, fragments the message must hold)
CASES = [
    (
        "verifier-unknown-param",
        ["rewards.verifiers=[{name: math, params: {bogus: 1}}]"],
        {},
        ["rewards.verifiers[0].params={'bogus': 1}", "unknown parameter(s) ['bogus']", "valid parameters"],
    ),
    (
        "verifier-bad-param-value",
        ["rewards.verifiers=[{name: math, params: {extraction: [first]}}]"],
        {},
        ["rewards.verifiers[0].params", "'first'", "boxed"],
    ),
    ("temperature-nan", ["rollout.temperature=nan"], {}, ["rollout.temperature=nan", "finite", "1.0"]),
    ("temperature-inf", ["rollout.temperature=inf"], {}, ["rollout.temperature=inf", "finite"]),
    ("reward-timeout-inf", ["rewards.timeout_s=inf"], {}, ["rewards.timeout_s=inf", "finite"]),
    (
        "verifier-param-nan",
        ["rewards.verifiers=[{name: math, params: {timeout_s: .nan}}]"],
        {},
        ["rewards.verifiers[0].params.timeout_s=nan", "finite"],
    ),
    ("run-name-slash", ["run.name=a/b"], {}, ["run.name='a/b'", "run.name=a-b"]),
    ("run-name-traversal", ["run.name=../../../x"], {}, ["run.name='../../../x'", "letters, digits"]),
    ("registered-model-name", ["tracking.registered_model=a/b"], {}, ["tracking.registered_model='a/b'"]),
    (
        "override-malformed",
        ["rewards.verifiers=[{name: math"],
        {},
        ["override 'rewards.verifiers=[{name: math'", "`rewards.verifiers`", "not valid YAML"],
    ),
    (
        "override-list-element",
        ["rewards.verifiers[0].weight=0.5"],
        {},
        ["override 'rewards.verifiers[0].weight=0.5'", "whole list"],
    ),
    ("model-path-missing", ["model.path=''"], {}, ["model.path", "is empty"]),
    ("model-path-etc", ["model.path=/etc"], {}, ["model.path='/etc'", "config.json"]),
    (
        "model-path-nonexistent",
        ["model.path={tmp}/no/such/model"],
        {},
        ["model.path=", "no/such/model", "does not exist", "model.bootstrap=true"],
    ),
    (
        "task-without-verifier",
        ["data.train={tmp}/code.jsonl"],
        {"code.jsonl": [{"prompt": "write f", "tests": ["assert f() == 1"]}]},
        ["data.train=", "['code'] have no verifier", "rewards.verifiers[0].tasks=[math, code]"],
    ),
    (
        "row-lone-surrogate",
        ["data.train={tmp}/surrogate.jsonl"],
        {"surrogate.jsonl": [GOOD, {"prompt": "x\ud800", "answer": "1"}]},
        ["surrogate.jsonl: line 2: field 'prompt'", "lone surrogate"],
    ),
    (
        "prompt-too-long-train",
        ["data.train={tmp}/long.jsonl"],
        {"long.jsonl": [GOOD, LONG, GOOD]},
        ["data.train=", "long.jsonl: line 2: prompt has 10002 tokens", "context is 256", "data.on_long_prompt=drop"],
    ),
    (
        "prompt-too-long-eval",
        ["data.eval={tmp}/long_eval.jsonl"],
        {"long_eval.jsonl": [LONG, GOOD]},
        ["data.eval=", "long_eval.jsonl: line 1: prompt has 10002 tokens"],
    ),
    ("tracking-uri-scheme", ["tracking.uri=bogus://x"], {}, ["tracking.uri='bogus://x'", "'bogus'", "sqlite:///"]),
    ("run-dir-proc", ["run.dir=/proc/x"], {}, ["run.dir='/proc/x'", "cannot be created or written"]),
    (
        "tracking-sqlite-proc",
        ["tracking.uri=sqlite:////proc/mlflow.db"],
        {},
        ["tracking.uri='sqlite:////proc/mlflow.db'", "/proc", "sqlite:///<a writable directory>"],
    ),
]


@pytest.mark.parametrize(("overrides", "files", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_stops_train_before_any_work(tmp_path, model_dir, monkeypatch, overrides, files, fragments):
    cwd = tmp_path / "a" / "b" / "c"  # run.name=../../../x must not escape tmp_path even if it were accepted
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    for name, rows in files.items():
        jsonl(tmp_path / name, rows)
    args = [*small(tmp_path, model_dir), *(o.replace("{tmp}", str(tmp_path)) for o in overrides)]
    result = CliRunner().invoke(app, ["train", str(REPO / "configs" / "quickstart.yaml"), *args])
    output = result.output
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.exception, output)
    assert output.startswith("error: ") and output.count("error: ") == 1, output
    for fragment in fragments:
        assert fragment in output, f"{fragment!r} missing from: {output}"
    assert "Traceback" not in output
    assert not (tmp_path / "run").exists() and not (tmp_path / "x").exists() and not (cwd / "runs").exists()


def test_a_yaml_file_that_is_a_list_stops_train(tmp_path, model_dir):
    path = tmp_path / "list.yaml"
    path.write_text("- run: {steps: 1}\n- model: {path: x}\n")
    result = CliRunner().invoke(app, ["train", str(path), *small(tmp_path, model_dir)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.exception, result.output)
    assert f"config file {path} holds a YAML list, not a mapping of sections" in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_drop_trains_without_the_long_prompts_and_counts_them_in_the_log_and_mlflow(tmp_path, model_dir, caplog):
    from mlflow.tracking import MlflowClient

    from app.config import load_config
    from app.training.loop import run

    short = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    train = jsonl(tmp_path / "train.jsonl", [short[0], LONG, short[1], short[2], LONG, short[3]])
    evaluation = jsonl(tmp_path / "eval.jsonl", [LONG, short[4], short[5]])
    overrides = [*small(tmp_path, model_dir), f"data.train={train}", f"data.eval={evaluation}"]
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [*overrides, "data.on_long_prompt=drop"])
    with caplog.at_level("WARNING", logger="trustbatch"):
        summary = run(cfg)
    assert summary["steps"] == 1 and summary["eval_prompts"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("data.train: dropped 2 of 6 prompts longer than 248 tokens" in w for w in warnings), warnings
    assert any("data.eval: dropped 1 of 3 prompts" in w for w in warnings), warnings
    metrics = MlflowClient(tracking_uri=summary["tracking_uri"]).get_run(summary["mlflow_run_id"]).data.metrics
    assert metrics["data/dropped_long_prompts/train"] == 2 and metrics["data/dropped_long_prompts/eval"] == 1
    assert metrics["data/train_prompts"] == 4 and metrics["data/eval_prompts"] == 2


def test_paths_this_user_cannot_look_at_are_a_problem_not_a_traceback(tmp_path):
    """As a user who cannot search /root (uid 65534), stat itself fails: that is reported, never raised."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a check as another uid")
    locked = tmp_path / "locked"
    (locked / "inner").mkdir(parents=True)
    locked.chmod(0o700)
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", sys.executable, "-c"]
    repo = Path(__file__).parents[2]
    # A checkout under a private directory (mktemp -d is 0700) may run the interpreter yet hide the code.
    if subprocess.run([*as_nobody, "import app.config"], capture_output=True, cwd=repo).returncode != 0:
        pytest.skip("this checkout cannot be imported as uid 65534 (a private directory above it)")
    code = (
        "import sys; from app.config import writable_dir_problem; from app.tracking import store_problem; "
        f"print(writable_dir_problem({str(locked / 'inner' / 'run')!r})); "
        f"print(store_problem('sqlite:///{locked / 'inner' / 'mlflow.db'}'))"
    )
    out = subprocess.run([*as_nobody, code], capture_output=True, text=True, cwd=repo)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and all("Permission denied" in line for line in lines), out.stdout
