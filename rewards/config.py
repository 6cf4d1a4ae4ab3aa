"""The ``rewards`` config section: which verifiers score which tasks, with what weights, and how the runner runs.

YAML shape (``configs/base.yaml``)::

    rewards:
      verifiers:
        - {name: math, weight: 1.0, tasks: [math], params: {extraction: [boxed, last_line]}}
        - {name: format, weight: 0.1, tasks: [math]}
        - {name: code, tasks: [code], params: {mode: fraction}, timeout_s: 60}
        - {name: my_pkg.verifiers:make_verifier, tasks: [mine]}
      num_workers: 2
      timeout_s: 10
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import MISSING


@dataclass
class VerifierSpec:
    """One verifier in ``rewards.verifiers``."""

    name: str = MISSING
    """A registered verifier (``math``, ``code``, ``format``, ``exact``) or ``package.module:factory``."""
    weight: float = 1.0
    """Weight of this verifier's reward in the sample's reward (a weighted sum over its task's verifiers)."""
    tasks: list[str] = field(default_factory=lambda: ["math"])
    """Tasks this verifier scores; each sample goes to the verifiers whose tasks include its ``task``."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword parameters for the verifier's factory (for ``math``: the fields of MathVerifierConfig)."""
    label: str | None = None
    """Name in metrics and breakdowns (``reward/<label>/mean``); defaults to ``name`` (the factory's name for a
    dotted path). Needed when one verifier appears twice with different params."""
    timeout_s: float | None = None
    """Time limit for one call of this verifier on one sample; defaults to ``rewards.timeout_s``. Code
    verifiers run every test of a sample in one call, so give them room (tests x per-test limit)."""

    @property
    def key(self) -> str:
        """The label used in metrics and breakdowns."""
        if self.label:
            return self.label
        return self.name.rpartition(":")[2] if ":" in self.name else self.name


@dataclass
class RewardsConfig:
    """The ``rewards`` section: verifiers, routing and the scoring process pool."""

    verifiers: list[VerifierSpec] = field(default_factory=lambda: [VerifierSpec(name="math", tasks=["math"])])
    """The verifiers, each with its weight, tasks and params."""
    error_reward: float = 0.0
    """Reward of a sample whose verifier raised, timed out, crashed its worker or returned ``Score.error``."""
    num_workers: int = 1
    """Scoring processes. 0 scores in the calling process (tests, debugging): the time limit is then enforced
    by SIGALRM only in the main thread, and a hang inside C code cannot be interrupted; use >= 1 in training."""
    timeout_s: float = 10.0
    """Per-sample, per-verifier time limit in seconds (overridable per verifier with ``verifiers[i].timeout_s``)."""
    kill_grace_s: float = 1.0
    """Extra seconds past a sample's limit before its worker process is killed and replaced (for hangs that
    the in-process alarm cannot interrupt, such as a long C call)."""
    chunk_size: int = 0
    """Samples sent to a worker per message; 0 picks about a quarter of an even share per worker."""
    start_method: Literal["spawn", "forkserver", "fork"] = "spawn"
    """How worker processes start. ``spawn`` is safe beside torch and CUDA threads; ``fork`` starts fastest."""
    worker_memory_mb: int = 4096
    """Soft address-space limit (RLIMIT_AS) of each worker, so a runaway computation raises MemoryError instead
    of exhausting the host; 0 disables it."""

    def __post_init__(self) -> None:
        if not self.verifiers:
            raise ValueError(
                "rewards.verifiers is empty: configure at least one verifier, e.g. "
                "rewards.verifiers=[{name: math, tasks: [math]}]"
            )
        labels: dict[str, int] = {}
        for i, spec in enumerate(self.verifiers):
            where = f"rewards.verifiers[{i}]"
            _check_spec(spec, where)
            if spec.key in labels:
                raise ValueError(
                    f"{where}.label: {spec.key!r} is already used by rewards.verifiers[{labels[spec.key]}]; "
                    f"set a distinct label on one of them (e.g. label: {spec.key}_2)"
                )
            labels[spec.key] = i
        if not math.isfinite(self.error_reward):
            raise ValueError(f"rewards.error_reward={self.error_reward!r} must be a finite number, e.g. 0.0")
        if self.num_workers < 0:
            raise ValueError(
                f"rewards.num_workers={self.num_workers!r} must be >= 0 (0: score in the calling process)"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"rewards.timeout_s={self.timeout_s!r} must be > 0 seconds, e.g. 10")
        if not self.kill_grace_s > 0:
            raise ValueError(f"rewards.kill_grace_s={self.kill_grace_s!r} must be > 0 seconds, e.g. 1.0")
        if self.chunk_size < 0:
            raise ValueError(f"rewards.chunk_size={self.chunk_size!r} must be >= 0 (0: automatic)")
        if self.worker_memory_mb < 0:
            raise ValueError(f"rewards.worker_memory_mb={self.worker_memory_mb!r} must be >= 0 (0: no limit)")

    @property
    def tasks(self) -> list[str]:
        """Every task some verifier scores, in config order."""
        return list(dict.fromkeys(t for spec in self.verifiers for t in spec.tasks))


def _check_spec(spec: VerifierSpec, where: str) -> None:
    from rewards.registry import REGISTRY  # the built-ins are registered by `import rewards`

    if not isinstance(spec.name, str) or not spec.name.strip():
        raise ValueError(
            f"{where}.name={spec.name!r} is empty: name a registered verifier {sorted(REGISTRY)}"
        )
    if ":" not in spec.name and spec.name not in REGISTRY:
        raise ValueError(
            f"{where}.name={spec.name!r} is not a registered verifier; registered: {sorted(REGISTRY)}. "
            "Use one of these, or give your own as 'package.module:factory'."
        )
    if not math.isfinite(spec.weight):
        raise ValueError(f"{where}.weight={spec.weight!r} must be a finite number, e.g. 1.0")
    if not spec.tasks or any(not isinstance(t, str) or not t for t in spec.tasks):
        raise ValueError(
            f"{where}.tasks={list(spec.tasks)!r} must be a non-empty list of task names, e.g. [math]"
        )
    if spec.timeout_s is not None and not spec.timeout_s > 0:
        raise ValueError(
            f"{where}.timeout_s={spec.timeout_s!r} must be > 0 seconds, or null for rewards.timeout_s"
        )


def check_tasks(cfg: RewardsConfig, tasks: Iterable[str]) -> None:
    """Fail at start-up if a dataset task has no verifier (call it with the dataset's distinct tasks)."""
    configured = set(cfg.tasks)
    missing = sorted({t for t in tasks} - configured)
    if missing:
        raise ValueError(
            f"dataset task(s) {missing} have no verifier: rewards.verifiers score tasks {cfg.tasks}. "
            f"Add the task to a verifier's tasks (e.g. rewards.verifiers[0].tasks=[{', '.join(cfg.tasks + missing)}]) "
            "or add a verifier for it."
        )
