"""What an evaluation measures and how it samples: the one settings type of every evaluation.

`EvalConfig` is the config section ``eval`` of a training run (when it evaluates, on which prompts, how it
samples), and `trustbatch eval` builds the same object: each of its options sets one key of it (``--k`` is
``eval.k``, ``--samples`` is ``eval.samples_per_prompt``, ``--num-prompts`` is ``eval.num_prompts``, ...), over the
sections of ``--config`` when one is given (app/cli.py). Sampling values left empty (None) come from the run's
``rollout`` section (`resolved`), so by default training evaluates as it samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from app import sampling
from app.data import DataConfig
from app.rollout.config import RolloutConfig
from rewards import RewardsConfig
from sandbox import SandboxConfig
from tools import ToolSpec


@dataclass
class EvalConfig:
    every: int = 25
    """Training: evaluate on the held-out split every N steps (and always before the first and after the last)."""
    num_prompts: int | None = 500
    """Evaluate the first N prompts of data.eval (a built-in task's test split, or a file); null: all of them."""
    samples_per_prompt: int = 4
    """Samples per prompt (n) at the evaluation temperature: sampled pass@1 averages all of them."""
    greedy: bool = True
    """Training: also report greedy (temperature 0) accuracy."""
    k: int = 1
    """Report pass@1, pass@2, pass@4, ... pass@k (unbiased, from the n samples of each prompt; k <= n)."""
    temperature: float | None = None
    """Sampling temperature; null: rollout.temperature (training evaluates at the temperature it samples at)."""
    top_p: float | None = None
    """Nucleus mass; null: rollout.top_p."""
    max_new_tokens: int | None = None
    """Longest completion; null: rollout.max_new_tokens."""
    seed: int | None = None
    """Sampling seed; null: run.seed + 17 (the same prompts and seed at every evaluation of a run)."""
    benchmarks: list[str] = field(default_factory=list)
    """Training: standard benchmarks evaluated with the held-out prompts (gsm8k math500 aime24 aime25 amc23
    humaneval mbpp), each with its own prompt and sampling (app/evaluation/benchmarks.py); their tasks need a
    verifier in rewards.verifiers. Also what data.decontaminate checks the training rows against."""
    bench_dir: str = ""
    """Local mirrors of the benchmarks: DIR/<name> (save_to_disk, or a dataset repository's files) or
    DIR/<name>.jsonl / .parquet; empty: $TRUSTBATCH_BENCH_DIR, else the hub (HumanEval: make humaneval)."""

    def __post_init__(self) -> None:
        from app.evaluation.benchmarks import BENCHMARKS  # the names only: nothing is loaded here

        unknown = [name for name in self.benchmarks if name not in BENCHMARKS]
        if unknown:
            raise ValueError(f"eval.benchmarks: unknown benchmark(s) {unknown}; choose from {sorted(BENCHMARKS)}")
        if self.every < 0:
            raise ValueError(f"eval.every must be >= 0 (0 = only before and after), got {self.every}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"eval.num_prompts must be >= 1 (or null: every prompt), got {self.num_prompts}")
        if self.k < 1:
            raise ValueError(f"eval.k={self.k}: k must be >= 1")
        if self.samples_per_prompt < 1:
            raise ValueError(f"eval.samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        if self.samples_per_prompt < self.k:
            raise ValueError(
                f"eval.samples_per_prompt={self.samples_per_prompt} is below eval.k={self.k}: pass@k needs at "
                "least k samples per prompt; raise eval.samples_per_prompt or lower eval.k"
            )
        if self.temperature is not None:
            # The engines' own checks, with OpenAI's upper bound.
            sampling.temperature(self.temperature, "eval.temperature", maximum=sampling.MAX_TEMPERATURE)
            if self.temperature == 0 and self.samples_per_prompt > 1:
                raise ValueError(
                    f"eval.temperature=0 is greedy: all {self.samples_per_prompt} samples of a prompt would be "
                    "the same; set eval.samples_per_prompt=1 and eval.k=1 (greedy accuracy) or a temperature > 0"
                )
        if self.top_p is not None:
            sampling.top_p(self.top_p, "eval.top_p")
        if self.max_new_tokens is not None:
            sampling.bounded_int(self.max_new_tokens, "eval.max_new_tokens", 1)
        if self.seed is not None:
            sampling.seed(self.seed, "eval.seed")

    def resolved(self, *, temperature: float, top_p: float, max_new_tokens: int, seed: int) -> EvalConfig:
        """A copy with every empty sampling value filled from the given ones (the run's rollout section)."""
        return replace(
            self,
            temperature=temperature if self.temperature is None else self.temperature,
            top_p=top_p if self.top_p is None else self.top_p,
            max_new_tokens=max_new_tokens if self.max_new_tokens is None else self.max_new_tokens,
            seed=seed if self.seed is None else self.seed,
        )


@dataclass(frozen=True)
class EvalJob:
    """The sections of a run's config an evaluation reads, passed in (`Config.eval_job`): evaluation sits under
    app/config.py and never imports the root config."""

    data: DataConfig
    eval: EvalConfig
    rollout: RolloutConfig
    rewards: RewardsConfig
    sandbox: SandboxConfig
    tools: list[ToolSpec] = field(default_factory=list)
    seed: int = 0
    """run.seed: the evaluation's default sampling seed is seed + 17 (training's held-out evaluations' too)."""
    experiment: str = "trustbatch"
    """tracking.experiment: the MLflow experiment `trustbatch eval` logs into."""
