"""Decontamination: training rows that share a 13-gram with an evaluation prompt.

A row's text is its prompt, or its chat's non-system messages (a system instruction that every row of a task
shares would otherwise match everything), normalised: lower case, split into words (runs of letters and digits)
and the symbols that carry mathematical meaning (+ - * / = ^ < > % and brackets), everything else (punctuation,
spacing) dropped: "2+7=" and "2-7=" are different problems and stay different. Its n-grams are the 13-grams of
those tokens (a text of fewer than 13 is one n-gram, itself). A training row overlaps an evaluation set when one of its n-grams is one of the set's, as in the
decontamination reports of GPT-3 and of NeMo-Skills. `overlaps` counts them per training source and evaluation
set, and gives the indices of the rows that overlap any set, which ``data.decontaminate: drop`` leaves out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from app.data.rows import DatasetError, PromptRow

NGRAM = 13
_TOKEN = re.compile(r"[^\W_]+|[-+*/=^<>%()\[\]{}×÷−]")


def row_text(row: PromptRow) -> str:
    if row.prompt is not None:
        return row.prompt
    return "\n".join(str(m.get("content", "")) for m in row.messages or [] if m.get("role") != "system")


def ngrams(text: str, n: int = NGRAM) -> set[int]:
    """Hashes of the word n-grams of ``text`` after normalisation (module docstring); empty for an empty text."""
    words = _TOKEN.findall(text.lower())
    if not words:
        return set()
    if len(words) < n:
        return {hash(" ".join(words))}
    return {hash(" ".join(words[i : i + n])) for i in range(len(words) - n + 1)}


@dataclass
class Overlaps:
    """How many training rows of each source overlap each evaluation set, and which rows overlap any."""

    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    """(training source, evaluation set) -> training rows that share an n-gram with the set."""
    rows: set[int] = field(default_factory=set)
    """Indices (into the training rows) of the rows that overlap at least one set."""
    examples: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    """A few ids of the overlapping rows, per pair."""

    def lines(self) -> list[str]:
        if not self.counts:
            return ["no training row shares a 13-gram with an evaluation set"]
        return [
            f"{train}: {count} row(s) share a 13-gram with {evaluation} (e.g. {', '.join(self.examples[(train, evaluation)])})"
            for (train, evaluation), count in sorted(self.counts.items())
        ]


def overlaps(train: list[PromptRow], eval_sets: dict[str, list[PromptRow]], n: int = NGRAM) -> Overlaps:
    """The overlap of ``train`` (rows tagged with ``metadata.data_source``) with each named evaluation set."""
    found = Overlaps()
    grams = {name: set().union(*(ngrams(row_text(r), n) for r in rows)) if rows else set()
             for name, rows in eval_sets.items()}  # fmt: skip
    for i, row in enumerate(train):
        mine = ngrams(row_text(row), n)
        if not mine:
            continue
        for name, theirs in grams.items():
            if mine & theirs:
                key = (str(row.metadata.get("data_source", "data.train")), name)
                found.counts[key] = found.counts.get(key, 0) + 1
                shown = found.examples.setdefault(key, [])
                if len(shown) < 3:
                    shown.append(str(row.id))
                found.rows.add(i)
    return found


def decontaminate(
    train: list[PromptRow], eval_sets: dict[str, list[PromptRow]], mode: str
) -> tuple[list[PromptRow], Overlaps]:
    """``train`` checked against each evaluation set: the overlaps, and the training rows to use (all of them for
    ``mode="report"``, the ones that overlap no set left out for ``"drop"``); DatasetError when none are left."""
    found = overlaps(train, eval_sets)
    if mode != "drop" or not found.rows:
        return train, found
    kept = [row for i, row in enumerate(train) if i not in found.rows]
    if not kept:
        raise DatasetError(
            f"data.decontaminate=drop: every one of the {len(train)} training rows shares a 13-gram with "
            f"{sorted(eval_sets)}; train on other data, or set data.decontaminate=report"
        )
    return kept, found
