"""`trustbatch data CONFIG`: load, map and check every source of a config without training, and say what is in it.

For each source of ``data.train`` and ``data.eval``: its rows; its prompts' lengths in tokens as the model gets them
(its tokenizer and chat template; the percentiles 50 / 90 / 99 and the longest); the rows too long for the context
with the completion budget, which ``data.on_long_prompt=drop`` leaves out; a few prompts rendered exactly as the
model reads them. Then the decontamination report (app/data/decontaminate.py: training rows sharing a 13-gram with
``data.eval`` or a benchmark of ``eval.benchmarks``; ``data.decontaminate=drop`` leaves them out), and the
mixture's shares. With ``--check-references`` every row's reference is scored by its own verifiers: a math answer
(``\\boxed{answer}``) must verify against itself, a code task's canonical solution (HumanEval's prompt and solution,
MBPP's code, a row's completion) must pass its tests; the failures are listed and the command exits 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from app.config import Config
from app.data import PromptRow
from app.data.decontaminate import Overlaps, overlaps
from app.data.prepare import ModelText, encode_rows
from app.data.sources import load_source

PERCENTILES = (50, 90, 99)


@dataclass
class SourceReport:
    split: str
    name: str
    source: str
    rows: int
    weight: float | None
    lengths: dict[str, int] = field(default_factory=dict)
    too_long: int = 0
    examples: list[str] = field(default_factory=list)


@dataclass
class DataReport:
    sources: list[SourceReport]
    overlap: Overlaps
    budget: int | None
    """Prompt tokens allowed: the context less the completion budget (None: the model states no context)."""
    reference_failures: list[str] = field(default_factory=list)
    references_checked: int = 0


def _percentile(values: list[int], q: int) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def reference_text(row: PromptRow) -> str | None:
    """What the row's reference answer is, as a completion its verifier should accept."""
    if row.task == "code" or row.tests is not None:
        meta = row.metadata
        if "canonical_solution" in meta:  # HumanEval: the signature and docstring, then the body
            prompt = str(row.messages[-1]["content"]) if row.messages else (row.prompt or "")
            head = prompt.split("```python\n", 1)[-1].split("\n```", 1)[0]
            return f"```python\n{head}\n{meta['canonical_solution']}\n```"
        if "code" in meta:  # MBPP
            return f"```python\n{meta['code']}\n```"
        return row.completion
    if row.answer is not None:
        return f"\\boxed{{{row.answer}}}"
    return row.completion


def data_report(cfg: Config, text: ModelText | None, *, check_references: bool = False, show: int = 2) -> DataReport:
    """Everything `trustbatch data` prints (module docstring). DatasetError for a source that cannot be read."""
    from app.tooling import load_toolkit
    from app.training.setup import check_run_tasks, evaluation_sets, run_benchmarks

    kit = load_toolkit(cfg.tools)
    chat_tools = kit.chat_tools(cfg.rollout.tool_format) if kit is not None else None
    new_tokens = max(cfg.rollout.max_new_tokens, cfg.rollout.total_tokens if kit is not None else 0)
    budget = text.context - new_tokens if text is not None and text.context is not None else None
    reports, loaded = [], {"train": [], "eval": []}
    for split in ("train", "eval"):
        specs = cfg.data.sources(split)
        total = sum(s.weight for s in specs)
        for i, spec in enumerate(specs):
            key = f"data.{split}" if len(specs) == 1 else f"data.{split}[{i}]"
            rows = load_source(cfg.data, spec, split, "rl", key)
            loaded[split] += rows
            report = SourceReport(split, spec.label, spec.source, len(rows),
                                  spec.weight / total if split == "train" and len(specs) > 1 else None)  # fmt: skip
            if text is not None:
                ids = encode_rows(text.tokenizer, rows, chat_tools)
                lengths = [len(x) for x in ids]
                report.lengths = {f"p{q}": _percentile(lengths, q) for q in PERCENTILES} | {"max": max(lengths)}
                report.too_long = sum(n > budget for n in lengths) if budget is not None else 0
                report.examples = [text.tokenizer.decode(x) for x in ids[:show]]
            reports.append(report)
    check_run_tasks(cfg, loaded["train"] + loaded["eval"])  # a source no verifier serves stops here, as in train
    # The same evaluation sets as training checks (each data.eval source, each benchmark), loaded the same way.
    eval_sets = evaluation_sets(loaded["eval"][: cfg.eval.num_prompts], run_benchmarks(cfg))
    result = DataReport(reports, overlaps(loaded["train"], eval_sets), budget)
    if check_references:
        _check(cfg, loaded["train"] + loaded["eval"], result)
    return result


def _check(cfg: Config, rows: list[PromptRow], result: DataReport) -> None:
    from app.scoring import rewards_with_sandbox, score_texts
    from rewards.runner import RewardRunner

    chosen = [(row, ref) for row in rows if (ref := reference_text(row)) is not None]
    with RewardRunner(rewards_with_sandbox(cfg.rewards, cfg.sandbox)) as runner:
        scores, _ = score_texts(runner, [r for r, _ in chosen], [ref for _, ref in chosen])
    result.references_checked = len(chosen)
    for (row, _), score in zip(chosen, scores, strict=True):
        if not score.correct or score.error:
            why = score.error or ", ".join(f"{k}: {v}" for k, v in score.breakdown.items())[:200]
            result.reference_failures.append(f"{row.metadata.get('data_source')}: {row.id}: {why}")


def print_report(report: DataReport, console) -> None:
    from rich.table import Table

    table = Table(title="sources")
    for column in ("split", "source", "rows", "share", *(f"p{q}" for q in PERCENTILES), "max", "too long"):
        table.add_column(column, justify="left" if column in ("split", "source") else "right")
    for r in report.sources:
        table.add_row(r.split, f"{r.name} ({r.source})", str(r.rows), "-" if r.weight is None else f"{100 * r.weight:.0f}%",
                      *(str(r.lengths.get(f"p{q}", "-")) for q in PERCENTILES), str(r.lengths.get("max", "-")),
                      str(r.too_long))  # fmt: skip
    console.print(table)
    if report.budget is not None:
        console.print(f"prompt budget: {report.budget} tokens (the context less the completion budget); longer prompts "
                      "stop a run, or with data.on_long_prompt=drop are left out")  # fmt: skip
    console.print("decontamination (13-grams, normalised text):")
    for line in report.overlap.lines():
        console.print(f"  {line}")
    for r in report.sources:
        for i, example in enumerate(r.examples):
            console.print(f"[bold]{r.split} {r.name}, prompt {i + 1} as the model reads it:[/bold]")
            console.print(example, markup=False, highlight=False)
    if report.references_checked:
        failed = report.reference_failures
        console.print(f"references: {report.references_checked - len(failed)} of {report.references_checked} pass their "
                      "own verifiers")  # fmt: skip
        for line in failed[:20]:
            console.print(f"  FAILED {line}", markup=False)
        if len(failed) > 20:
            console.print(f"  ... and {len(failed) - 20} more")
