"""`trustbatch eval`: a model reference in, an `EvalResult` out (and, with `run_evaluation`, its report).

Pipeline: resolve the reference (app/models.py: ``models:/NAME@ALIAS``, ``models:/NAME/VERSION``, ``runs:/...``
or a directory) -> load the prompts through training's loader (``data.eval``: a JSONL / Parquet file, or the
test split of a built-in task) -> tokenize them as the rollout engines get them and check each against the
model's context (`prepare_prompts`, as training's start-up; a prompt leaving fewer than the completion budget is
an error, or dropped and counted with ``data.on_long_prompt=drop``) -> open the engine (app/engines.py:
``embedded`` in process, the default; ``local``, the built-in CPU server; ``sglang``, servers launched or given
by ``rollout.sglang.urls``) -> `sample_and_score` -> pass@k. Generation stops at EOS and at the chat template's
end-of-turn token, as in training.

The settings are an `EvalJob`, the sections of a run config an evaluation reads (app/cli.py builds the config from the
command's options over ``--config``, and passes `Config.eval_job`): ``eval`` (k,
samples per prompt, prompts, sampling), ``data`` (the prompts, their built-in task settings, on_long_prompt),
``rewards`` and ``sandbox`` (scoring), ``rollout`` (the sampling values ``eval`` leaves empty, the engine's
batch size, the SGLang servers) and ``tracking``. The prompts go to the engine in calls of
``rollout.max_batch_size // n`` prompts (call c with seed + c), so another batch size draws differently.

Not covered: greedy accuracy as such (``--temperature 0 --k 1`` measures it), several processes (training
evaluates under torchrun; the command runs in one process, any number of SGLang servers).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Literal

from app.data import DatasetError, load_split
from app.data.prepare import ModelText, prepare_prompts
from app.engines import EngineOptions, open_engine
from app.errors import ConfigError
from app.evaluation.benchmarks import Benchmark, resolve
from app.evaluation.config import EvalJob
from app.evaluation.report import log_benchmarks, log_to_mlflow, write_benchmarks, write_json
from app.evaluation.run import EvalResult, sample_and_score
from app.models import fetch, lookup
from app.rollout.base import SamplingParams
from app.scoring import rewards_with_sandbox
from app.tooling import load_toolkit, open_tool_rollouts, tool_format
from rewards import check_tasks
from rewards.runner import RewardRunner

log = logging.getLogger("trustbatch")

FITTED_NEW_TOKENS = 256
"""Longest completion when nothing sets it (``fit_new_tokens``): at most this, and what the longest prompt leaves
of the model's context."""


def evaluate_model(
    ref: str,
    cfg: EvalJob,
    *,
    tracking_uri: str,
    engine: str = "embedded",
    fit_new_tokens: bool = False,
    label: str | None = None,
    split: Literal["train", "eval"] = "eval",
) -> EvalResult:
    """Sample, score and summarize ``ref`` (no MLflow, no files); see the module docstring.

    ``split``: the prompts of data.eval (default), or of data.train (`trustbatch filter-prompts`).

    ``fit_new_tokens``: with ``eval.max_new_tokens`` empty, the completions get FITTED_NEW_TOKENS or what the
    longest prompt leaves of the context, instead of ``rollout.max_new_tokens``. ``label``: show progress.
    """
    settings = cfg.eval.resolved(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=cfg.seed + 17,
    )
    fit = fit_new_tokens and cfg.eval.max_new_tokens is None
    source = lookup(ref, tracking_uri=tracking_uri)  # fail on a bad reference before loading any data
    data_source = cfg.data.describe(split)
    rows = load_split(cfg.data, split)[: cfg.eval.num_prompts]
    check_tasks(cfg.rewards, {row.task for row in rows})
    try:
        kit = load_toolkit(cfg.tools)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    model_dir = fetch(source, tracking_uri=tracking_uri)
    text = ModelText.from_dir(model_dir)
    if kit is not None:
        try:  # a format this model cannot write stops here, before any engine starts
            tool_format(cfg.rollout.tool_format, text.tokenizer, str(model_dir))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    fit = fit and kit is None  # a tool-using answer's budget is rollout.max_total_tokens
    prompts = prepare_prompts(
        rows,
        text,
        max_new_tokens=FITTED_NEW_TOKENS if fit else settings.max_new_tokens,
        fit=fit,
        on_long_prompt=cfg.data.on_long_prompt,
        source_key=f"data.{split}",
        source=data_source,
        new_tokens_key="eval.max_new_tokens",
        chat_tools=kit.chat_tools(cfg.rollout.tool_format) if kit is not None else None,
    )
    if kit is not None and text.context is not None:
        over = [len(ids) for ids in prompts.ids if len(ids) + cfg.rollout.total_tokens > text.context]
        if over:  # the episode stops at the context anyway; say so once instead of cutting answers silently
            log.warning("%d prompts leave less than rollout.max_total_tokens=%d of the context (%d) for the answer",
                        len(over), cfg.rollout.total_tokens, text.context)  # fmt: skip
    settings = replace(settings, max_new_tokens=prompts.max_new_tokens)
    n = settings.samples_per_prompt
    params = SamplingParams(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        n=n,
        stop_token_ids=text.stop_token_ids,
        seed=settings.seed,
    )
    options = EngineOptions(
        max_batch_size=cfg.rollout.max_batch_size, sglang=cfg.rollout.sglang, dtype=cfg.rollout.dtype
    )
    per_call = max(1, cfg.rollout.max_batch_size // n)

    def run(engine_or_generate, runner: RewardRunner, loop=None) -> EvalResult:
        return sample_and_score(
            engine_or_generate, prompts.rows, prompts.ids, params, runner, text.decode,
            prompts_per_call=per_call, loop=loop, label=label,
        )  # fmt: skip

    with open_engine(engine, model_dir, options) as opened, RewardRunner(
        rewards_with_sandbox(cfg.rewards, cfg.sandbox)
    ) as runner:
        if kit is not None:

            async def with_tools() -> EvalResult:
                engine = opened.engine
                try:
                    if opened.kind != "embedded":
                        await engine.wait_healthy()
                    with open_tool_rollouts(kit, cfg.rollout, cfg.sandbox, engine.generate, text.tokenizer,
                                            context=text.context, where=str(model_dir)) as tools:  # fmt: skip
                        loop = asyncio.get_running_loop()

                        def generate(prompt_ids, call_params, progress, tasks):
                            sampled = tools.generate(prompt_ids, call_params, tasks, progress=progress)
                            return asyncio.run_coroutine_threadsafe(sampled, loop).result()

                        return await asyncio.to_thread(run, generate, runner)
                finally:
                    if opened.kind != "embedded":
                        await engine.close()

            result = asyncio.run(with_tools())
        elif opened.kind == "embedded":
            result = run(opened.engine, runner)
        else:

            async def over_http() -> EvalResult:
                client = opened.engine
                try:
                    await client.wait_healthy()
                    # Sampling blocks; the client lives on this loop, so sampling runs in a worker thread.
                    return await asyncio.to_thread(run, client, runner, asyncio.get_running_loop())
                finally:
                    await client.close()

            result = asyncio.run(over_http())
    return replace(
        result,
        settings=settings,
        dropped=prompts.dropped,
        model=source,
        model_dir=str(model_dir),
        engine=opened.kind,
        dtype=cfg.rollout.dtype if opened.kind in ("embedded", "local") else "",
        max_batch_size=cfg.rollout.max_batch_size,
        data=data_source,
        tracking_uri=tracking_uri,
    )


def run_evaluation(
    ref: str,
    cfg: EvalJob,
    *,
    tracking_uri: str,
    engine: str = "embedded",
    fit_new_tokens: bool = False,
    out: Path | None = None,
    track: bool = True,
    label: str | None = "eval",
) -> EvalResult:
    """`trustbatch eval`: evaluate, log a new MLflow run (unless ``track`` is False), write ``out`` if given."""
    result = evaluate_model(
        ref, cfg, tracking_uri=tracking_uri, engine=engine, fit_new_tokens=fit_new_tokens, label=label
    )
    if track:
        result.mlflow_run_id = log_to_mlflow(result, experiment=cfg.experiment)
    if out is not None:
        write_json(result, out)
    return result


def benchmark_job(job: EvalJob, bench: Benchmark, *, max_new_tokens: int | None = None,
                  num_prompts: int | None = None) -> EvalJob:  # fmt: skip
    """``job`` set up to run ``bench``: its data, its customary sampling and its verifier (the rest of ``job``,
    engine and sandbox, as given)."""
    from dataclasses import asdict

    from rewards.config import VerifierSpec

    data = replace(job.data, eval=asdict(bench.source))
    settings = replace(job.eval, samples_per_prompt=bench.samples, temperature=bench.temperature, top_p=1.0,
                       k=bench.k, num_prompts=num_prompts, greedy=False,
                       max_new_tokens=max_new_tokens or bench.max_new_tokens)  # fmt: skip
    verifier = VerifierSpec(name=bench.task, tasks=[bench.task])
    keep = [v for v in job.rewards.verifiers if bench.task in v.tasks]  # a config's own verifier for the task wins
    return replace(job, data=data, eval=settings, rewards=replace(job.rewards, verifiers=keep or [verifier]), tools=[])


def run_benchmarks(
    ref: str,
    job: EvalJob,
    names: list[str],
    *,
    tracking_uri: str,
    engine: str = "embedded",
    mirror: str | Path | None = None,
    max_new_tokens: int | None = None,
    num_prompts: int | None = None,
    out: Path | None = None,
    track: bool = True,
) -> dict[str, EvalResult]:
    """`trustbatch eval --bench NAME ...`: each benchmark evaluated as its entry says (app/evaluation/benchmarks.py),
    one after another; one MLflow run with every benchmark's metrics, and ``out`` (the JSON of every benchmark)."""
    benches = resolve(names, mirror)
    for bench in benches:
        if not bench.pinned and bench.source.source.startswith("hub:"):
            log.warning("benchmark %s reads %s at its newest commit (not pinned here; pin it with revision=)",
                        bench.name, bench.source.source)  # fmt: skip
    results = {}
    for bench in benches:
        try:
            results[bench.name] = evaluate_model(
                ref, benchmark_job(job, bench, max_new_tokens=max_new_tokens, num_prompts=num_prompts),
                tracking_uri=tracking_uri, engine=engine, label=f"bench {bench.name}",
            )  # fmt: skip
        except DatasetError as exc:
            raise DatasetError(
                f"benchmark {bench.name}: {exc}\n(for a benchmark, put that folder or file at DIR/{bench.name} "
                f"(or DIR/{bench.name}.jsonl / .parquet) and pass --bench-dir DIR, or set $TRUSTBATCH_BENCH_DIR)"
            ) from None
    if track:
        run_id = log_benchmarks(results, benches, experiment=job.experiment)
        for result in results.values():
            result.mlflow_run_id = run_id
    if out is not None:
        write_benchmarks(results, benches, out)
    return results
