"""The RolloutEngine protocol and the types that cross it.

Every engine — the embedded CPU engine, the built-in CPU HTTP server, a real SGLang server — is driven
through this protocol, token ids in and token ids plus behaviour logprobs out, so the trainer never cares
which one produced a completion. The field names follow SGLang's native ``/generate`` API
(``sampling_params``, ``output_ids``, ``meta_info.output_token_logprobs``, ``finish_reason``,
``weight_version``) so an HTTP client can fill them one to one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch

from app.sampling import MIN_TEMPERATURE, check_sampling

__all__ = ["MIN_TEMPERATURE", "Completion", "ProbeReading", "RolloutEngine", "SamplingParams", "WeightSource"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one generate call (a subset of SGLang's ``sampling_params``)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    """Completions per prompt; results are prompt-major (p0s0, p0s1, ..., p1s0, ...) as in SGLang."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a sequence ends after it samples one of these (the EOS id is always included)."""
    seed: int | None = None

    def __post_init__(self) -> None:
        # The checks of every sampling value trustbatch takes (app/sampling.py): finite numbers, a temperature
        # of 0 or at least MIN_TEMPERATURE, top_p in (0, 1], a seed the generator takes.
        names = ("max_new_tokens", "temperature", "top_p", "n", "stop_token_ids", "seed")
        check_sampling({name: (name, getattr(self, name)) for name in names})


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    """Behaviour logprob of each output token under the distribution it was sampled from."""
    finish_reason: Literal["stop", "length", "abort"]
    policy_version: int
    """Version of the weights that produced it (SGLang's ``weight_version``); for a multi-turn trajectory the
    oldest version among its sampled tokens (what the lag bound counts)."""
    meta: dict = field(default_factory=dict)
    output_mask: list[bool] | None = None
    """Per output token: sampled by the policy (True) or a tool's (False, never trained on); None: all sampled.
    Set for multi-turn trajectories (app/rollout/trajectory.py), as are the two below."""
    output_versions: list[int] | None = None
    """Per output token: the policy version that sampled it (-1 for a tool's token); None: all policy_version."""
    output_turns: list[int] | None = None
    """Per output token: its model turn (0, 1, ...); None: a single turn."""


@dataclass(frozen=True)
class WeightSource:
    """Where an engine takes new weights from: an in-memory state dict or an HF directory on disk, or (``adapter``)
    a PEFT LoRA adapter directory on disk that the engine applies over the base model it was started with."""

    state_dict: dict[str, torch.Tensor] | None = None
    path: Path | None = None
    adapter: bool = False

    def __post_init__(self) -> None:
        if (self.state_dict is None) == (self.path is None):
            raise ValueError("WeightSource needs exactly one of state_dict or path")
        if self.adapter and self.path is None:
            raise ValueError("WeightSource(adapter=True) needs the adapter's directory as path")


@dataclass(frozen=True)
class ProbeReading:
    """What one engine (one server of a client) computed for a fixed token sequence: the log-probability of
    each token after the first (SGLang's ``input_token_logprobs``), and the weight version it says it serves."""

    server: str
    weight_version: str | None
    logprobs: list[float]


@runtime_checkable
class RolloutEngine(Protocol):
    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, progress: Callable[[int], None] | None = None
    ) -> list[Completion]:
        """``params.n`` completions of every prompt, prompt-major; ``progress(k)`` (optional) is told each time
        k more are done, from any thread."""
        ...

    async def update_weights(self, source: WeightSource, version: int) -> None: ...

    async def health(self) -> bool: ...

    async def score(self, ids: list[int]) -> list[ProbeReading]:
        """The log-probabilities of ``ids[1:]`` given their prefix at temperature 1, from every server."""
        ...
