"""`trustbatch filter-prompts`: keep the training prompts a model solves some of the time, not always or never.

A group of samples that are all right or all wrong has no advantage, so RL learns nothing from it; the
sanity check of "RL on prompts the model sometimes solves" keeps the problems the starting model solves 20-80%
of the time. This samples ``n`` completions of each prompt of data.train with a given model (the evaluation
`train` and `eval` use: same engines, prompts, verifiers and settings), and writes the prompts whose pass rate
lies in [low, high] as row-schema JSONL, each with its measured rate in ``metadata.pass_rate`` (and its
completion, if it had one), ready to be a run's data.train.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from app.data import PromptRow
from app.evaluation.command import evaluate_model
from app.evaluation.config import EvalJob


@dataclass
class Filtered:
    rows: list[PromptRow]
    rates: list[float]
    """The pass rate of every prompt sampled, in order."""
    kept: int
    histogram: dict[str, int]
    """How many prompts had each pass rate (``"3/8"``)."""


def row_json(row: PromptRow, **metadata) -> dict:
    """A row as the row schema writes it (app/data/rows.py), with ``metadata`` added."""
    out: dict = {"messages": row.messages} if row.messages is not None else {"prompt": row.prompt}
    for key in ("answer", "tests", "completion"):
        if getattr(row, key) is not None:
            out[key] = getattr(row, key)
    out.update(task=row.task, id=row.id, metadata={**row.metadata, **metadata})
    return out


def filter_prompts(
    ref: str, cfg: EvalJob, *, tracking_uri: str, out: Path, n: int, low: float, high: float, num: int | None,
    engine: str,
) -> Filtered:  # fmt: skip
    """Sample ``n`` completions of the first ``num`` prompts of data.train (all: None) with model ``ref`` at the
    evaluation temperature, and write those whose pass rate is in [low, high] to ``out``."""
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"--low {low} and --high {high} must satisfy 0 <= low <= high <= 1")
    if n < 1:
        raise ValueError(f"--n {n} must be >= 1")
    # eval.num_prompts counts the train prompts here; data.num_eval (the held-out split's size) must not cap it.
    run_cfg = replace(
        cfg, data=replace(cfg.data, num_eval=max(cfg.data.num_eval, num or 0)),
        eval=replace(cfg.eval, samples_per_prompt=n, num_prompts=num, k=1),
    )  # fmt: skip
    result = evaluate_model(ref, run_cfg, tracking_uri=tracking_uri, engine=engine, label="filter-prompts",
                            split="train")  # fmt: skip
    rates = [c / n for c in result.correct]
    kept = [(row, rate) for row, rate in zip(result.rows, rates, strict=True) if low <= rate <= high]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row, rate in kept:
            f.write(json.dumps(row_json(row, pass_rate=rate, pass_rate_model=ref, pass_rate_samples=n)) + "\n")
    tmp.replace(out)
    histogram = Counter(f"{c}/{n}" for c in result.correct)
    return Filtered([r for r, _ in kept], rates, len(kept), dict(sorted(histogram.items(), key=lambda kv: int(kv[0].split("/")[0]))))
