"""Held-out evaluation during training: the same prompts, settings and seed at every evaluation of a run.

`HeldOut` is called by the training loop before the first step, every ``eval.every`` steps and after the last
(app/training/loop.py). Each call samples ``eval.samples_per_prompt`` completions of every held-out prompt at the
evaluation temperature (sampled pass@1, and pass@k up to ``eval.k``) and, with ``eval.greedy``, one greedy
completion (greedy accuracy), through `sample_and_score` like `trustbatch eval`; it logs the metrics and keeps
each result, so the run's summary can pair the first and the last evaluation prompt by prompt. Each evaluation's
completions are written to ``<run dir>/eval/step-<step>-<sampled|greedy>.jsonl``, to read what the model wrote.
The benchmarks of ``eval.benchmarks`` (`BenchmarkSet`) are evaluated at the same steps, each at its customary
sampling, as ``bench/<name>/accuracy`` (and ``pass_at_<k>``).

``generate`` is a blocking call (the loop hands it one that submits to the fleet on the event loop), because
evaluation runs in a worker thread while rollouts of the next steps go on. Under torchrun every rank samples its
share of the prompts; the counts are summed over ranks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from app.data import PromptRow
from app.evaluation.config import EvalConfig
from app.evaluation.metrics import reported_ks
from app.evaluation.run import EvalResult, Generate, sample_and_score
from app.rollout.base import SamplingParams
from rewards.runner import RewardRunner
from trainer.distributed import Reducer


@dataclass
class BenchmarkSet:
    """A standard benchmark evaluated with the held-out prompts (eval.benchmarks): its problems tokenized for the
    model and its customary sampling (app/evaluation/benchmarks.py)."""

    name: str
    rows: list[PromptRow]
    ids: list[list[int]]
    params: SamplingParams
    k: int = 1
    """pass@k is reported too when k > 1."""
    dropped: int = 0
    """Problems left out, too long for the model's context."""


class HeldOut:
    """The held-out evaluations of one training run.

    Args:
        settings: the run's ``eval`` section, resolved against its rollout section (`EvalConfig.resolved`).
        prompts: the held-out prompts, tokenized as the engines get them.
        stop_token_ids: where generation ends (EOS, end of turn).
        runner, decode, reducer: scoring, token ids to text, the ranks' sums.
        log_metrics: where each evaluation's metrics go (``Tracker.log_metrics``).
        state: what a checkpoint kept (`state`), to go on from a resumed run's evaluations.
    """

    def __init__(
        self,
        settings: EvalConfig,
        rows: list[PromptRow],
        ids: list[list[int]],
        *,
        stop_token_ids: tuple[int, ...],
        runner: RewardRunner,
        decode: Callable[[list[int]], str],
        reducer: Reducer,
        log_metrics: Callable[[dict[str, float], int], None],
        state: dict | None = None,
        samples_dir: Path | None = None,
        rank: int = 0,
        world_size: int = 1,
        benchmarks: list[BenchmarkSet] | None = None,
    ) -> None:
        assert None not in (settings.temperature, settings.top_p, settings.max_new_tokens), "resolve the settings"
        self.settings, self.rows, self.ids = settings, rows, ids
        self.runner, self.decode, self.reducer, self.log_metrics = runner, decode, reducer, log_metrics
        self.samples_dir, self.rank, self.world_size = samples_dir, rank, world_size
        self.benchmarks = list(benchmarks or [])
        sampled = SamplingParams(
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            n=settings.samples_per_prompt,
            stop_token_ids=stop_token_ids,
            seed=settings.seed,
        )
        self.runs = {"sampled": sampled}
        if settings.greedy:
            self.runs["greedy"] = replace(sampled, n=1, temperature=0.0, top_p=1.0)
        state = state or {}
        self.results: dict[int, dict[str, EvalResult]] = {
            int(step): {name: EvalResult.from_state(result) for name, result in runs.items()}
            for step, runs in state.get("evals", {}).items()
        }
        self.history: list[dict[str, float]] = list(state.get("eval_history", []))

    def __call__(self, step: int, generate: Generate) -> dict[str, float]:
        t0 = time.perf_counter()
        self.results[step] = {
            name: sample_and_score(
                generate, self.rows, self.ids, params, self.runner, self.decode, reducer=self.reducer,
                label=f"eval at step {step} ({name})",
            )  # fmt: skip
            for name, params in self.runs.items()
        }
        sampled = self.results[step]["sampled"]
        out = {
            "step": step,
            "eval/accuracy": sampled.accuracy,
            "eval/accuracy_se": sampled.stderr,
            "eval/samples": sampled.num_samples,
        }
        if sampled.answer_rate is not None:
            out["eval/answer_rate"] = sampled.answer_rate
        for name, (accuracy, se, _) in sampled.by_source().items():  # a list of eval sources: each one's accuracy
            out[f"eval/source/{name}/accuracy"] = accuracy
            out[f"eval/source/{name}/accuracy_se"] = se
        for k in reported_ks(self.settings.k)[1:]:
            out[f"eval/pass_at_{k}"] = sampled.pass_at(k).value
        if "greedy" in self.results[step]:
            greedy = self.results[step]["greedy"]
            out["eval/greedy_accuracy"] = greedy.accuracy
            if greedy.answer_rate is not None:
                out["eval/greedy_answer_rate"] = greedy.answer_rate
        for bench in self.benchmarks:  # eval.benchmarks: bench/<name>/accuracy (and pass@k), at their own sampling
            result = sample_and_score(
                generate, bench.rows, bench.ids, bench.params, self.runner, self.decode, reducer=self.reducer,
                label=f"benchmark {bench.name} at step {step}",
            )  # fmt: skip
            out[f"bench/{bench.name}/accuracy"] = result.accuracy
            out[f"bench/{bench.name}/accuracy_se"] = result.stderr
            if bench.k > 1:
                out[f"bench/{bench.name}/pass_at_{bench.k}"] = result.pass_at(bench.k).value
        out["timing/eval"] = time.perf_counter() - t0
        if self.samples_dir is not None:
            self.write_samples(step)
        self.log_metrics(out, step)
        self.history.append(out)
        return out

    def write_samples(self, step: int) -> None:
        """Every completion of this rank's share of evaluation `step`, one JSON line each, to read what the
        model wrote: ``<samples_dir>/step-<step>-<sampled|greedy>[-rank<r>].jsonl`` (prompt id, text, reward,
        correct, finish reason, error, the verifiers' breakdown)."""
        self.samples_dir.mkdir(parents=True, exist_ok=True)
        suffix = f"-rank{self.rank}" if self.world_size > 1 else ""
        for name, result in self.results[step].items():
            lines = [
                json.dumps(
                    {"prompt": self.rows[s.prompt].id, **s.record(), "breakdown": s.score.breakdown}, default=str
                )
                for s in result.samples
            ]
            path = self.samples_dir / f"step-{step:06d}-{name}{suffix}.jsonl"
            path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")

    def state(self) -> dict:
        """What a checkpoint keeps so that a resumed run reports the same gains and plot."""
        return {
            "evals": {
                str(step): {name: result.state() for name, result in runs.items()}
                for step, runs in self.results.items()
            },
            "eval_history": self.history,
        }
