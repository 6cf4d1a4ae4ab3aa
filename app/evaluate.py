"""`trustbatch eval`: pass@1 and pass@k of any model reference on a prompt set, with clustered standard errors.

Pipeline: resolve the reference (app/models.py) -> load the prompts (a JSONL / Parquet file, or the test split
of a built-in task such as ``builtin:arithmetic``) -> render each one (the chat template for ``messages`` rows,
as in training) -> sample n completions per prompt with the built-in engine (``EmbeddedEngine``, batched) ->
score every completion with the configured verifiers (the reward runner, a process pool with time limits) ->
per prompt, the number c of correct completions -> pass@k.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
eq. 1): for a prompt with n samples of which c are correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``, the chance
that k samples drawn without replacement from the n include a correct one (so pass@1 = c / n). It is averaged
over prompts, and its standard error is clustered by prompt like every accuracy of app/eval.py: the standard
deviation of the per-prompt values over sqrt(#prompts). Drawing n > k samples (``--samples``) lowers the
variance of pass@k without biasing it. Reported: k = 1, the powers of two below k, and k.

A completion is correct when its task's first verifier that judges correctness says so (``Score.correct``); a
verifier error or timeout counts as incorrect and shows in the error rate.

Each evaluation is logged as a new MLflow run in the store (experiment ``tracking.experiment`` of ``--config``,
default ``trustbatch``; run name ``eval <reference>``; tag ``trustbatch.kind = eval``): params (the reference,
the resolved registry version and run, the data, n, k, the sampling settings), metrics ``eval/pass_at_<k>`` and
``eval/pass_at_<k>/stderr``, ``eval/reward_error_rate``, ``eval/completion_tokens/mean``, and the results JSON
as an artifact.

Not covered: greedy accuracy as such (``--temperature 0 --k 1`` measures it), sampling with SGLang, several
processes or GPUs. The same reference, prompts, settings and seed give the same samples; each batch of prompts
draws from its own generator seeded with seed + batch index, so the samples of a prompt also depend on which
prompts share its batch (another --num-prompts or --max-batch-size draws differently).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.data import (
    BUILTIN_PREFIX,
    BUILTIN_TASKS,
    FILE_EXTENSIONS,
    DataConfig,
    DatasetError,
    PromptRow,
    load_prompts,
)
from app.eval import clustered_stderr
from app.models import ModelSource

DEFAULT_BUILTIN_PROMPTS = 500
"""Prompts taken from a built-in task's test split when --num-prompts is not given."""


# ---------------------------------------------------------------------------------------------- pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``n`` samples, ``c`` of them correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: correct count c={c} must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in [1, n={n}] (draw at least k samples per prompt)")
    # Exact integers, one rounding: 1 - ratio would lose the digits of a small pass@k (large n, few correct).
    # With fewer than k incorrect samples C(n-c, k) = 0: every draw holds a correct one.
    draws = math.comb(n, k)
    return (draws - math.comb(n - c, k)) / draws


@dataclass(frozen=True)
class PassAtK:
    k: int
    value: float
    """Mean over prompts of the per-prompt estimates."""
    stderr: float
    """Clustered by prompt (NaN with fewer than two prompts)."""
    per_prompt: list[float]


def summarize(correct: list[int], n: int, k: int) -> PassAtK:
    """pass@k over prompts from each prompt's correct count (``n`` samples each)."""
    if not correct:
        raise ValueError("summarize: no prompts")
    per_prompt = [pass_at_k(n, c, k) for c in correct]
    return PassAtK(k, sum(per_prompt) / len(per_prompt), clustered_stderr(per_prompt), per_prompt)


def reported_ks(k: int) -> list[int]:
    """1, the powers of two below k, and k."""
    ks, power = {1, k}, 2
    while power < k:
        ks.add(power)
        power *= 2
    return sorted(ks)


# ---------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class EvalSettings:
    """What `trustbatch eval` measures and how it samples."""

    data: str = "builtin:arithmetic"
    """A .jsonl / .parquet prompt file, or builtin:<task> (its test split)."""
    k: int = 8
    """The k of pass@k."""
    samples: int | None = None
    """Samples per prompt (n); at least k. None: n = k."""
    num_prompts: int | None = None
    """Evaluate the first N prompts; None: a whole file, or DEFAULT_BUILTIN_PROMPTS of a built-in task."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    max_batch_size: int = 256
    """Sequences the engine decodes together."""

    @property
    def n(self) -> int:
        return self.samples if self.samples is not None else self.k

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"--k {self.k}: k must be >= 1")
        if self.samples is not None and self.samples < self.k:
            raise ValueError(
                f"--samples {self.samples} is below --k {self.k}: pass@k needs at least k samples per prompt; "
                f"raise --samples or lower --k"
            )
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts {self.num_prompts} must be >= 1")
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"--temperature {self.temperature} must be in [0, 2] (0 = greedy)")
        if self.temperature == 0 and self.n > 1:
            raise ValueError(
                f"--temperature 0 is greedy: all {self.n} samples of a prompt would be the same; use --k 1 "
                "(greedy accuracy) or a temperature > 0"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens} must be >= 1")
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size {self.max_batch_size} must be >= 1")


def load_eval_prompts(
    data: str, num_prompts: int | None, data_cfg: DataConfig | None = None
) -> list[PromptRow]:
    """The prompts of ``data``: a whole file (or its first ``num_prompts`` rows), or a built-in test split."""
    data_cfg = data_cfg or DataConfig()
    if data.startswith(BUILTIN_PREFIX):
        name = data[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_TASKS:
            raise DatasetError(
                f"--data {data!r}: unknown built-in task {name!r}; choose one of "
                f"{[BUILTIN_PREFIX + t for t in BUILTIN_TASKS]} or give a .jsonl / .parquet file"
            )
        task = BUILTIN_TASKS[name]
        count = num_prompts or DEFAULT_BUILTIN_PROMPTS
        try:
            return task.generate(getattr(data_cfg, task.config_field), "test", count)
        except ValueError as exc:
            raise DatasetError(f"--data {data}: {exc}") from None
    if Path(data).suffix not in FILE_EXTENSIONS:
        raise DatasetError(
            f"--data {data!r} is neither builtin:<task> nor a file ending in {' / '.join(FILE_EXTENSIONS)}; "
            "e.g. --data builtin:arithmetic or --data prompts.jsonl"
        )
    rows = load_prompts(data)
    return rows[:num_prompts] if num_prompts is not None else rows


# ---------------------------------------------------------------------------------------------- evaluation


@dataclass
class EvalReport:
    """Everything one evaluation measured; ``to_json()`` is what --out writes."""

    source: ModelSource
    model_dir: str
    settings: EvalSettings
    rows: list[PromptRow]
    texts: list[list[str]]
    """Completions per prompt (n each)."""
    correct: list[list[bool]]
    rewards: list[list[float]]
    errors: list[list[str | None]]
    finish_reasons: list[list[str]]
    completion_tokens: list[list[int]]
    pass_at: dict[int, PassAtK]
    timings: dict[str, float]
    reward_metrics: dict[str, float]
    tracking_uri: str = ""
    mlflow_run_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def error_rate(self) -> float:
        flat = [e for group in self.errors for e in group]
        return sum(e is not None for e in flat) / len(flat)

    @property
    def mean_completion_tokens(self) -> float:
        flat = [t for group in self.completion_tokens for t in group]
        return sum(flat) / len(flat)

    def metrics(self) -> dict[str, float]:
        """Flat metric names as logged to MLflow (MLflow names allow no '@')."""
        out = {}
        for k, result in self.pass_at.items():
            out[f"eval/pass_at_{k}"] = result.value
            if math.isfinite(result.stderr):
                out[f"eval/pass_at_{k}/stderr"] = result.stderr
        out["eval/reward_error_rate"] = self.error_rate
        out["eval/completion_tokens/mean"] = self.mean_completion_tokens
        out["eval/num_prompts"] = float(len(self.rows))
        for key, value in self.timings.items():
            out[f"timing/eval/{key}"] = value
        return out

    def to_json(self) -> dict:
        n = self.settings.n
        return {
            "model": {
                "ref": self.source.ref,
                "path": self.model_dir,
                "name": self.source.name,
                "version": self.source.version,
                "alias": self.source.alias,
                "run_id": self.source.run_id,
            },
            "settings": {**asdict(self.settings), "samples": n},
            "num_prompts": len(self.rows),
            "metrics": {
                f"pass@{k}": {"value": r.value, "stderr": r.stderr if math.isfinite(r.stderr) else None}
                for k, r in self.pass_at.items()
            },
            "reward_error_rate": self.error_rate,
            "completion_tokens_mean": self.mean_completion_tokens,
            "timings": self.timings,
            "tracking_uri": self.tracking_uri,
            "mlflow_run_id": self.mlflow_run_id,
            "prompts": [
                {
                    "id": row.id,
                    "task": row.task,
                    "prompt": row.prompt,
                    "messages": row.messages,
                    "answer": row.answer,
                    "samples": n,
                    "correct": sum(self.correct[i]),
                    "pass_at": {str(k): r.per_prompt[i] for k, r in self.pass_at.items()},
                    "completions": [
                        {
                            "text": self.texts[i][j],
                            "correct": self.correct[i][j],
                            "reward": self.rewards[i][j],
                            "finish_reason": self.finish_reasons[i][j],
                            "error": self.errors[i][j],
                        }
                        for j in range(n)
                    ],
                }
                for i, row in enumerate(self.rows)
            ],
        }


def evaluate_model(
    ref: str,
    settings: EvalSettings,
    *,
    tracking_uri: str,
    rewards=None,
    sandbox=None,
    data_cfg: DataConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> EvalReport:
    """Sample, score and summarize (no MLflow, no files); see the module docstring.

    ``rewards`` / ``sandbox``: the config sections (default: RewardsConfig() / SandboxConfig(), the math
    verifier). ``progress(done, total)`` is called after each batch of prompts is sampled.
    """
    from transformers import AutoTokenizer

    from app.models import fetch, lookup
    from app.rollout.base import SamplingParams
    from app.rollout.embedded import EmbeddedEngine
    from app.scoring import rewards_with_sandbox, score_texts
    from rewards import RewardsConfig, check_tasks
    from rewards.runner import RewardRunner
    from sandbox import SandboxConfig
    from trainer.model import encode_prompt

    rewards = rewards or RewardsConfig()
    sandbox = sandbox or SandboxConfig()
    source = lookup(ref, tracking_uri=tracking_uri)  # fail on a bad reference before loading any data
    rows = load_eval_prompts(settings.data, settings.num_prompts, data_cfg)
    check_tasks(rewards, {row.task for row in rows})
    model_dir = fetch(source, tracking_uri=tracking_uri)

    engine = EmbeddedEngine.from_pretrained(model_dir, max_batch_size=settings.max_batch_size)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = []
    for row in rows:
        try:
            ids = encode_prompt(tokenizer, row.prompt, row.messages)
        except ValueError as exc:
            raise DatasetError(f"{settings.data}: row {row.id!r}: {exc}") from None
        if not ids:
            raise DatasetError(f"{settings.data}: row {row.id!r}: the prompt encodes to zero tokens")
        if engine.max_positions is not None and len(ids) >= engine.max_positions:
            raise DatasetError(
                f"{settings.data}: row {row.id!r} has {len(ids)} prompt tokens, leaving no room under the "
                f"model's context of {engine.max_positions}; drop or shorten it"
            )
        prompt_ids.append(ids)

    n = settings.n
    per_batch = max(1, settings.max_batch_size // n)
    completions = []
    start = time.perf_counter()
    for batch, first in enumerate(range(0, len(rows), per_batch)):
        params = SamplingParams(
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            n=n,
            seed=settings.seed + batch,
        )
        completions.extend(engine.generate_sync(prompt_ids[first : first + per_batch], params))
        if progress is not None:
            progress(min(first + per_batch, len(rows)), len(rows))
    generate_s = time.perf_counter() - start

    texts = [tokenizer.decode(c.output_ids, skip_special_tokens=True) for c in completions]
    start = time.perf_counter()
    with RewardRunner(rewards_with_sandbox(rewards, sandbox)) as runner:
        scores, reward_metrics = score_texts(runner, [rows[j // n] for j in range(len(completions))], texts)
    score_s = time.perf_counter() - start

    def grouped(values: list) -> list[list]:
        return [values[i * n : (i + 1) * n] for i in range(len(rows))]

    correct = grouped([bool(s.correct) and s.error is None for s in scores])
    counts = [sum(group) for group in correct]
    return EvalReport(
        source=source,
        model_dir=str(model_dir),
        settings=settings,
        rows=rows,
        texts=grouped(texts),
        correct=correct,
        rewards=grouped([float(s.reward) for s in scores]),
        errors=grouped([s.error for s in scores]),
        finish_reasons=grouped([c.finish_reason for c in completions]),
        completion_tokens=grouped([len(c.output_ids) for c in completions]),
        pass_at={k: summarize(counts, n, k) for k in reported_ks(settings.k)},
        timings={
            "generate_s": generate_s,
            "score_s": score_s,
            "completions_per_s": len(completions) / generate_s if generate_s > 0 else float("nan"),
        },
        reward_metrics=reward_metrics,
        tracking_uri=tracking_uri,
    )


# ---------------------------------------------------------------------------------------------- outputs


def run_evaluation(
    ref: str,
    settings: EvalSettings,
    *,
    tracking_uri: str,
    rewards=None,
    sandbox=None,
    data_cfg: DataConfig | None = None,
    experiment: str = "trustbatch",
    out: Path | None = None,
    track: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> EvalReport:
    """`trustbatch eval`: evaluate, log a new MLflow run (unless ``track`` is False), write ``out`` if given."""
    report = evaluate_model(
        ref,
        settings,
        tracking_uri=tracking_uri,
        rewards=rewards,
        sandbox=sandbox,
        data_cfg=data_cfg,
        progress=progress,
    )
    if track:
        log_to_mlflow(report, tracking_uri=tracking_uri, experiment=experiment)
    if out is not None:
        write_json(report, out)
    return report


def log_to_mlflow(report: EvalReport, *, tracking_uri: str, experiment: str = "trustbatch") -> str:
    """Log ``report`` as a new finished MLflow run; returns its run id (also set on the report)."""
    import tempfile

    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    from app.tracking import ensure_experiment, sqlite_path

    if (db := sqlite_path(tracking_uri)) is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    experiment_id = ensure_experiment(client, experiment, tracking_uri)
    source, settings = report.source, report.settings
    tags = {"trustbatch.kind": "eval", "trustbatch.model_ref": source.ref}
    for key in ("name", "version", "run_id"):
        if getattr(source, key):
            tags[f"trustbatch.model_{key}"] = str(getattr(source, key))
    run = client.create_run(experiment_id, run_name=f"eval {source.ref}"[:250], tags=tags)
    run_id = run.info.run_id
    params = {
        "model.ref": source.ref,
        "model.path": report.model_dir,
        "model.name": source.name or "",
        "model.version": source.version or "",
        "model.run_id": source.run_id or "",
        **{f"eval.{key}": value for key, value in asdict(settings).items()},
        "eval.samples": settings.n,
        "eval.num_prompts_used": len(report.rows),
    }
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(key, float(value), now, 0) for key, value in report.metrics().items()],
        params=[Param(key, str("" if value is None else value)[:6000]) for key, value in params.items()],
        tags=[RunTag(key, value) for key, value in tags.items()],
    )
    report.mlflow_run_id = run_id
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "eval_results.json"
        path.write_text(json.dumps(report.to_json(), indent=2))
        client.log_artifact(run_id, str(path))
    client.set_terminated(run_id)
    return run_id


def write_json(report: EvalReport, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n")


def results_table(report: EvalReport):
    """What `trustbatch eval` prints: a header line, a rich Table of pass@k with standard errors, a footer."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    settings = report.settings
    header = Text(
        f"{report.source.label}\n{settings.data}: {len(report.rows)} prompts x {settings.n} samples, temperature "
        f"{settings.temperature:g}, top_p {settings.top_p:g}, at most {settings.max_new_tokens} new tokens, "
        f"seed {settings.seed}"
    )
    table = Table()
    table.add_column("metric")
    table.add_column("estimate", justify="right")
    table.add_column("± s.e. (points)", justify="right")
    for k, result in report.pass_at.items():
        stderr = f"{100 * result.stderr:.2f}" if math.isfinite(result.stderr) else "-"
        table.add_row(f"pass@{k}", f"{100 * result.value:.2f}%", stderr)
    table.add_row("verifier error rate", f"{100 * report.error_rate:.2f}%", "")
    table.add_row("completion tokens (mean)", f"{report.mean_completion_tokens:.1f}", "")
    timings = report.timings
    footer = Text(
        f"pass@k = 1 - C(n-c,k)/C(n,k) per prompt, averaged; s.e. clustered by prompt. Sampling "
        f"{timings['generate_s']:.1f} s ({timings['completions_per_s']:.0f} completions/s), scoring "
        f"{timings['score_s']:.1f} s.",
        style="dim",
    )
    return Group(header, table, footer)
