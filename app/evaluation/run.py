"""Sampling and scoring evaluation prompts through any engine: `sample_and_score`, and what it returns.

`sample_and_score` is the only place that samples and scores evaluation prompts, for training (app/evaluation/
held_out.py) and for `trustbatch eval` (app/evaluation/command.py). It drives any rollout engine: the
in-process `EmbeddedEngine`; the built-in CPU server or real SGLang, both through `SGLangClient`; or a blocking
``generate(prompts, params, progress)`` callable, which is what training hands it (the fleet's generate,
submitted to the loop's event loop from the evaluation's worker thread). It returns one `EvalResult`: each
prompt's count of correct samples summed over ranks, the answer rate, and this rank's scored samples, from
which everything reported is computed (app/evaluation/metrics.py, app/evaluation/report.py).

A completion is correct when its task's first verifier that judges correctness says so (``Score.correct``); a
verifier error or timeout counts as incorrect and shows in the error rate.

Progress: given a ``label``, the completions done, their rate and the time left are shown while sampling runs
(`Progress`: a bar on a terminal, a log line every 30 s otherwise), counted as the engine finishes each batch.

Reproducibility: the same engine, prompts, settings and seed give the same samples. The prompts go to the engine
in one call, or in calls of ``prompts_per_call`` prompts, call c with seed + c, so the samples of a prompt also
depend on which prompts share its call.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from app.data import PromptRow
from app.evaluation.metrics import PassAtK, clustered_stderr, reported_ks, summarize
from app.rollout.base import Completion, RolloutEngine, SamplingParams
from app.rollout.trajectory import completion_text, trajectory_metrics
from app.scoring import score_texts
from rewards import Score
from rewards.runner import RewardRunner
from trainer.distributed import LocalReducer, Reducer

if TYPE_CHECKING:
    from app.evaluation.config import EvalConfig
    from app.models import ModelSource

log = logging.getLogger("trustbatch")

OnDone = Callable[[int], None]
"""Told the number of completions an engine has just finished (progress reports)."""
Generate = Callable[[list[list[int]], SamplingParams, OnDone | None, list[str]], list[Completion]]
"""A blocking generate call: prompts (token ids), sampling settings, a progress hook and each prompt's task (which
says whether its row may call tools) in, prompt-major completions out."""


@dataclass(frozen=True)
class Sample:
    """One scored completion of one evaluation prompt."""

    prompt: int
    """Index of the prompt in the evaluated rows."""
    completion: Completion
    text: str
    """What the verifier read (a tool-using answer: the model's own text, the tools' outputs left out)."""
    score: Score
    transcript: str | None = None
    """A tool-using answer whole, the tools' outputs included (None for a single-turn answer)."""

    @property
    def correct(self) -> bool:
        return bool(self.score.correct) and self.score.error is None

    def record(self) -> dict:
        """The completion as JSON: text, verdict, reward, finish reason, error (eval's --out, training's eval/)."""
        out = {
            "text": self.text,
            "correct": self.correct,
            "reward": float(self.score.reward),
            "finish_reason": self.completion.finish_reason,
            "error": self.score.error,
        }
        if self.transcript is not None:
            meta = self.completion.meta
            out.update(transcript=self.transcript, status=meta.get("status"), tool_calls=meta.get("tool_calls"))
        return out

    @property
    def answered(self) -> bool | None:
        """Whether a verifier found an answer to judge (math: one in a form of params.extraction, e.g. a
        ``\\boxed{}``): format compliance, apart from correctness. None when no verifier reports extraction."""
        reports = [v["extracted"] for v in self.score.breakdown.values() if isinstance(v, dict) and "extracted" in v]
        return any(r is not None for r in reports) if reports else None


@dataclass
class EvalResult:
    """One evaluation of a set of prompts, with ``n`` samples each: the one result type of every evaluation.

    ``correct`` and ``answer_rate`` are global (summed over ranks); ``samples`` are this rank's (under torchrun
    rank r samples prompts r, r + W, ...), empty for a result restored from a checkpoint. The fields after
    ``score_s`` say what was evaluated, for the report of `trustbatch eval`.
    """

    n: int
    correct: list[int]
    """Correct samples of each prompt (all prompts, in order)."""
    answer_rate: float | None = None
    """Share of the completions in which a verifier found an answer to judge (`Sample.answered`): format
    compliance, whether or not the answer is right. None when no verifier reports extraction."""
    samples: list[Sample] = field(default_factory=list)
    reward_metrics: dict[str, float] = field(default_factory=dict)
    """The reward runner's metrics of this rank's samples (reward/mean, reward/error_rate, ...)."""
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    """What this rank's tool-using answers did (statuses, turns, tool calls; `trajectory_metrics`); empty
    without tools."""
    generate_s: float = 0.0
    score_s: float = 0.0
    rows: list[PromptRow] = field(default_factory=list)
    """The prompts evaluated."""
    settings: EvalConfig | None = None
    """The settings it ran with (resolved: no empty sampling value)."""
    dropped: int = 0
    """Prompts left out for their length (data.on_long_prompt=drop)."""
    model: ModelSource | None = None
    """The model reference evaluated (`trustbatch eval`; None during training)."""
    model_dir: str = ""
    engine: str = ""
    dtype: str = ""
    """The built-in engine's compute dtype (rollout.dtype); empty for SGLang, whose server sets its own."""
    max_batch_size: int | None = None
    """Sequences the engine decoded together (`trustbatch eval`: also the prompts x n of one generate call)."""
    data: str = ""
    """The prompt source (data.eval)."""
    tracking_uri: str = ""
    mlflow_run_id: str | None = None

    @property
    def per_prompt(self) -> list[float]:
        """Mean correctness of each prompt's samples."""
        return [c / self.n for c in self.correct]

    @property
    def num_samples(self) -> int:
        """Completions the estimate uses (prompts x samples per prompt, over all ranks)."""
        return len(self.correct) * self.n

    @property
    def accuracy(self) -> float:
        """Sampled pass@1: the mean of `per_prompt`."""
        return sum(self.per_prompt) / len(self.per_prompt)

    @property
    def stderr(self) -> float:
        return clustered_stderr(self.per_prompt)

    def by_source(self) -> dict[str, tuple[float, float, int]]:
        """Sampled pass@1, its standard error and the prompts, per source (``metadata.data_source``) when the rows
        come from several sources; empty otherwise (or for a result restored without its rows)."""
        if len(self.rows) != len(self.correct):
            return {}
        groups: dict[str, list[float]] = {}
        for row, accuracy in zip(self.rows, self.per_prompt, strict=True):
            groups.setdefault(str(row.metadata.get("data_source", "")), []).append(accuracy)
        if len(groups) < 2:
            return {}
        return {name: (sum(v) / len(v), clustered_stderr(v), len(v)) for name, v in groups.items()}

    def pass_at(self, k: int) -> PassAtK:
        return summarize(self.correct, self.n, k)

    def pass_at_ks(self, k: int) -> dict[int, PassAtK]:
        """pass@1, the powers of two below ``k``, and pass@k."""
        return {j: self.pass_at(j) for j in reported_ks(k)}

    @property
    def by_prompt(self) -> list[list[Sample]]:
        """This rank's samples grouped by prompt, in order (prompt-major, as sampled)."""
        groups: list[list[Sample]] = [[] for _ in self.correct]
        for sample in self.samples:
            groups[sample.prompt].append(sample)
        return groups

    @property
    def error_rate(self) -> float:
        """Share of this rank's samples whose scoring failed (a verifier error or timeout)."""
        return sum(s.score.error is not None for s in self.samples) / max(len(self.samples), 1)

    @property
    def mean_completion_tokens(self) -> float:
        return sum(len(s.completion.output_ids) for s in self.samples) / max(len(self.samples), 1)

    @property
    def truncated_rate(self) -> float | None:
        """Share of this rank's completions cut at max_new_tokens (None for a result restored from a
        checkpoint, which keeps no samples)."""
        if not self.samples:
            return None
        return sum(s.completion.finish_reason == "length" for s in self.samples) / len(self.samples)

    def state(self) -> dict:
        """What a training checkpoint keeps of it (a resumed run reports the same gains and plot)."""
        return {"per_prompt": self.per_prompt, "samples": self.num_samples, "answer_rate": self.answer_rate}

    @classmethod
    def from_samples(
        cls, samples: list[Sample], num_prompts: int, n: int, reducer: Reducer | None = None
    ) -> EvalResult:
        """The result of ``samples`` (this rank's) of ``num_prompts`` prompts with ``n`` samples each; the counts
        are summed over ranks (a collective: every rank calls this, in the same order)."""
        correct, answered, judged = _counts(samples, num_prompts, reducer or LocalReducer())
        return cls(n=n, correct=correct, answer_rate=answered / judged if judged else None, samples=samples)

    @classmethod
    def from_state(cls, state: dict) -> EvalResult:
        per_prompt = state["per_prompt"]
        n = int(state["samples"]) // len(per_prompt)
        return cls(n=n, correct=[round(p * n) for p in per_prompt], answer_rate=state["answer_rate"])


def blocking(engine_or_generate: RolloutEngine | Generate, loop: asyncio.AbstractEventLoop | None = None) -> Generate:
    """A blocking generate over a callable (itself), an in-process engine (`generate_sync`), or an asynchronous
    RolloutEngine living in ``loop``, an event loop running in another thread (an SGLangClient binds to the loop
    that first uses it)."""
    if not isinstance(engine_or_generate, RolloutEngine):
        return engine_or_generate
    engine = engine_or_generate
    if hasattr(engine, "generate_sync"):
        return lambda prompts, params, progress, tasks: engine.generate_sync(prompts, params, progress=progress)
    if loop is None:
        raise ValueError(
            f"{type(engine).__name__} is asynchronous: pass loop=, the running event loop it was built in, "
            "and call sample_and_score from another thread (e.g. asyncio.to_thread)"
        )
    return lambda prompts, params, progress, tasks: asyncio.run_coroutine_threadsafe(
        engine.generate(prompts, params, progress=progress), loop
    ).result()


def sample_and_score(
    engine_or_generate: RolloutEngine | Generate,
    rows: list[PromptRow],
    ids: list[list[int]],
    params: SamplingParams,
    runner: RewardRunner,
    decode: Callable[[list[int]], str],
    *,
    reducer: Reducer | None = None,
    prompts_per_call: int | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
    label: str | None = None,
) -> EvalResult:
    """Sample ``params.n`` completions of this rank's prompts, score every one, and count over ranks.

    ``ids[i]`` are the token ids of ``rows[i]`` as the engines get them. Under torchrun (``reducer`` of world
    size W) rank r takes prompts r, r + W, ...; the counts are summed over ranks (a collective: every rank calls
    this, in the same order). The prompts go to the engine in one call, or in calls of ``prompts_per_call``
    prompts, call c with seed ``params.seed + c``. All completions are then scored in one pass of the reward
    runner. ``label``: show progress under that name (rank 0). See `blocking` for the engines taken.
    """
    generate = blocking(engine_or_generate, loop)
    reducer = reducer or LocalReducer()
    mine = list(range(reducer.rank, len(rows), reducer.world_size))
    size = prompts_per_call or max(len(mine), 1)
    owners: list[int] = []
    completions: list[Completion] = []
    progress = Progress(label, len(mine) * params.n) if label is not None and reducer.rank == 0 else None
    start = time.perf_counter()
    try:
        for call, first in enumerate(range(0, len(mine), size)):
            chosen = mine[first : first + size]
            call_params = params if call == 0 or params.seed is None else replace(params, seed=params.seed + call)
            got = generate([ids[i] for i in chosen], call_params, progress, [rows[i].task for i in chosen])
            if len(got) != len(chosen) * params.n:
                raise RuntimeError(
                    f"the engine returned {len(got)} completions for {len(chosen)} prompts x n={params.n}"
                )
            completions += got
            owners += [chosen[j // params.n] for j in range(len(got))]
    finally:
        if progress is not None:
            progress.close()
    generate_s = time.perf_counter() - start
    start = time.perf_counter()
    texts = [completion_text(c, decode) for c in completions]
    scores, metrics = score_texts(runner, [rows[i] for i in owners], texts) if completions else ([], {})
    samples = [
        Sample(i, c, text, score, decode(c.output_ids) if c.output_versions is not None else None)
        for i, c, text, score in zip(owners, completions, texts, scores, strict=True)
    ]
    result = EvalResult.from_samples(samples, len(rows), params.n, reducer)
    return replace(
        result, reward_metrics=metrics, rollout_metrics=trajectory_metrics(completions), generate_s=generate_s,
        score_s=time.perf_counter() - start, rows=rows,
    )  # fmt: skip


def _counts(samples: list[Sample], num_prompts: int, reducer: Reducer) -> tuple[list[int], int, int]:
    """Per prompt the correct samples, then the answered samples and those a verifier judged the format of, all
    summed over ranks (one collective)."""
    counts = torch.zeros(num_prompts + 2, dtype=torch.float64)
    for sample in samples:
        counts[sample.prompt] += float(sample.correct)
        if sample.answered is not None:
            counts[num_prompts] += float(sample.answered)
            counts[num_prompts + 1] += 1.0
    reducer.sum_(counts)
    values = [int(c) for c in counts.tolist()]
    return values[:num_prompts], values[num_prompts], values[num_prompts + 1]


class Progress:
    """Completions done of one evaluation, their rate and the time left: a bar on a terminal (stderr), else a log
    line every ``every_s`` seconds (also while nothing finishes: a slow model's first batch takes minutes) and
    one at the end. Callable with the completions just done, from any thread (the engines report from theirs)."""

    def __init__(self, label: str, total: int, *, every_s: float = 30.0) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.done, self.t0 = 0, time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label, unit="completion", leave=False, dynamic_ncols=True)
        threading.Thread(target=self._heartbeat, name="eval-progress", daemon=True).start()

    def __call__(self, finished: int) -> None:
        with self._lock:
            self.done += finished
            if self._bar is not None:
                self._bar.update(finished)

    def _heartbeat(self) -> None:
        while not self._stop.wait(1.0 if self._bar is not None else self.every_s):
            with self._lock:
                if self._bar is not None:
                    self._bar.refresh()  # the elapsed time moves on between updates
                else:
                    log.info("%s", self.line())

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        rate = self.done / elapsed
        if self.done >= self.total:
            eta = ""
        elif rate > 0:
            eta = f", about {(self.total - self.done) / rate:.0f} s left"
        else:  # an engine that reports whole batches: no estimate until the first one returns
            eta = ", time left unknown until the first completions return"
        return f"{self.label}: {self.done}/{self.total} completions, {rate:.1f}/s, {elapsed:.0f} s{eta}"

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
            elif self.done:
                log.info("%s", self.line())

