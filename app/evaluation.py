"""Held-out evaluation, one path for training and for `trustbatch eval`: sample, score, summarize.

`sample_and_score` is the only place that samples and scores evaluation prompts. It drives any rollout engine
(the in-process `EmbeddedEngine`; the built-in CPU server or real SGLang, both through `SGLangClient`; or a
blocking ``generate(prompts, params)`` callable, which is what training hands it: the fleet's generate,
submitted to the loop's event loop from the evaluation's worker thread) and returns one `Sample` per
completion: the prompt's index, the completion, its text and its score. Everything reported is computed from
those records:

- training (app/training/runtime.py `Evaluator`): `EvalResult.from_samples`, each prompt's share of correct
  samples, summed over ranks (under torchrun every rank samples prompts rank, rank + world, ...), its
  accuracy, standard error and the paired gain of two evaluations;
- `trustbatch eval` (`evaluate_model` below): per prompt the count c of correct samples, and pass@k.

Standard errors are clustered by prompt: samples of one prompt are correlated, so the SE of an accuracy is the
standard deviation of the per-prompt values divided by sqrt(#prompts). Two evaluations on the same prompts
(before and after training) give a paired gain whose SE uses the per-prompt differences.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
eq. 1): for a prompt with n samples of which c are correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``, the chance
that k samples drawn without replacement from the n include a correct one (so pass@1 = c / n). It is averaged
over prompts, its SE clustered by prompt. Drawing n > k samples (``--samples``) lowers the variance of pass@k
without biasing it. Reported: k = 1, the powers of two below k, and k.

A completion is correct when its task's first verifier that judges correctness says so (``Score.correct``); a
verifier error or timeout counts as incorrect and shows in the error rate.

`trustbatch eval` pipeline: resolve the reference (app/models.py) -> load the prompts through training's loader
(`load_split` on ``data.eval = --data``: a JSONL / Parquet file, or the test split of a built-in task) ->
tokenize them as the rollout engines get them (`encode_prompt`, as training's start-up) and check each
against the model's context with training's `limit_prompt_lengths` (a prompt leaving fewer than
``--max-new-tokens`` positions is an error, or dropped and counted with ``data.on_long_prompt=drop`` /
``--on-long-prompt drop``) -> sample n completions per prompt with the chosen engine (``--engine embedded``,
in process, the default; ``local``, the built-in CPU server; ``sglang``, real SGLang servers launched through
app/rollout/sglang_server.py or given by ``rollout.sglang.urls`` of ``--config``) -> score -> pass@k.
Generation stops at EOS and at the chat template's end-of-turn token, as in training. Each evaluation is logged through app/tracking.py `Tracker` as a
new MLflow run (experiment ``tracking.experiment`` of ``--config``, default ``trustbatch``; run name
``eval <reference>``; tag ``trustbatch.kind = eval``): params (the reference, the resolved registry version
and run, the data, n, k, the sampling settings, the engine), metrics ``eval/pass_at_<k>`` and
``eval/pass_at_<k>/stderr``, ``eval/reward_error_rate``, ``eval/completion_tokens/mean``,
``eval/num_prompts``, ``eval/dropped_long_prompts``, and the results JSON as an artifact.

Reproducibility: the same engine, reference, prompts, settings and seed give the same samples. The eval command
samples its prompts in calls of ``max_batch_size // n`` prompts (for progress reports); call c draws with seed
+ c, so the samples of a prompt also depend on which prompts share its call (another --num-prompts or
--max-batch-size draws differently). Training makes one call with its seed.

Not covered by `trustbatch eval`: greedy accuracy as such (``--temperature 0 --k 1`` measures it), several
processes (training evaluates under torchrun; the command runs in one process, any number of SGLang servers).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from app import sampling
from app.data import (
    BUILTIN_PREFIX,
    BUILTIN_TASKS,
    FILE_EXTENSIONS,
    DataConfig,
    DatasetError,
    PromptRow,
    limit_prompt_lengths,
    load_split,
)
from app.models import ModelSource
from app.rollout.base import Completion, RolloutEngine, SamplingParams
from app.scoring import score_texts
from rewards import Score
from rewards.runner import RewardRunner
from trainer.distributed import LocalReducer, Reducer

if TYPE_CHECKING:
    from app.rollout.sglang import SGLangClientConfig

log = logging.getLogger("trustbatch")

Generate = Callable[[list[list[int]], SamplingParams], list[Completion]]
"""A blocking generate call: prompts (token ids) and sampling settings in, prompt-major completions out."""

EngineKind = Literal["embedded", "local", "sglang"]
ENGINES: tuple[str, ...] = ("embedded", "local", "sglang")

DEFAULT_BUILTIN_PROMPTS = 500
"""Prompts taken from a built-in task's test split when --num-prompts is not given."""
DEFAULT_MAX_NEW_TOKENS = 256
"""Longest completion when neither --max-new-tokens nor --config sets it (at most what the context leaves)."""


# ---------------------------------------------------------------------------------------------- statistics


def clustered_stderr(per_prompt: list[float]) -> float:
    n = len(per_prompt)
    if n < 2:
        return float("nan")
    mean = sum(per_prompt) / n
    var = sum((x - mean) ** 2 for x in per_prompt) / (n - 1)
    return math.sqrt(var / n)


@dataclass
class EvalResult:
    """Training's held-out accuracy of one evaluation (sampled or greedy), global over ranks."""

    per_prompt: list[float]
    """Mean correctness of each prompt's samples (all prompts, in order)."""
    samples: int
    """Completions the estimate uses (prompts x samples per prompt)."""
    answer_rate: float | None = None
    """Share of the completions in which a verifier found an answer to judge (`Sample.answered`): format
    compliance, whether or not the answer is right. None when no verifier reports extraction."""

    @property
    def accuracy(self) -> float:
        return sum(self.per_prompt) / len(self.per_prompt)

    @property
    def stderr(self) -> float:
        return clustered_stderr(self.per_prompt)

    @classmethod
    def from_samples(
        cls, samples: list[Sample], num_prompts: int, n: int, reducer: Reducer | None = None
    ) -> EvalResult:
        """Each prompt's share of correct samples; ``samples`` are this rank's, the counts are summed over
        ranks (every rank must call this, in the same order)."""
        correct = correct_counts(samples, num_prompts, reducer)
        answered, judged = _counts(samples, num_prompts, lambda s: s.answered, reducer)
        return cls(
            per_prompt=[c / n for c in correct],
            samples=num_prompts * n,
            answer_rate=sum(answered) / judged if judged else None,
        )


def paired_gain(before: EvalResult, after: EvalResult) -> tuple[float, float]:
    """Gain in accuracy and its standard error, pairing the two evaluations prompt by prompt."""
    if len(before.per_prompt) != len(after.per_prompt):
        raise ValueError("paired_gain needs evaluations over the same prompts")
    diffs = [a - b for a, b in zip(after.per_prompt, before.per_prompt, strict=True)]
    return sum(diffs) / len(diffs), clustered_stderr(diffs)


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


# ---------------------------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class Sample:
    """One scored completion of one evaluation prompt."""

    prompt: int
    """Index of the prompt in the evaluated rows."""
    completion: Completion
    text: str
    score: Score

    @property
    def correct(self) -> bool:
        return bool(self.score.correct) and self.score.error is None

    @property
    def answered(self) -> bool | None:
        """Whether a verifier found an answer to judge (math: one in a form of params.extraction, e.g. a
        ``\\boxed{}``): format compliance, apart from correctness. None when no verifier reports extraction."""
        reports = [v["extracted"] for v in self.score.breakdown.values() if isinstance(v, dict) and "extracted" in v]
        return any(r is not None for r in reports) if reports else None


@dataclass
class Scored:
    """What `sample_and_score` returns: this rank's samples, prompt-major (each prompt's n in a row)."""

    samples: list[Sample]
    reward_metrics: dict[str, float]
    """The reward runner's metrics of these samples (reward/mean, reward/error_rate, ...)."""
    generate_s: float
    score_s: float


def correct_counts(samples: list[Sample], num_prompts: int, reducer: Reducer | None = None) -> list[int]:
    """Correct samples of each prompt, summed over ranks (a collective under torchrun)."""
    return _counts(samples, num_prompts, lambda s: s.correct, reducer)[0]


def _counts(
    samples: list[Sample], num_prompts: int, flag: Callable[[Sample], bool | None], reducer: Reducer | None
) -> tuple[list[int], int]:
    """Per prompt, the samples for which ``flag`` holds, and the number of samples it was defined for, summed
    over ranks (one collective)."""
    counts = torch.zeros(num_prompts + 1, dtype=torch.float64)
    for sample in samples:
        value = flag(sample)
        if value is not None:
            counts[sample.prompt] += float(value)
            counts[num_prompts] += 1.0
    (reducer or LocalReducer()).sum_(counts)
    values = [int(c) for c in counts.tolist()]
    return values[:num_prompts], values[num_prompts]


def blocking(
    engine_or_generate: RolloutEngine | Generate, loop: asyncio.AbstractEventLoop | None = None
) -> Generate:
    """A blocking generate over a callable (itself), an in-process engine (`generate_sync`), or an asynchronous
    RolloutEngine living in ``loop``, an event loop running in another thread (an SGLangClient is bound to the
    loop it was built in)."""
    if not isinstance(engine_or_generate, RolloutEngine):
        return engine_or_generate
    engine = engine_or_generate
    if hasattr(engine, "generate_sync"):
        return engine.generate_sync
    if loop is None:
        raise ValueError(
            f"{type(engine).__name__} is asynchronous: pass loop=, the running event loop it was built in, "
            "and call sample_and_score from another thread (e.g. asyncio.to_thread)"
        )
    return lambda prompts, params: asyncio.run_coroutine_threadsafe(
        engine.generate(prompts, params), loop
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
    progress: Callable[[int, int], None] | None = None,
) -> Scored:
    """Sample ``params.n`` completions of this rank's prompts and score every one.

    ``ids[i]`` are the token ids of ``rows[i]`` as the engines get them. Under torchrun (``reducer`` of world
    size W) rank r takes prompts r, r + W, ...; the records are this rank's (reduce them with
    `correct_counts` / `EvalResult.from_samples`). The prompts go to the engine in one call, or in calls of
    ``prompts_per_call`` prompts, call c with seed ``params.seed + c``; ``progress(done, total)`` after each.
    All completions are then scored in one pass of the reward runner. See `blocking` for the engines taken.
    """
    generate = blocking(engine_or_generate, loop)
    reducer = reducer or LocalReducer()
    mine = list(range(reducer.rank, len(rows), reducer.world_size))
    size = prompts_per_call or max(len(mine), 1)
    owners: list[int] = []
    completions: list[Completion] = []
    start = time.perf_counter()
    for call, first in enumerate(range(0, len(mine), size)):
        chosen = mine[first : first + size]
        call_params = params if call == 0 or params.seed is None else replace(params, seed=params.seed + call)
        got = generate([ids[i] for i in chosen], call_params)
        if len(got) != len(chosen) * params.n:
            raise RuntimeError(
                f"the engine returned {len(got)} completions for {len(chosen)} prompts x n={params.n}"
            )
        completions += got
        owners += [chosen[j // params.n] for j in range(len(got))]
        if progress is not None:
            progress(first + len(chosen), len(mine))
    generate_s = time.perf_counter() - start
    start = time.perf_counter()
    texts = [decode(c.output_ids) for c in completions]
    scores, metrics = score_texts(runner, [rows[i] for i in owners], texts) if completions else ([], {})
    samples = [
        Sample(i, c, text, score)
        for i, c, text, score in zip(owners, completions, texts, scores, strict=True)
    ]
    return Scored(samples, metrics, generate_s, time.perf_counter() - start)


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Where generation ends: EOS, and the chat template's end-of-turn token when the tokenizer has one."""
    vocab = tokenizer.get_vocab()
    stop = {tokenizer.eos_token_id} | {vocab[t] for t in ("<|im_end|>",) if t in vocab}
    return tuple(sorted(t for t in stop if t is not None))


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
    max_new_tokens: int | None = None
    """Longest completion; None: DEFAULT_MAX_NEW_TOKENS, lowered to what the longest prompt leaves of the
    model's context (`evaluate_model` reports the value it used)."""
    seed: int = 0
    max_batch_size: int = 256
    """Sequences the engine decodes together; also the sequences of one generate call (prompts x n)."""
    engine: EngineKind = "embedded"
    """embedded: in process; local: the built-in CPU server; sglang: SGLang servers (see the module docstring)."""

    @property
    def n(self) -> int:
        return self.samples if self.samples is not None else self.k

    def __post_init__(self) -> None:
        if self.data.startswith(BUILTIN_PREFIX):
            name = self.data[len(BUILTIN_PREFIX) :]
            if name not in BUILTIN_TASKS:
                raise ValueError(
                    f"--data {self.data!r}: unknown built-in task {name!r}; choose one of "
                    f"{[BUILTIN_PREFIX + t for t in BUILTIN_TASKS]} or give a .jsonl / .parquet file"
                )
        elif Path(self.data).suffix not in FILE_EXTENSIONS:
            raise ValueError(
                f"--data {self.data!r} is neither builtin:<task> nor a file ending in "
                f"{' / '.join(FILE_EXTENSIONS)}; e.g. --data builtin:arithmetic or --data prompts.jsonl"
            )
        if self.k < 1:
            raise ValueError(f"--k {self.k}: k must be >= 1")
        if self.samples is not None and self.samples < self.k:
            raise ValueError(
                f"--samples {self.samples} is below --k {self.k}: pass@k needs at least k samples per prompt; "
                f"raise --samples or lower --k"
            )
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts {self.num_prompts} must be >= 1")
        sampling.temperature(self.temperature, "--temperature", maximum=sampling.MAX_TEMPERATURE)  # the engines' own checks
        if self.temperature == 0 and self.n > 1:
            raise ValueError(
                f"--temperature 0 is greedy: all {self.n} samples of a prompt would be the same; use --k 1 "
                "(greedy accuracy) or a temperature > 0"
            )
        sampling.top_p(self.top_p, "--top-p")
        if self.max_new_tokens is not None:
            sampling.bounded_int(self.max_new_tokens, "--max-new-tokens", 1)
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size {self.max_batch_size} must be >= 1")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine {self.engine!r}: choose one of {', '.join(ENGINES)}")


@dataclass
class EvalPrompts:
    """The prompts an evaluation samples, tokenized as the engines get them."""

    rows: list[PromptRow]
    ids: list[list[int]]
    max_new_tokens: int
    """The settings' value, or the default one fitted to the context."""
    dropped: int = 0
    """Prompts left out for their length (data.on_long_prompt=drop)."""


def load_eval_rows(settings: EvalSettings, data_cfg: DataConfig) -> list[PromptRow]:
    """The first ``settings.num_prompts`` rows of ``settings.data`` (all of a file without it), through training's
    loader: ``data.eval = settings.data``, the built-in task's settings of ``data_cfg``."""
    count = settings.num_prompts or DEFAULT_BUILTIN_PROMPTS
    rows = load_split(replace(data_cfg, eval=settings.data, num_eval=count), "eval")
    return rows[: settings.num_prompts] if settings.num_prompts is not None else rows


def tokenize_eval_prompts(
    settings: EvalSettings,
    data_cfg: DataConfig,
    rows: list[PromptRow],
    tokenizer,
    context: int | None,
    where: str,
) -> EvalPrompts:
    """``rows`` tokenized as the engines get them (`encode_prompt`, as training's start-up does), checked
    against ``context`` (the model's, named by ``where``) with training's prompt-length check: too long is an
    error, or dropped (data.on_long_prompt). Without ``settings.max_new_tokens`` the completions get
    DEFAULT_MAX_NEW_TOKENS, or fewer: what the longest prompt leaves of the context (at least 1)."""
    from trainer.model import encode_prompt

    ids = []
    for row in rows:
        try:
            ids.append(encode_prompt(tokenizer, row.prompt, row.messages))
        except ValueError as exc:  # e.g. a model without a chat template for `messages` rows
            raise DatasetError(f"{row.origin or f'--data {settings.data}'}: row {row.id!r}: {exc}") from None
    new_tokens = settings.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if context is None:  # the model states no context length: nothing to check against
        return EvalPrompts(rows, ids, new_tokens)
    if settings.max_new_tokens is None:
        new_tokens = max(1, min(new_tokens, context - max(len(prompt) for prompt in ids)))
    limit = context - new_tokens
    why = (
        f"the model's context is {context} tokens (max_position_embeddings of {where}) and "
        f"--max-new-tokens={new_tokens} are kept for the completion"
    )
    try:
        kept, kept_ids, dropped = limit_prompt_lengths(
            rows, ids, max_prompt_tokens=limit, on_long_prompt=data_cfg.on_long_prompt, source_key="--data",
            source=settings.data, why=why,
        )  # fmt: skip
    except DatasetError as exc:
        raise DatasetError(
            f"{exc}\n(trustbatch eval: --on-long-prompt drop, or a lower --max-new-tokens)"
        ) from None
    if not kept:
        raise DatasetError(
            f"--data {settings.data!r}: every prompt is longer than {limit} tokens ({why}), so dropping them "
            "leaves none; use shorter prompts or a lower --max-new-tokens"
        )
    if dropped:
        log.warning(
            "--data %s: dropped %d of %d prompts longer than %d tokens (on_long_prompt=drop; %s)",
            settings.data, dropped, len(rows), limit, why,
        )  # fmt: skip
    return EvalPrompts(kept, kept_ids, new_tokens, dropped)


# ---------------------------------------------------------------------------------------------- report


@dataclass
class EvalReport:
    """Everything one `trustbatch eval` measured; ``to_json()`` is what --out writes."""

    source: ModelSource
    model_dir: str
    settings: EvalSettings
    rows: list[PromptRow]
    samples: list[list[Sample]]
    """Each prompt's n scored completions, in order."""
    pass_at: dict[int, PassAtK]
    timings: dict[str, float]
    reward_metrics: dict[str, float]
    dropped_long_prompts: int = 0
    tracking_uri: str = ""
    mlflow_run_id: str | None = None

    @property
    def texts(self) -> list[list[str]]:
        return [[s.text for s in group] for group in self.samples]

    @property
    def correct(self) -> list[list[bool]]:
        return [[s.correct for s in group] for group in self.samples]

    @property
    def error_rate(self) -> float:
        flat = [s for group in self.samples for s in group]
        return sum(s.score.error is not None for s in flat) / len(flat)

    @property
    def mean_completion_tokens(self) -> float:
        flat = [len(s.completion.output_ids) for group in self.samples for s in group]
        return sum(flat) / len(flat)

    @property
    def answer_rate(self) -> float | None:
        """Share of completions with an answer a verifier could judge (`Sample.answered`), or None."""
        flags = [s.answered for group in self.samples for s in group]
        judged = [f for f in flags if f is not None]
        return sum(judged) / len(judged) if judged else None

    def metrics(self) -> dict[str, float]:
        """Flat metric names as logged to MLflow (MLflow names allow no '@')."""
        out = {}
        for k, result in self.pass_at.items():
            out[f"eval/pass_at_{k}"] = result.value
            if math.isfinite(result.stderr):
                out[f"eval/pass_at_{k}/stderr"] = result.stderr
        out["eval/reward_error_rate"] = self.error_rate
        out["eval/completion_tokens/mean"] = self.mean_completion_tokens
        if self.answer_rate is not None:
            out["eval/answer_rate"] = self.answer_rate
        out["eval/num_prompts"] = float(len(self.rows))
        out["eval/dropped_long_prompts"] = float(self.dropped_long_prompts)
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
            "dropped_long_prompts": self.dropped_long_prompts,
            "metrics": {
                f"pass@{k}": {"value": r.value, "stderr": r.stderr if math.isfinite(r.stderr) else None}
                for k, r in self.pass_at.items()
            },
            "reward_error_rate": self.error_rate,
            "answer_rate": self.answer_rate,
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
                    "correct": sum(s.correct for s in group),
                    "pass_at": {str(k): r.per_prompt[i] for k, r in self.pass_at.items()},
                    "completions": [
                        {
                            "text": s.text,
                            "correct": s.correct,
                            "reward": float(s.score.reward),
                            "finish_reason": s.completion.finish_reason,
                            "error": s.score.error,
                        }
                        for s in group
                    ],
                }
                for i, (row, group) in enumerate(zip(self.rows, self.samples, strict=True))
            ],
        }


# ---------------------------------------------------------------------------------------------- trustbatch eval


@dataclass
class EngineOptions:
    """How `trustbatch eval` reaches the local and sglang engines."""

    sglang: SGLangClientConfig | None = None
    """The rollout.sglang section of --config: client settings, and
    either `urls` of running servers or `launch` settings; None: defaults, one launched server."""
    sglang_python: str | None = None
    """Interpreter of the SGLang environment (overrides launch.python; default: this one)."""
    log_dir: Path | None = None
    """Where launched servers write their logs (default: a new temporary folder, kept)."""


def _start_servers(kind: str, model_dir: Path, settings: EvalSettings, options: EngineOptions):
    """(servers started here, client config) for the local or sglang engine; servers are healthy or starting."""
    import sys
    import tempfile

    from app.rollout.sglang import SGLangClientConfig
    from app.rollout.sglang_server import launch_servers

    client_cfg = options.sglang or SGLangClientConfig()
    log_dir = options.log_dir or Path(tempfile.mkdtemp(prefix="trustbatch-eval-"))
    if kind == "local":
        from app.rollout.process import LocalServerProcess

        server = LocalServerProcess(
            model_dir, max_batch_size=settings.max_batch_size, log_path=log_dir / "rollout-server.log"
        )
        log.info("starting the built-in CPU rollout server at %s (log %s)", server.url, server.log_path)
        try:
            server.start()
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
        return [server], replace(client_cfg, urls=[server.url])
    launch = client_cfg.launch
    if client_cfg.urls and not launch.num_servers:
        return [], client_cfg  # running servers, named by --config
    if not launch.num_servers:
        cpu = not torch.cuda.is_available()
        launch = replace(launch, num_servers=1, cpu=cpu, dtype="float32" if cpu else launch.dtype)
    default_python = sys.executable if launch.python == "python" else launch.python  # "python": this one
    launch = replace(launch, python=options.sglang_python or default_python)
    log.info("launching %d SGLang server(s) with %s (logs in %s)", launch.num_servers, launch.python, log_dir)
    servers = launch_servers(launch, model_dir, log_dir)  # from this (the main) thread: see its docstring
    return servers, replace(client_cfg, urls=[s.url for s in servers], launch=launch)


def _sample_over_http(
    client_cfg, call: Callable[[RolloutEngine, asyncio.AbstractEventLoop], Scored]
) -> Scored:
    """``call(client, loop)`` in a worker thread while this thread runs the event loop the client lives in."""
    from app.rollout.sglang import SGLangClient

    async def main() -> Scored:
        async with SGLangClient(client_cfg) as client:
            await client.wait_healthy()
            return await asyncio.to_thread(call, client, asyncio.get_running_loop())

    return asyncio.run(main())


def evaluate_model(
    ref: str,
    settings: EvalSettings,
    *,
    tracking_uri: str,
    rewards=None,
    sandbox=None,
    data_cfg: DataConfig | None = None,
    engine_options: EngineOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> EvalReport:
    """Sample, score and summarize (no MLflow, no files); see the module docstring.

    ``rewards`` / ``sandbox`` / ``data_cfg``: the config sections (default: RewardsConfig(), the math verifier;
    SandboxConfig(); DataConfig(), whose on_long_prompt and built-in task settings apply). ``progress(done,
    total)`` is called after each generate call.
    """
    from transformers import AutoConfig, AutoTokenizer

    from app.models import fetch, lookup
    from app.scoring import rewards_with_sandbox
    from rewards import RewardsConfig, check_tasks
    from sandbox import SandboxConfig

    rewards = rewards or RewardsConfig()
    sandbox = sandbox or SandboxConfig()
    data_cfg = data_cfg or DataConfig()
    options = engine_options or EngineOptions()
    source = lookup(ref, tracking_uri=tracking_uri)  # fail on a bad reference before loading any data
    rows = load_eval_rows(settings, data_cfg)
    check_tasks(rewards, {row.task for row in rows})
    model_dir = fetch(source, tracking_uri=tracking_uri)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    context = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)
    prompts = tokenize_eval_prompts(settings, data_cfg, rows, tokenizer, context, str(model_dir))
    settings = replace(settings, max_new_tokens=prompts.max_new_tokens)

    n = settings.n
    params = SamplingParams(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        n=n,
        stop_token_ids=stop_token_ids(tokenizer),
        seed=settings.seed,
    )

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def run(engine, runner: RewardRunner, loop=None) -> Scored:
        return sample_and_score(
            engine, prompts.rows, prompts.ids, params, runner, decode,
            prompts_per_call=max(1, settings.max_batch_size // n), loop=loop, progress=progress,
        )  # fmt: skip

    if settings.engine == "embedded":
        from app.rollout.embedded import EmbeddedEngine

        engine = EmbeddedEngine.from_pretrained(model_dir, max_batch_size=settings.max_batch_size)
        with RewardRunner(rewards_with_sandbox(rewards, sandbox)) as runner:
            scored = run(engine, runner)
    else:
        servers, client_cfg = _start_servers(settings.engine, Path(model_dir), settings, options)
        try:
            with RewardRunner(rewards_with_sandbox(rewards, sandbox)) as runner:
                scored = _sample_over_http(client_cfg, lambda client, loop: run(client, runner, loop))
        finally:
            for server in servers:
                server.stop()

    groups: list[list[Sample]] = [[] for _ in prompts.rows]
    for sample in scored.samples:
        groups[sample.prompt].append(sample)
    counts = correct_counts(scored.samples, len(prompts.rows))
    total = len(scored.samples)
    return EvalReport(
        source=source,
        model_dir=str(model_dir),
        settings=settings,
        rows=prompts.rows,
        samples=groups,
        pass_at={k: summarize(counts, n, k) for k in reported_ks(settings.k)},
        timings={
            "generate_s": scored.generate_s,
            "score_s": scored.score_s,
            "completions_per_s": total / scored.generate_s if scored.generate_s > 0 else float("nan"),
        },
        reward_metrics=scored.reward_metrics,
        dropped_long_prompts=prompts.dropped,
        tracking_uri=tracking_uri,
    )


def run_evaluation(
    ref: str,
    settings: EvalSettings,
    *,
    tracking_uri: str,
    rewards=None,
    sandbox=None,
    data_cfg: DataConfig | None = None,
    engine_options: EngineOptions | None = None,
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
        engine_options=engine_options,
        progress=progress,
    )
    if track:
        log_to_mlflow(report, tracking_uri=tracking_uri, experiment=experiment)
    if out is not None:
        write_json(report, out)
    return report


def log_to_mlflow(report: EvalReport, *, tracking_uri: str, experiment: str = "trustbatch") -> str:
    """Log ``report`` as a new finished MLflow run (app/tracking.py Tracker); returns its run id (also set on
    the report)."""
    from app.config import TrackingConfig
    from app.tracking import Tracker

    source, settings = report.source, report.settings
    tags = {"trustbatch.kind": "eval", "trustbatch.model_ref": source.ref}
    for key in ("name", "version", "run_id"):
        if getattr(source, key):
            tags[f"trustbatch.model_{key}"] = str(getattr(source, key))
    tracker = Tracker(
        TrackingConfig(uri=tracking_uri, experiment=experiment),
        None,
        run_name=f"eval {source.ref}"[:250],
        tags=tags,
    )
    tracker.log_params(
        {
            "model.ref": source.ref,
            "model.path": report.model_dir,
            "model.name": source.name or "",
            "model.version": source.version or "",
            "model.run_id": source.run_id or "",
            **{f"eval.{key}": value for key, value in asdict(settings).items()},
            "eval.samples": settings.n,
            "eval.num_prompts_used": len(report.rows),
        }
    )
    tracker.log_metrics(report.metrics(), step=0)
    report.mlflow_run_id = tracker.run_id
    tracker.log_text(json.dumps(report.to_json(), indent=2), "eval_results.json")
    tracker.finish()
    return tracker.run_id


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
    dropped = f" ({report.dropped_long_prompts} too long, dropped)" if report.dropped_long_prompts else ""
    header = Text(
        f"{report.source.label}\n{settings.data}: {len(report.rows)} prompts{dropped} x {settings.n} samples, "
        f"temperature {settings.temperature:g}, top_p {settings.top_p:g}, at most {settings.max_new_tokens} new "
        f"tokens, seed {settings.seed}, engine {settings.engine}"
    )
    table = Table()
    table.add_column("metric")
    table.add_column("estimate", justify="right")
    table.add_column("± s.e. (points)", justify="right")
    for k, result in report.pass_at.items():
        stderr = f"{100 * result.stderr:.2f}" if math.isfinite(result.stderr) else "-"
        table.add_row(f"pass@{k}", f"{100 * result.value:.2f}%", stderr)
    if report.answer_rate is not None:
        table.add_row("answer found (format)", f"{100 * report.answer_rate:.2f}%", "")
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
