"""`Trajectory`: a multi-turn rollout as token ids plus parallel per-token arrays, grown by one append.

A tool-using answer is the model's tokens, then a tool's tokens, then the model's again, and so on. The trainer
must score exactly the tokens the engine sampled, with the logprobs the engine reported and the weights that
sampled them, and must not train on the tool's tokens. So a trajectory is never text: the engine's output ids
are appended as they come (never decoded and encoded again), a tool's text becomes tokens once, and every token
carries, side by side:

    ids        the token
    loss_mask  True for a token the policy sampled, False for a tool's
    logprob    the engine's behaviour logprob (0.0 for a tool's token: never read, its mask is False)
    version    the policy version that sampled it (-1 for a tool's token)
    turn       the model turn it belongs to (a tool's tokens carry the turn of the call they answer)

`Trajectory.append` is the only way in; it checks its arguments and grows every array by the same count, so
they are always the same length (tests/unit/test_trajectory.py checks this over random append sequences).
`to_completion` hands the trajectory to the trainer as a `Completion` whose per-token arrays come along.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from app.rollout.base import Completion

Status = Literal["answered", "budget", "max_turns", "tool_error", "abort"]
STATUSES: tuple[str, ...] = ("answered", "budget", "max_turns", "tool_error", "abort")
"""answered: the model ended its reply; budget: the token budget (or the context, or the turn's own cap) ran out;
max_turns: the model called a tool on its last allowed turn; tool_error: no tool could run (the sandbox is
unavailable); abort: the engine aborted the request."""


@dataclass
class Trajectory:
    """One episode's tokens after its prompt (module docstring)."""

    prompt_ids: list[int]
    _ids: list[int] = field(default_factory=list)
    _mask: list[bool] = field(default_factory=list)
    _logprobs: list[float] = field(default_factory=list)
    _versions: list[int] = field(default_factory=list)
    _turns: list[int] = field(default_factory=list)
    status: Status | None = None
    tool_calls: list[dict] = field(default_factory=list)
    """One record per call: turn, tool name, status, tokens of its observation, whether they were cut."""
    void_turns: int = 0
    """Model turns that ended with neither a tool call nor a final answer (SimpleTIR's void turns)."""
    start_version: int | None = None
    """The policy version of the engine's first answer (the trajectory's version if it sampled no token)."""
    requests: int = 0
    """Generation requests it took (a call costs two: the block's opening fence pauses generation too)."""
    tool_wait_s: float = 0.0
    """Seconds it waited on tools."""
    wall_s: float = 0.0
    """Seconds from its first request to its end."""

    def append(
        self,
        ids: list[int],
        *,
        sampled: bool,
        turn: int,
        version: int = -1,
        logprobs: list[float] | None = None,
    ) -> None:
        """Add ``ids`` to every array: the policy's tokens (``sampled``, with their ``logprobs`` and ``version``)
        or a tool's (``sampled=False``: no logprobs, masked out). ValueError for inconsistent arguments."""
        ids = [int(t) for t in ids]
        if sampled:
            if logprobs is None or len(logprobs) != len(ids):
                raise ValueError(
                    f"{len(ids)} sampled tokens need as many logprobs, got {None if logprobs is None else len(logprobs)}"
                )
            if version < 0:
                raise ValueError(f"sampled tokens need the policy version that sampled them, got {version}")
            values = [float(v) for v in logprobs]
        else:
            if logprobs is not None:
                raise ValueError("a tool's tokens have no behaviour logprobs")
            values = [0.0] * len(ids)
            version = -1
        if turn < 0 or (self._turns and turn < self._turns[-1]):
            raise ValueError(f"turn {turn} goes back from turn {self._turns[-1] if self._turns else 0}")
        self._ids += ids
        self._mask += [sampled] * len(ids)
        self._logprobs += values
        self._versions += [version] * len(ids)
        self._turns += [turn] * len(ids)

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    @property
    def loss_mask(self) -> list[bool]:
        return list(self._mask)

    @property
    def logprobs(self) -> list[float]:
        return list(self._logprobs)

    @property
    def versions(self) -> list[int]:
        return list(self._versions)

    @property
    def turns(self) -> list[int]:
        return list(self._turns)

    @property
    def sampled_tokens(self) -> int:
        return sum(self._mask)

    def oldest_version(self, default: int) -> int:
        """The oldest policy version among the sampled tokens (what the lag bound counts); ``default`` if none."""
        versions = [v for v, m in zip(self._versions, self._mask, strict=True) if m]
        return min(versions) if versions else default

    def segments(self) -> list[tuple[list[int], bool]]:
        """The ids in runs of the same origin: (ids, sampled by the policy?)."""
        out: list[tuple[list[int], bool]] = []
        for token, sampled in zip(self._ids, self._mask, strict=True):
            if out and out[-1][1] == sampled:
                out[-1][0].append(token)
            else:
                out.append(([token], sampled))
        return out

    def to_completion(self, *, train: bool = True) -> Completion:
        """The trajectory as the trainer takes it; ``train=False`` masks every token out (a dropped trajectory
        still counts in its group's rewards and advantages, and is trained on nowhere)."""
        assert self.status is not None, "a trajectory is handed over once its episode has ended"
        assert all(math.isfinite(v) for v in self._logprobs)
        finish = {"answered": "stop", "abort": "abort"}.get(self.status, "length")
        return Completion(
            prompt_ids=list(self.prompt_ids),
            output_ids=self.ids,
            output_logprobs=self.logprobs,
            finish_reason=finish,
            policy_version=self.oldest_version(self.start_version or 0),
            meta={
                "status": self.status,
                "tool_calls": list(self.tool_calls),
                "turns": (self._turns[-1] + 1) if self._turns else 0,
                "void_turns": self.void_turns,
                "trained": train,
                "requests": self.requests,
                "tool_wait_s": self.tool_wait_s,
                "wall_s": self.wall_s,
            },
            output_mask=self.loss_mask if train else [False] * len(self),
            output_versions=self.versions,
            output_turns=self.turns,
        )


def completion_text(completion: Completion, decode) -> str:
    """The text a verifier reads: the model's own tokens, decoded run by run, with the tools' observations left
    out (a tool's output can print a \\boxed{} answer; only the model's own writing counts). A single-turn
    completion is decoded whole."""
    if completion.output_versions is None:
        return decode(completion.output_ids)
    pieces, run = [], []
    for token, version in zip(completion.output_ids, completion.output_versions, strict=True):
        if version >= 0:
            run.append(token)
        elif run:
            pieces.append(decode(run))
            run = []
    if run:
        pieces.append(decode(run))
    return "".join(pieces)


def trajectory_metrics(completions: list[Completion]) -> dict[str, float]:
    """What the multi-turn trajectories among ``completions`` did, for the step's metrics and evaluation reports:
    the share of each status, turns, void turns, tool calls and their outcomes, requests and the share of their
    time spent waiting on tools. Empty when none is multi-turn."""
    metas = [c.meta for c in completions if "status" in c.meta]
    if not metas:
        return {}
    n = len(metas)
    calls = [call for meta in metas for call in meta["tool_calls"]]
    count = max(len(calls), 1)
    wall = sum(meta["wall_s"] for meta in metas)
    out = {f"rollout/status/{status}": sum(meta["status"] == status for meta in metas) / n for status in STATUSES}
    out.update({
        "rollout/turns/mean": sum(meta["turns"] for meta in metas) / n,
        "rollout/void_turn_rate": sum(meta["void_turns"] > 0 for meta in metas) / n,
        "rollout/dropped_void_frac": sum(not meta["trained"] for meta in metas) / n,
        "rollout/requests_per_trajectory": sum(meta["requests"] for meta in metas) / n,
        "tools/calls_per_trajectory": len(calls) / n,
        "tools/error_rate": sum(call["status"] in ("error", "malformed") for call in calls) / count,
        "tools/timeout_rate": sum(call["status"] == "timeout" for call in calls) / count,
        "tools/malformed_rate": sum(call["status"] == "malformed" for call in calls) / count,
        "tools/cut_output_rate": sum(bool(call["cut"]) for call in calls) / count,
        "tools/wait_frac": sum(meta["tool_wait_s"] for meta in metas) / wall if wall > 0 else 0.0,
    })
    return out
