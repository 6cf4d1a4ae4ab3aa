"""What `trustbatch eval` reports of an `EvalResult`: the table it prints, the JSON of ``--out``, an MLflow run.

MLflow: each evaluation is a new run (experiment ``tracking.experiment``, default ``trustbatch``; run name
``eval <reference>``; tag ``trustbatch.kind = eval``) with params (the reference, the resolved registry version
and run, the data, n, k, the sampling settings, the engine), metrics ``eval/pass_at_<k>`` and
``eval/pass_at_<k>/stderr``, ``eval/reward_error_rate``, ``eval/completion_tokens/mean``, ``eval/answer_rate``,
``eval/num_prompts``, ``eval/dropped_long_prompts``, ``timing/eval/*``, and the results JSON as an artifact.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from app.evaluation.run import EvalResult
from app.tracking import Tracker, TrackingConfig


def settings_record(result: EvalResult) -> dict:
    """The settings an evaluation ran with, under the names of `trustbatch eval`'s options."""
    s = result.settings
    assert s is not None, "an evaluation of `trustbatch eval` carries its settings"
    return {
        "data": result.data,
        "k": s.k,
        "samples": s.samples_per_prompt,
        "num_prompts": s.num_prompts,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_new_tokens": s.max_new_tokens,
        "seed": s.seed,
        "max_batch_size": result.max_batch_size,
        "engine": result.engine,
        "dtype": result.dtype,
    }


def timings(result: EvalResult) -> dict[str, float]:
    total = len(result.samples)
    return {
        "generate_s": result.generate_s,
        "score_s": result.score_s,
        "completions_per_s": total / result.generate_s if result.generate_s > 0 else float("nan"),
    }


def metrics(result: EvalResult) -> dict[str, float]:
    """Flat metric names as logged to MLflow (MLflow names allow no '@')."""
    out = {}
    assert result.settings is not None
    for k, estimate in result.pass_at_ks(result.settings.k).items():
        out[f"eval/pass_at_{k}"] = estimate.value
        if math.isfinite(estimate.stderr):
            out[f"eval/pass_at_{k}/stderr"] = estimate.stderr
    out["eval/reward_error_rate"] = result.error_rate
    out["eval/completion_tokens/mean"] = result.mean_completion_tokens
    if result.answer_rate is not None:
        out["eval/answer_rate"] = result.answer_rate
    out["eval/num_prompts"] = float(len(result.rows))
    out["eval/dropped_long_prompts"] = float(result.dropped)
    for key, value in timings(result).items():
        out[f"timing/eval/{key}"] = value
    out.update({f"eval/{key}": value for key, value in result.rollout_metrics.items()})
    for name, (accuracy, se, _) in result.by_source().items():
        out[f"eval/source/{name}/pass_at_1"] = accuracy
        out[f"eval/source/{name}/pass_at_1/stderr"] = se
    return out


def _per_s(rate: float) -> str:
    """Whole numbers from 10 up, two decimals below (a real model on CPU: 0.26 completions/s, not 0)."""
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2f}"


def to_json(result: EvalResult) -> dict:
    """Every prompt with its completions, verdicts and pass@k, and the summary (what ``--out`` writes)."""
    assert result.settings is not None and result.model is not None
    source, passes = result.model, result.pass_at_ks(result.settings.k)
    return {
        "model": {
            "ref": source.ref,
            "path": result.model_dir,
            "name": source.name,
            "version": source.version,
            "alias": source.alias,
            "run_id": source.run_id,
        },
        "settings": settings_record(result),
        "num_prompts": len(result.rows),
        "dropped_long_prompts": result.dropped,
        "metrics": {
            f"pass@{k}": {"value": r.value, "stderr": r.stderr if math.isfinite(r.stderr) else None}
            for k, r in passes.items()
        },
        "reward_error_rate": result.error_rate,
        "answer_rate": result.answer_rate,
        "completion_tokens_mean": result.mean_completion_tokens,
        "rollout_metrics": result.rollout_metrics,
        "by_source": {name: {"pass@1": a, "stderr": se, "prompts": n} for name, (a, se, n) in result.by_source().items()},
        "timings": timings(result),
        "tracking_uri": result.tracking_uri,
        "mlflow_run_id": result.mlflow_run_id,
        "prompts": [
            {
                "id": row.id,
                "task": row.task,
                "prompt": row.prompt,
                "messages": row.messages,
                "answer": row.answer,
                "metadata": row.metadata,
                "samples": result.n,
                "correct": result.correct[i],
                "pass_at": {str(k): r.per_prompt[i] for k, r in passes.items()},
                "completions": [s.record() for s in group],
            }
            for i, (row, group) in enumerate(zip(result.rows, result.by_prompt, strict=True))
        ],
    }


def write_json(result: EvalResult, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(result), indent=2) + "\n")


def log_to_mlflow(result: EvalResult, *, experiment: str = "trustbatch") -> str:
    """Log ``result`` as a new finished MLflow run in its tracking store; returns the run id."""
    source = result.model
    assert source is not None
    tags = {"trustbatch.kind": "eval", "trustbatch.model_ref": source.ref}
    for key in ("name", "version", "run_id"):
        if getattr(source, key):
            tags[f"trustbatch.model_{key}"] = str(getattr(source, key))
    tracker = Tracker(
        TrackingConfig(uri=result.tracking_uri, experiment=experiment),
        None,
        run_name=f"eval {source.ref}"[:250],
        tags=tags,
    )
    tracker.log_params(
        {
            "model.ref": source.ref,
            "model.path": result.model_dir,
            "model.name": source.name or "",
            "model.version": source.version or "",
            "model.run_id": source.run_id or "",
            **{f"eval.{key}": value for key, value in settings_record(result).items()},
            "eval.num_prompts_used": len(result.rows),
        }
    )
    tracker.log_metrics(metrics(result), step=0)
    result.mlflow_run_id = tracker.run_id
    tracker.log_text(json.dumps(to_json(result), indent=2), "eval_results.json")
    tracker.finish()
    assert tracker.run_id is not None
    return tracker.run_id


def results_table(result: EvalResult):
    """What `trustbatch eval` prints: a header line, a rich Table of pass@k with standard errors, a footer."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    s = result.settings
    assert s is not None and result.model is not None
    dropped = f" ({result.dropped} too long, dropped)" if result.dropped else ""
    header = Text(
        f"{result.model.label}\n{result.data}: {len(result.rows)} prompts{dropped} x {s.samples_per_prompt} "
        f"samples, temperature {s.temperature:g}, top_p {s.top_p:g}, at most {s.max_new_tokens} new tokens, "
        f"seed {s.seed}, engine {result.engine}"
    )
    table = Table()
    table.add_column("metric")
    table.add_column("estimate", justify="right")
    table.add_column("± s.e. (points)", justify="right")
    for k, estimate in result.pass_at_ks(s.k).items():
        stderr = f"{100 * estimate.stderr:.2f}" if math.isfinite(estimate.stderr) else "-"
        table.add_row(f"pass@{k}", f"{100 * estimate.value:.2f}%", stderr)
    if result.answer_rate is not None:
        table.add_row("answer found (format)", f"{100 * result.answer_rate:.2f}%", "")
    table.add_row("verifier error rate", f"{100 * result.error_rate:.2f}%", "")
    table.add_row("completion tokens (mean)", f"{result.mean_completion_tokens:.1f}", "")
    for name, (accuracy, se, prompts) in result.by_source().items():
        table.add_row(f"pass@1, {name} ({prompts} prompts)", f"{100 * accuracy:.2f}%", f"{100 * se:.2f}")
    tools = result.rollout_metrics
    if tools:
        table.add_row("tool calls per answer", f"{tools['tools/calls_per_trajectory']:.2f}", "")
        table.add_row("tool error rate", f"{100 * tools['tools/error_rate']:.2f}%", "")
        table.add_row("turns per answer", f"{tools['rollout/turns/mean']:.2f}", "")
        statuses = ", ".join(
            f"{key.rpartition('/')[2]} {100 * value:.1f}%" for key, value in tools.items()
            if key.startswith("rollout/status/") and value > 0
        )  # fmt: skip
        table.add_row("answers ended", statuses, "")
    t = timings(result)
    footer = Text(
        f"pass@k = 1 - C(n-c,k)/C(n,k) per prompt, averaged; s.e. clustered by prompt. Sampling "
        f"{t['generate_s']:.1f} s ({_per_s(t['completions_per_s'])} completions/s), scoring {t['score_s']:.1f} s.",
        style="dim",
    )
    return Group(header, table, footer)


def benchmark_rows(results: dict[str, EvalResult], benches) -> list[dict]:
    """One record per benchmark: its metric, pass@1 (or avg@n) and pass@k with SEs, prompts and samples."""
    rows = []
    for bench in benches:
        result = results[bench.name]
        passes = result.pass_at_ks(bench.k)
        first, last = passes[1], passes[max(passes)]
        rows.append({
            "benchmark": bench.name, "metric": bench.metric, "prompts": len(result.rows), "samples": result.n,
            "pass@1": first.value, "pass@1_stderr": first.stderr if math.isfinite(first.stderr) else None,
            f"pass@{bench.k}": last.value, f"pass@{bench.k}_stderr": last.stderr if math.isfinite(last.stderr) else None,
            "answer_rate": result.answer_rate, "pinned": bench.pinned, "data": result.data,
        })  # fmt: skip
    return rows


def write_benchmarks(results: dict[str, EvalResult], benches, path: Path) -> None:
    """``--out`` of `trustbatch eval --bench`: the table, and every benchmark's full results (`to_json`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"table": benchmark_rows(results, benches), "benchmarks": {name: to_json(r) for name, r in results.items()}}
    path.write_text(json.dumps(body, indent=2) + "\n")


def log_benchmarks(results: dict[str, EvalResult], benches, *, experiment: str = "trustbatch") -> str:
    """One MLflow run for a `--bench` evaluation: ``bench/<name>/pass_at_<k>`` (and stderr) per benchmark."""
    first = next(iter(results.values()))
    source = first.model
    assert source is not None
    tracker = Tracker(TrackingConfig(uri=first.tracking_uri, experiment=experiment), None,
                      run_name=f"bench {source.ref}"[:250],
                      tags={"trustbatch.kind": "benchmarks", "trustbatch.model_ref": source.ref})  # fmt: skip
    tracker.log_params({"model.ref": source.ref, "model.path": first.model_dir, "benchmarks": ",".join(results)})
    metrics = {}
    for row in benchmark_rows(results, benches):
        for key in [k for k in row if k.startswith("pass@") and not k.endswith("_stderr")]:
            metrics[f"bench/{row['benchmark']}/{key.replace('@', '_at_')}"] = row[key]
            if row[f"{key}_stderr"] is not None:
                metrics[f"bench/{row['benchmark']}/{key.replace('@', '_at_')}/stderr"] = row[f"{key}_stderr"]
    tracker.log_metrics(metrics, step=0)
    tracker.log_text(json.dumps({"table": benchmark_rows(results, benches)}, indent=2), "benchmarks.json")
    tracker.finish()
    assert tracker.run_id is not None
    return tracker.run_id


def benchmarks_table(results: dict[str, EvalResult], benches):
    """What `trustbatch eval --bench` prints: one row per benchmark, its metrics with SEs."""
    from rich.table import Table

    table = Table(title=f"{next(iter(results.values())).model.label}: benchmarks")
    for column in ("benchmark", "metric", "prompts", "pass@1 / avg@n", "± s.e.", "pass@k", "± s.e.", "answer found"):
        table.add_column(column, justify="left" if column in ("benchmark", "metric") else "right")
    for row in benchmark_rows(results, benches):
        k = [key for key in row if key.startswith("pass@") and key != "pass@1" and not key.endswith("_stderr")]
        last = k[0] if k else "pass@1"

        def pct(x):
            return "-" if x is None else f"{100 * x:.2f}"

        table.add_row(row["benchmark"] + ("" if row["pinned"] else " (unpinned)"), row["metric"], str(row["prompts"]),
                      pct(row["pass@1"]), pct(row["pass@1_stderr"]), pct(row[last]) if last != "pass@1" else "-",
                      pct(row.get(f"{last}_stderr")) if last != "pass@1" else "-",
                      pct(row["answer_rate"]))  # fmt: skip
    return table


def report_benchmarks(results: dict[str, EvalResult], names: list[str], mirror, uri: str, out: Path | None) -> None:
    """Print what `trustbatch eval --bench` measured: the table, the MLflow run, the JSON file."""
    from rich.console import Console

    from app.evaluation.benchmarks import resolve

    console = Console() if Console().is_terminal else Console(width=160)
    console.print(benchmarks_table(results, resolve(names, mirror)))
    run_id = next(iter(results.values())).mlflow_run_id
    if run_id:
        console.print(f"MLflow run {run_id} in {uri}")
    if out is not None:
        console.print(f"results: {out}")
