"""The bodies of the `trustbatch` commands that outgrew app/cli.py's plumbing: `eval --bench` and `data`.

Each returns the exit code; a problem the user can fix is printed as one line and gives 2, as in app/cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def _error(message: str, code: int = 2) -> int:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return code


def _console():
    from rich.console import Console

    return Console() if Console().is_terminal else Console(width=160)


def eval_benchmarks(ref: str, names: list[str], bench_dir: Path | None, *, config, engine, max_new_tokens, num_prompts,
                    out, track, tracking_uri, dtype, sglang_python, threads) -> int:  # fmt: skip
    """`trustbatch eval MODEL --bench ...`: every benchmark as its entry says; one table, JSON and MLflow run."""
    import torch

    from app.config import ConfigError, load_config
    from app.data import DatasetError
    from app.evaluation.command import run_benchmarks
    from app.evaluation.report import report_benchmarks
    from app.models import ModelRefError
    from app.stopping import Stopped, Stopping

    overrides = [f"rollout.dtype={dtype}"] if dtype else []  # an unknown name fails in run_benchmarks, before a model
    if sglang_python:
        overrides.append(f"rollout.sglang.launch.python={json.dumps(sglang_python)}")
    try:
        cfg = load_config(config, overrides)
    except (ConfigError, ValueError) as exc:
        return _error(str(exc))
    torch.set_num_threads(threads)
    uri = cfg.tracking.uri or tracking_uri

    def stop(signum: int) -> None:
        raise Stopped(signum)

    try:
        with Stopping("eval", waiting="dropping the samples so far and stopping the engine", on_first=stop).installed():
            results = run_benchmarks(ref, cfg.eval_job, names, tracking_uri=uri, engine=engine, mirror=bench_dir,
                                     max_new_tokens=max_new_tokens, num_prompts=num_prompts, out=out, track=track)  # fmt: skip
    except Stopped as exc:
        typer.secho(str(exc), fg=typer.colors.YELLOW, err=True)
        return exc.exit_code
    except (ModelRefError, DatasetError, ValueError, OSError) as exc:
        return _error(str(exc))
    report_benchmarks(results, names, bench_dir, uri, out)
    return 0


def check_data(cfg, *, check_references: bool) -> int:
    """`trustbatch data CONFIG`: the report of app/data_command.py; 1 when a reference fails its verifiers."""
    from app.data import DatasetError
    from app.data_command import data_report, print_report
    from app.training.setup import early_text

    try:
        report = data_report(cfg, early_text(cfg), check_references=check_references)
    except (DatasetError, ValueError) as exc:
        return _error(str(exc))
    print_report(report, _console())
    return 1 if report.reference_failures else 0
