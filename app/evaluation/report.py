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
