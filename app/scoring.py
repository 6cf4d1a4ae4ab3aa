"""Score completions of dataset rows with the reward runner (the glue between rows and verifiers)."""

from __future__ import annotations

from dataclasses import asdict, replace

from app.data import PromptRow
from rewards import RewardsConfig, Score, VerifierInput
from rewards.runner import RewardRunner
from sandbox import SandboxConfig


def rewards_with_sandbox(rewards: RewardsConfig, sandbox: SandboxConfig) -> RewardsConfig:
    """The run's `sandbox` section handed to every code verifier that does not set `params.sandbox` itself
    (reward workers are separate processes: each applies it with `sandbox.configure`)."""
    verifiers = [
        replace(spec, params={**spec.params, "sandbox": asdict(sandbox)})
        if spec.name == "code" and "sandbox" not in spec.params
        else spec
        for spec in rewards.verifiers
    ]
    return replace(rewards, verifiers=verifiers)


def score_texts(runner: RewardRunner, rows: list[PromptRow], texts: list[str]) -> tuple[list[Score], dict]:
    """Score `texts[i]` as a completion of `rows[i]`; each row's task picks its verifiers."""
    inputs = [
        VerifierInput(
            prompt=row.prompt
            if row.prompt is not None
            else "\n".join(m["content"] for m in row.messages or []),
            completion=text,
            reference=row.answer if row.answer is not None else row.tests,
            metadata={**row.metadata, "task": row.task, "id": row.id},
        )
        for row, text in zip(rows, texts, strict=True)
    ]
    scores, metrics = runner.score(inputs, [row.task for row in rows])
    return scores, {**metrics, **per_source(rows, scores)}


def per_source(rows: list[PromptRow], scores: list[Score]) -> dict[str, float]:
    """``reward/source/<name>/mean`` and ``.../correct`` for each source of a mixture (rows tagged with
    ``metadata.data_source``); nothing when the rows come from one source."""
    groups: dict[str, list[Score]] = {}
    for row, score in zip(rows, scores, strict=True):
        groups.setdefault(str(row.metadata.get("data_source", "")), []).append(score)
    if len(groups) < 2:
        return {}
    out = {}
    for name, group in groups.items():
        out[f"reward/source/{name}/mean"] = sum(s.reward for s in group) / len(group)
        out[f"reward/source/{name}/correct"] = sum(bool(s.correct) for s in group) / len(group)
    return out
