"""Built-in task `builtin:word_problems`: GSM8K-style multi-step word problems as chat rows.

Shopping, travel, sharing, savings, recipes, ages, inventory...: 1-4 operations, integer answers, irrelevant
distractor sentences (0-4 per problem). Each row carries its worked solution as `completion`, e.g. "3 × 5 = 15.
4 × 2 = 8. 15 + 8 = 23. \\boxed{23}", the reply `trustbatch sft` learns. A system message (WORD_PROBLEM_INSTRUCTION) asks for brief step-by-step reasoning and the
final answer in `\\boxed{}`, which the `math` verifier judges. The templates are a table in
word_problem_templates.py; this module draws problems from them.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass, field
from typing import Literal

from app.data.rows import WORD_PROBLEM_INSTRUCTION, WORD_PROBLEM_TOOL_INSTRUCTION, PromptRow
from app.data.tasks.arithmetic import split_of
from app.data.tasks.pools import draw_problems
from app.data.tasks.word_problem_templates import WORD_PROBLEM_TEMPLATES, Numbers, WordProblemTemplate

_MAX_DISTRACTORS = min(len(t.distractors) for t in WORD_PROBLEM_TEMPLATES.values())


@dataclass
class WordProblemsConfig:
    """Built-in task: multi-step arithmetic word problems in chat form (GSM8K style), answered in \\boxed{}."""

    templates: list[str] = field(default_factory=list)
    """Templates to draw from; empty = all: more, fewer, packs, share (1 operation), unit_price, work_rate (2),
    shopping, travel, sharing, savings, savings_goal, recipe, ages (3), shopping_change, travel_remaining,
    inventory (4)."""
    min_ops: int = 2
    """Only templates with at least this many operations (1-4)."""
    max_ops: int = 4
    """Only templates with at most this many operations (1-4)."""
    min_distractors: int = 1
    """Fewest irrelevant sentences (each with a number) in a problem."""
    max_distractors: int = 2
    """Most irrelevant sentences in a problem (at most 4); each problem draws its count in [min, max]."""
    seed: int = 0
    """Seed of the generator (which problems, their wording and distractors); the train/test assignment is a hash
    of each problem's template and numbers, so the splits never share a problem whatever the seed."""
    solutions: Literal["text", "tool", "tool_story", "tool_annotated"] = "text"
    """The reply each row teaches (`completion`) and the instruction it is asked with: text, the steps worked by
    hand ("3 × 5 = 15. ... \\boxed{23}"); tool, a Python program that prints the answer, its output block and the
    boxed answer (the fenced format of the python tool, docs/tools.md), under an instruction to use it: one line
    per operation over the stated numbers (``x = 3 * 5``); tool_story, the same transcript with a program that
    follows the story, a line or two per sentence that states a needed number, named after the story's words
    (``toy_cars = 12``, ``toy_cars = toy_cars + 5``, ``print(toy_cars)``), so a longer story is a longer program;
    tool_annotated, that program with every sentence of the problem (distractors and question too) copied above its
    code as a comment (``# Ava has 12 toy cars.``)."""

    def __post_init__(self) -> None:
        known = list(WORD_PROBLEM_TEMPLATES)
        bad = [t for t in self.templates if t not in WORD_PROBLEM_TEMPLATES]
        if bad or len(set(self.templates)) != len(self.templates):
            raise ValueError(
                f"data.word_problems.templates={list(self.templates)!r} must list distinct template names from "
                f"{known} (empty = all)" + (f"; unknown: {bad}" if bad else "")
            )
        for key in ("min_ops", "max_ops"):
            if not 1 <= getattr(self, key) <= 4:
                raise ValueError(
                    f"data.word_problems.{key}={getattr(self, key)} must be between 1 and 4 (the templates "
                    f"have 1 to 4 operations)"
                )
        if self.max_ops < self.min_ops:
            raise ValueError(
                f"data.word_problems.max_ops={self.max_ops} is below data.word_problems.min_ops={self.min_ops}; "
                f"set max_ops >= min_ops"
            )
        if self.solutions not in ("text", "tool", "tool_story", "tool_annotated"):
            raise ValueError(
                f"data.word_problems.solutions={self.solutions!r}: choose text, tool, tool_story or tool_annotated"
            )
        if self.min_distractors < 0:
            raise ValueError(f"data.word_problems.min_distractors={self.min_distractors} must be >= 0")
        if not self.min_distractors <= self.max_distractors <= _MAX_DISTRACTORS:
            raise ValueError(
                f"data.word_problems.max_distractors={self.max_distractors} must be between "
                f"data.word_problems.min_distractors={self.min_distractors} and {_MAX_DISTRACTORS}"
            )
        if not self.chosen():
            raise ValueError(
                f"no template of data.word_problems.templates={list(self.templates) or known} has "
                f"data.word_problems.min_ops={self.min_ops} to max_ops={self.max_ops} operations: widen the "
                f"range or add templates"
            )

    def chosen(self) -> list[WordProblemTemplate]:
        """The templates this config draws from, in WORD_PROBLEM_TEMPLATES order."""
        names = self.templates or list(WORD_PROBLEM_TEMPLATES)
        return [
            t
            for t in WORD_PROBLEM_TEMPLATES.values()
            if t.name in names and self.min_ops <= t.ops <= self.max_ops
        ]


def word_problem_key(template: str, numbers: Numbers) -> str:
    """A problem's canonical content, e.g. `shopping:a=2,p=3,b=4,q=5`: what the train/test split hashes."""
    return f"{template}:" + ",".join(f"{k}={v}" for k, v in numbers.items())


@functools.cache
def _word_problem_pool(
    template: str, split: Literal["train", "test"]
) -> tuple[tuple[tuple[str, int], ...], ...]:
    """The stated numbers of every problem of `template` in `split`, in enumeration order (seed-independent)."""
    spec = WORD_PROBLEM_TEMPLATES[template]
    pool = []
    for values in itertools.product(*spec.ranges.values()):
        params = dict(zip(spec.ranges, values, strict=True))
        if spec.valid(params):
            numbers = spec.numbers(params)
            if split_of(word_problem_key(template, numbers)) == split:
                pool.append(tuple(numbers.items()))
    return tuple(pool)


def word_problem_prompts(cfg: WordProblemsConfig, split: Literal["train", "test"], n: int) -> list[PromptRow]:
    """`n` distinct word problems of `split` as chat rows, deterministic from `cfg.seed`.

    Each row is a system message (WORD_PROBLEM_INSTRUCTION) and a user message with the problem; the answer is
    the integer as a string, the task `math`. Each problem draws its template uniformly among those with
    problems left, then one of that template's problems not yet drawn. A longer request extends a shorter one
    (the first n rows never depend on n). Raises ValueError when the split has fewer than n problems.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} must be 'train' or 'test'")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    templates = cfg.chosen()
    pools = [_word_problem_pool(t.name, split) for t in templates]
    if n > sum(len(pool) for pool in pools):
        both = sum(len(_word_problem_pool(t.name, s)) for t in templates for s in ("train", "test"))
        raise ValueError(
            f"{n} word problems requested but the {split} split has only {sum(len(p) for p in pools)} distinct "
            f"problems ({both} in both splits) of templates {[t.name for t in templates]} with "
            f"{cfg.min_ops} to {cfg.max_ops} operations; add data.word_problems.templates (empty = all) or widen "
            f"data.word_problems.min_ops / max_ops, or lower data.num_train / data.num_eval"
        )
    rng = random.Random(f"word_problems:{cfg.seed}:{split}")
    rows: list[PromptRow] = []
    for i, index in itertools.islice(draw_problems([len(pool) for pool in pools], rng), n):
        row_id = f"word_problems-{split}-{len(rows)}"
        rows.append(_word_problem_row(templates[i], dict(pools[i][index]), cfg, rng, row_id))
    return rows


def _word_problem_row(
    spec: WordProblemTemplate, numbers: Numbers, cfg: WordProblemsConfig, rng: random.Random, row_id: str
) -> PromptRow:
    story, question, words, values = spec.render(rng, numbers)
    shown: list[tuple[str, int | None]] = list(zip(story, range(len(story)), strict=True))  # None: a distractor
    count = rng.randint(cfg.min_distractors, cfg.max_distractors)
    for sentence in rng.sample(spec.distractors, count):  # after the first sentence, before the question
        shown.insert(rng.randint(1, len(shown)), (sentence.format(n=rng.randint(2, 40), **words), None))
    if cfg.solutions in ("tool_story", "tool_annotated"):
        answer = spec.solve(numbers)
        annotate = [*shown, (question, len(story))] if cfg.solutions == "tool_annotated" else None
        completion = spec.story_worked(values, answer, annotate)
    else:
        completion, answer = spec.tool_worked(numbers) if cfg.solutions == "tool" else spec.worked(numbers)
    instruction = WORD_PROBLEM_INSTRUCTION if cfg.solutions == "text" else WORD_PROBLEM_TOOL_INSTRUCTION
    return PromptRow(
        prompt=None,
        messages=[
            {"role": "system", "content": instruction},
            {"role": "user", "content": " ".join([*(text for text, _ in shown), question])},
        ],
        answer=str(answer),
        tests=None,
        task="math",
        id=row_id,
        metadata={
            "source": "builtin:word_problems",
            "template": spec.name,
            "num_ops": spec.ops,
            "distractors": count,
            "numbers": numbers,
        },
        completion=completion,
    )
