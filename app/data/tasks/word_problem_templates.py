"""The builtin:word_problems templates as a table (WORD_PROBLEM_TEMPLATES): each entry states its numbers and
arithmetic, and its wording as format strings (story, question, distractors) over the numbers and word slots that
one function, `WordProblemTemplate.render`, fills in. Each also states its worked solution as steps such as
``"x = a * p"``, which `WordProblemTemplate.worked` writes out, e.g. "3 × 5 = 15. 4 × 2 = 8. 15 + 8 = 23.
\\boxed{23}": the reply supervised fine-tuning learns (`trustbatch sft`).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tools.formats import FencedFormat

Numbers = dict[str, int]


class _Wording(string.Formatter):
    """`str.format` plus pluralized units: `{t:hour}` -> "1 hour" / "3 hours", `{t:year}` -> "1 year" / "2 years";
    and `{goods:var}`, a word as a Python name: "toy cars" -> ``toy_cars``, "Ava" -> ``ava``."""

    UNITS = ("hour", "year")

    def format_field(self, value: Any, format_spec: str) -> str:
        if format_spec in self.UNITS:
            return f"{value} {format_spec}" if value == 1 else f"{value} {format_spec}s"
        if format_spec == "var":
            return re.sub(r"[^a-z0-9]+", "_", str(value).lower()).strip("_")
        return super().format_field(value, format_spec)


_WORDING = _Wording()
_SYMBOLS = {"+": "+", "-": "-", "*": "×", "/": "÷"}


def _fill(text: str, values: dict[str, Any]) -> str:
    """`text` with its blanks filled; plain `str.format` (faster) when it has no format spec such as `:hour`."""
    return _WORDING.vformat(text, (), values) if ":" in text else text.format_map(values)


@dataclass(frozen=True)
class Draw:
    """Word slots filled by one random draw from `options`.

    One option per problem (`rng.randrange`), unpacked over the slots when there are several, e.g.
    `Draw("machine product", (("printer", "posters"), ...))`; with `distinct`, a different option for each slot
    (`rng.sample`), e.g. `Draw("child cousin neighbour", NAMES, distinct=True)`.
    """

    slots: str
    """The slot names, separated by spaces."""
    options: tuple
    distinct: bool = False

    def __call__(self, rng: random.Random) -> dict[str, Any]:
        names = self.slots.split()
        if self.distinct:
            return dict(zip(names, rng.sample(self.options, len(names)), strict=True))
        value = self.options[rng.randrange(len(self.options))]
        return dict(zip(names, value, strict=True)) if len(names) > 1 else {names[0]: value}


@dataclass(frozen=True)
class WordProblemTemplate:
    """A family of word problems: the numbers that decide the answer, how they are worded, irrelevant facts.

    A problem's canonical content is the template name and its `numbers` (those the text states and the answer
    depends on); the train/test split is a hash of it. Numbers that play the same role (two purchases, two legs
    of a trip) are generated in increasing order and worded in either order, so a problem and its mirror image
    are one problem.
    """

    name: str
    ops: int
    """Arithmetic operations from the stated numbers to the answer."""
    ranges: dict[str, range]
    """Free parameters; every combination that `valid` accepts is one problem."""
    numbers: Callable[[Numbers], Numbers]
    """Parameters -> the numbers the problem states (derived ones, such as a total, keep answers integral)."""
    solve: Callable[[Numbers], int]
    """The stated numbers -> the answer, computed as a reader would."""
    story: tuple[str, ...]
    """The story's sentences, format strings over the stated numbers and the words; `{t:hour}` / `{t:year}` write
    "1 hour" / "3 hours" (see `_Wording`)."""
    question: str
    """The question, a format string like the story's sentences."""
    distractors: tuple[str, ...]
    """Facts irrelevant to the answer, each with one number `{n}` and blanks from the words."""
    words: tuple[Draw, ...] = ()
    """The word slots each problem draws, in this order (names, goods, vehicles...)."""
    fixed: dict[str, str] = field(default_factory=dict)
    """Word slots with one value (no draw)."""
    either_order: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    """Two groups of stated numbers worded in either order (the groups swap with probability 1/2), e.g.
    `(("v", "t1"), ("w", "t2"))`: two legs of a trip, each a speed and a time."""
    valid: Callable[[Numbers], bool] = lambda p: True
    """Which parameter combinations make a sensible problem (a positive answer, exact divisions)."""
    steps: tuple[str, ...] = ()
    """The worked solution, one operation per step: ``"name = left op right"`` with op one of + - * / and each
    operand a stated number or an earlier step; the last step is the answer. One step per operation (``ops``)."""
    program: tuple[str, ...] = ()
    """The solution as a program that follows the story (`story_worked`): the code of each story sentence (none,
    one line or two, ``\\n`` between them), in the story's order, naming what it computes after the story's own
    words (``{goods:var} = {a}``, then ``{goods:var} = {goods:var} + {b}``), and last the question's, a
    ``print(...)`` of the answer: format strings over the numbers as the story shows them and the words."""

    def __post_init__(self) -> None:
        if len(self.steps) != self.ops:
            raise ValueError(f"word problem template {self.name!r}: {len(self.steps)} steps for {self.ops} operations")
        if len(self.program) != len(self.story) + 1 or not self.program[-1].startswith("print("):
            raise ValueError(
                f"word problem template {self.name!r}: its program needs the code of each of its {len(self.story)} "
                f"story sentences, then the question's print(...)"
            )

    def worked(self, numbers: Numbers) -> tuple[str, int]:
        """The worked solution of a problem and its answer: each step as ``3 × 5 = 15.``, then ``\\boxed{answer}``.
        Raises ValueError on a division that is not exact (the template's `valid` should rule it out)."""
        values: dict[str, int] = dict(numbers)
        lines = []
        for step in self.steps:
            name, _, expression = step.partition(" = ")
            left, op, right = expression.split()
            a, b = values[left], values[right]
            if op == "/" and (b == 0 or a % b):
                raise ValueError(f"word problem template {self.name!r}: step {step!r} divides {a} by {b} inexactly")
            values[name] = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
            lines.append(f"{a} {_SYMBOLS[op]} {b} = {values[name]}.")
        answer = values[self.steps[-1].partition(" = ")[0]]
        return " ".join(lines) + f" \\boxed{{{answer}}}", answer

    def tool_worked(self, numbers: Numbers) -> tuple[str, int]:
        """The solution as a tool-use transcript (the fenced format, tools/formats.py): the steps as a Python
        program over the stated numbers, printing the last one, its output block, then ``\\boxed{answer}``::

            ```python
            x = 3 * 5
            y = 4 * 2
            print(x + y)
            ```
            ```output
            23
            ```
            \\boxed{23}
        """
        values: dict[str, int] = dict(numbers)
        computed: set[str] = set()
        lines = []
        for i, step in enumerate(self.steps):
            name, _, expression = step.partition(" = ")
            left, op, right = expression.split()
            a, b = values[left], values[right]
            if op == "/" and (b == 0 or a % b):
                raise ValueError(f"word problem template {self.name!r}: step {step!r} divides {a} by {b} inexactly")
            values[name] = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
            code = f"{left if left in computed else a} {'//' if op == '/' else op} {right if right in computed else b}"
            lines.append(f"print({code})" if i == len(self.steps) - 1 else f"{name} = {code}")
            computed.add(name)
        answer = values[self.steps[-1].partition(" = ")[0]]
        return _tool_transcript(lines, answer), answer

    def story_worked(
        self, values: dict[str, Any], answer: int, annotate: list[tuple[str, int | None]] | None = None
    ) -> str:
        """The solution as a tool-use transcript whose program follows the story (`program`), for the problem
        whose numbers as shown and words are `values` (what `render` returns); the output block and the boxed
        answer as in `tool_worked`::

            ```python
            toy_cars = 12
            toy_cars = toy_cars + 5
            print(toy_cars)
            ```
            ```output
            17
            ```
            \\boxed{17}

        With `annotate`, the problem's sentences in the order it shows them, each with its index in `story` (the
        question's: ``len(story)``; a distractor's: None), each sentence stands above its code as a comment
        (``# Ava has 12 toy cars.``), a distractor's above none."""
        code = [_fill(line, values) for line in self.program]
        if annotate is None:
            return _tool_transcript([c for c in code if c], answer)
        lines = []
        for text, i in annotate:
            lines.append(f"# {text}")
            if i is not None and code[i]:
                lines.append(code[i])
        return _tool_transcript(lines, answer)

    def render(
        self, rng: random.Random, numbers: Numbers
    ) -> tuple[list[str], str, dict[str, Any], dict[str, Any]]:
        """(rng, stated numbers) -> (story sentences, question, words for the distractors' blanks, the values the
        wording was filled with: the numbers as shown and the words, what `story_worked` needs).

        Draws the words (in `words` order), then the order of `either_order`, then fills in the wording."""
        words: dict[str, Any] = {}
        for draw in self.words:
            words.update(draw(rng))
        words.update(self.fixed)
        shown = dict(numbers)
        if self.either_order is not None and rng.random() >= 0.5:
            first, second = self.either_order
            shown.update(zip(first + second, [numbers[k] for k in second + first], strict=True))
        values = {**shown, **words}
        return [_fill(sentence, values) for sentence in self.story], _fill(self.question, values), words, values


def _tool_transcript(program: list[str], answer: int) -> str:
    """A tool-use transcript in the fenced format: the program's lines in a ```python block, the answer as the
    tool's output block, then ``\\boxed{answer}``."""
    fenced = FencedFormat()
    code = "\n".join(program)
    return f"```python\n{code}\n```{fenced.before}{answer}{fenced.after}\\boxed{{{answer}}}"


_NAMES = (
    "Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gabe", "Hana", "Ivan", "Jade",
    "Kofi", "Lena", "Mateo", "Nina", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara",
)  # fmt: skip
_NAME = Draw("name", _NAMES)
_GOODS = (
    "notebooks", "pens", "apples", "sandwiches", "candles", "toy cars", "bags of rice", "T-shirts",
)  # fmt: skip
_SHOPPING_DISTRACTORS = (
    "The shop is {n} minutes from {name}'s home.",
    "{name} has {n} cousins.",
    "The store opened {n} years ago.",
    "There are {n} people waiting at the checkout.",
)
_BUYS = "{name} buys {a} {first} for ${p} each and {b} {second} for ${q} each."
_TRAVEL_DISTRACTORS = (
    "The {vehicle} carries {n} passengers.",
    "The driver has {n} songs on a playlist.",
    "The {vehicle} has {n} seats by the windows.",
    "The ticket office has {n} posters on its walls.",
)
_LEGS = "at {v} km per hour for {t1:hour}, then at {w} km per hour for {t2:hour}."
_SAVINGS_DISTRACTORS = (
    "{name}'s best friend is {n} years old.",
    "{name} walks {n} minutes to school.",
    "The piggy bank weighs {n}0 grams.",
    "{name} reads {n} pages every evening.",
)


def _same(p: Numbers) -> Numbers:
    return dict(p)


def _cost(p: Numbers) -> int:
    return p["a"] * p["p"] + p["b"] * p["q"]


def _driven(p: Numbers) -> int:
    return p["v"] * p["t1"] + p["w"] * p["t2"]


WORD_PROBLEM_TEMPLATES: dict[str, WordProblemTemplate] = {
    t.name: t
    for t in (
        WordProblemTemplate(
            "more", 1, {"a": range(2, 41), "b": range(2, 41)}, steps=("z = a + b",),
            program=("{goods:var} = {a}", "{goods:var} = {goods:var} + {b}", "print({goods:var})"),
            numbers=_same, solve=lambda s: s["a"] + s["b"],
            words=(_NAME, Draw("goods", _GOODS)),
            story=("{name} has {a} {goods}.", "{name} buys {b} more {goods}."),
            question="How many {goods} does {name} have now?",
            distractors=_SHOPPING_DISTRACTORS,
        ),
        WordProblemTemplate(
            "fewer", 1, {"a": range(3, 61), "b": range(2, 41)}, steps=("z = a - b",),
            program=("{goods:var} = {a}", "{goods:var} = {goods:var} - {b}", "print({goods:var})"),
            numbers=_same, solve=lambda s: s["a"] - s["b"], valid=lambda p: p["a"] > p["b"],
            words=(_NAME, Draw("goods", _GOODS)),
            story=("{name} has {a} {goods}.", "{name} gives {b} of them to a friend."),
            question="How many {goods} does {name} have left?",
            distractors=_SHOPPING_DISTRACTORS,
        ),
        WordProblemTemplate(
            "packs", 1, {"packs": range(2, 13), "each": range(2, 13)}, steps=("z = packs * each",),
            program=("{goods:var} = {packs} * {each}", "print({goods:var})"),
            numbers=_same, solve=lambda s: s["packs"] * s["each"],
            words=(_NAME, Draw("goods", _GOODS)),
            story=("{name} buys {packs} packs of {goods} with {each} {goods} in each pack.",),
            question="How many {goods} does {name} buy?",
            distractors=_SHOPPING_DISTRACTORS,
        ),
        WordProblemTemplate(
            "share", 1, {"friends": range(2, 11), "each": range(2, 16)}, steps=("z = total / friends",),
            program=("each = {total} // {friends}", "print(each)"),
            numbers=lambda p: {"total": p["friends"] * p["each"], "friends": p["friends"]},
            solve=lambda s: s["total"] // s["friends"],
            words=(_NAME, Draw("goods", _GOODS)),
            story=("{name} shares {total} {goods} equally among {friends} friends.",),
            question="How many {goods} does each friend get?",
            distractors=_SHOPPING_DISTRACTORS,
        ),
        WordProblemTemplate(
            "unit_price", 2, {"n": range(2, 11), "unit": range(2, 26), "m": range(2, 16)},
            steps=("u = total / n", "x = u * m"),
            program=("price = {total} // {n}", "print(price * {m})"),
            numbers=lambda p: {"n": p["n"], "total": p["n"] * p["unit"], "m": p["m"]},
            solve=lambda s: s["total"] // s["n"] * s["m"], valid=lambda p: p["m"] != p["n"],
            words=(_NAME, Draw("packs", ("packs of stickers", "boxes of tea", "bottles of juice", "rolls of tape"))),
            story=("At a market, {n} {packs} cost ${total} in total.",),
            question="At the same price, how many dollars does {name} pay for {m} {packs}?",
            distractors=_SHOPPING_DISTRACTORS,
        ),
        WordProblemTemplate(
            "work_rate", 2, {"rate": range(3, 61), "hours": range(2, 11), "days": range(2, 8)},
            steps=("d = rate * hours", "x = d * days"),
            program=("per_hour = {rate}", "per_day = per_hour * {hours}", "print(per_day * {days})"),
            numbers=_same, solve=lambda s: s["rate"] * s["hours"] * s["days"],
            words=(Draw("machine product", (("machine", "toys"), ("printer", "posters"), ("bakery oven", "loaves"))),),
            story=("A {machine} makes {rate} {product} per hour.", "It runs for {hours:hour} each day."),
            question="How many {product} does the {machine} make in {days} days?",
            distractors=(
                "The {machine} has {n} buttons.",
                "The factory has {n} windows.",
                "The {machine} weighs {n}0 kg.",
                "The workers take a break of {n} minutes.",
            ),
        ),
        WordProblemTemplate(
            "shopping", 3, {"a": range(2, 10), "p": range(2, 16), "b": range(2, 10), "q": range(2, 16)},
            steps=("x = a * p", "y = b * q", "z = x + y"),
            program=(
                "{first:var} = {a} * {p}\n{second:var} = {b} * {q}",
                "print({first:var} + {second:var})",
            ),
            numbers=_same, solve=_cost, valid=lambda p: (p["a"], p["p"]) < (p["b"], p["q"]),
            words=(_NAME, Draw("first second", _GOODS, distinct=True)), either_order=(("a", "p"), ("b", "q")),
            story=(_BUYS,), question="How many dollars does {name} spend in total?",
            distractors=_SHOPPING_DISTRACTORS,
        ),
        WordProblemTemplate(
            "shopping_change", 4,
            {"a": range(2, 7), "p": range(2, 13), "b": range(2, 7), "q": range(2, 13), "paid": range(20, 101, 10)},
            steps=("x = a * p", "y = b * q", "c = x + y", "z = paid - c"),
            program=(
                "{first:var} = {a} * {p}\n{second:var} = {b} * {q}",
                "change = {paid} - {first:var} - {second:var}",
                "print(change)",
            ),
            numbers=_same, solve=lambda s: s["paid"] - _cost(s),
            valid=lambda p: (p["a"], p["p"]) < (p["b"], p["q"]) and _cost(p) < p["paid"],
            words=(_NAME, Draw("first second", _GOODS, distinct=True)), either_order=(("a", "p"), ("b", "q")),
            story=(_BUYS, "{name} pays with ${paid}."), question="How many dollars of change does {name} get back?",
            distractors=_SHOPPING_DISTRACTORS,
        ),
        WordProblemTemplate(
            "travel", 3, {"v": range(30, 91, 5), "t1": range(1, 7), "w": range(30, 91, 5), "t2": range(1, 7)},
            steps=("x = v * t1", "y = w * t2", "z = x + y"),
            program=("first = {v} * {t1}\nthen = {w} * {t2}", "print(first + then)"),
            numbers=_same, solve=_driven, valid=lambda p: p["v"] < p["w"],
            words=(Draw("vehicle", ("train", "bus", "truck", "ferry")),), either_order=(("v", "t1"), ("w", "t2")),
            story=("A {vehicle} travels " + _LEGS,), question="How many kilometres does the {vehicle} travel in all?",
            distractors=_TRAVEL_DISTRACTORS,
        ),
        WordProblemTemplate(
            "travel_remaining", 4,
            {
                "v": range(40, 81, 10), "t1": range(1, 6), "w": range(40, 81, 10), "t2": range(1, 6),
                "left": range(15, 196, 15),
            },
            steps=("x = v * t1", "y = w * t2", "d = x + y", "z = distance - d"),
            program=("km = {distance}", "first = {v} * {t1}\nthen = {w} * {t2}", "print(km - first - then)"),
            numbers=lambda p: {"distance": _driven(p) + p["left"], **{k: p[k] for k in ("v", "t1", "w", "t2")}},
            solve=lambda s: s["distance"] - _driven(s), valid=lambda p: p["v"] < p["w"],
            words=(_NAME,), fixed={"vehicle": "car"}, either_order=(("v", "t1"), ("w", "t2")),
            story=("{name} is driving to a city {distance} km away.", "{name} drives " + _LEGS),
            question="How many kilometres does {name} still have to drive?",
            distractors=_TRAVEL_DISTRACTORS,
        ),
        WordProblemTemplate(
            "sharing", 3,
            {"trays": range(2, 10), "per_tray": range(4, 16), "kept": range(1, 21), "friends": range(2, 10)},
            steps=("t = trays * per_tray", "r = t - kept", "z = r / friends"),
            program=(
                "{food:var} = {trays} * {per_tray}",
                "{food:var} = {food:var} - {kept}\neach = {food:var} // {friends}",
                "print(each)",
            ),
            numbers=_same, solve=lambda s: (s["trays"] * s["per_tray"] - s["kept"]) // s["friends"],
            valid=lambda p: (
                p["trays"] * p["per_tray"] > p["kept"] and (p["trays"] * p["per_tray"] - p["kept"]) % p["friends"] == 0
            ),
            words=(_NAME, Draw("food", ("muffins", "cookies", "buns", "brownies"))),
            story=(
                "{name} bakes {trays} trays of {food} with {per_tray} {food} on each tray.",
                "{name} keeps {kept} {food} and shares the rest equally among {friends} friends.",
            ),
            question="How many {food} does each friend get?",
            distractors=(
                "{name} owns {n} recipe cards.",
                "{name} has lived on the same street for {n} years.",
                "Each tray is {n} centimetres wide.",
                "{name}'s kitchen has {n} drawers.",
            ),
        ),
        WordProblemTemplate(
            "savings", 3,
            {"start": range(10, 101, 10), "weekly": range(3, 21), "weeks": range(2, 13), "spent": range(10, 81, 10)},
            steps=("s = weekly * weeks", "h = start + s", "z = h - spent"),
            program=(
                "dollars = {start}",
                "",
                "dollars = dollars + {weekly} * {weeks}\ndollars = dollars - {spent}",
                "print(dollars)",
            ),
            numbers=_same, solve=lambda s: s["start"] + s["weekly"] * s["weeks"] - s["spent"],
            valid=lambda p: p["start"] + p["weekly"] * p["weeks"] > p["spent"],
            words=(_NAME, Draw("item", ("book", "kite", "board game", "scarf"))),
            story=(
                "{name} has ${start} in a piggy bank.",
                "Every week {name} saves ${weekly} more.",
                "After {weeks} weeks, {name} spends ${spent} on a {item}.",
            ),
            question="How many dollars does {name} have left?",
            distractors=_SAVINGS_DISTRACTORS,
        ),
        WordProblemTemplate(
            "savings_goal", 3,
            {"start": range(5, 51, 5), "gift": range(5, 41, 5), "weekly": range(2, 16), "weeks": range(2, 13)},
            steps=("h = start + gift", "r = price - h", "z = r / weekly"),
            program=("price = {price}", "price = price - {start} - {gift}", "", "print(price // {weekly})"),
            numbers=lambda p: {
                "price": p["start"] + p["gift"] + p["weekly"] * p["weeks"],
                **{k: p[k] for k in ("start", "gift", "weekly")},
            },
            solve=lambda s: (s["price"] - s["start"] - s["gift"]) // s["weekly"],
            words=(_NAME, Draw("item", ("bicycle", "guitar", "tent", "telescope"))),
            story=(
                "{name} wants a {item} that costs ${price}.",
                "{name} already has ${start} and gets ${gift} as a birthday gift.",
                "{name} saves ${weekly} every week.",
            ),
            question="How many weeks of saving does {name} need to have exactly enough?",
            distractors=_SAVINGS_DISTRACTORS,
        ),
        WordProblemTemplate(
            "recipe", 3,
            {"serves": range(2, 7), "per_person": range(10, 61, 5), "guests": range(2, 13), "has": range(10, 201, 10)},
            steps=("g = grams / serves", "t = g * guests", "z = t - has"),
            program=(
                "per_person = {grams} // {serves}",
                "needed = per_person * {guests} - {has}",
                "print(needed)",
            ),
            numbers=lambda p: {
                "serves": p["serves"], "grams": p["serves"] * p["per_person"], "guests": p["guests"], "has": p["has"],
            },
            solve=lambda s: s["grams"] // s["serves"] * s["guests"] - s["has"],
            valid=lambda p: p["guests"] != p["serves"] and p["per_person"] * p["guests"] > p["has"],
            words=(_NAME, Draw("ingredient", ("flour", "sugar", "butter", "rice"))),
            story=(
                "A recipe for {serves} people uses {grams} grams of {ingredient}.",
                "{name} wants to make it for {guests} people and already has {has} grams of {ingredient}.",
            ),
            question="How many more grams of {ingredient} does {name} need?",
            distractors=(
                "The dish bakes for {n} minutes.",
                "{name} bought {n} eggs last week.",
                "The recipe book has {n} pages.",
                "{name}'s kitchen has {n} spoons.",
            ),
        ),
        WordProblemTemplate(
            "ages", 3, {"age": range(3, 17), "older": range(1, 10), "times": range(2, 6), "later": range(1, 21)},
            steps=("c = age + older", "o = times * c", "z = o + later"),
            program=(
                "{child:var} = {age}",
                "{cousin:var} = {child:var} + {older}",
                "{neighbour:var} = {times} * {cousin:var}",
                "print({neighbour:var} + {later})",
            ),
            numbers=_same, solve=lambda s: s["times"] * (s["age"] + s["older"]) + s["later"],
            valid=lambda p: 20 <= p["times"] * (p["age"] + p["older"]) <= 80,
            words=(Draw("child cousin neighbour", _NAMES, distinct=True),),
            story=(
                "{child} is {age} years old.",
                "{child}'s cousin {cousin} is {older:year} older.",
                "Their neighbour {neighbour} is {times} times as old as {cousin}.",
            ),
            question="How old will {neighbour} be in {later:year}?",
            distractors=(
                "{child} has {n} marbles.",
                "{neighbour} lives {n} km away.",
                "The family dog weighs {n} kg.",
                "{neighbour} has {n} houseplants.",
            ),
        ),
        WordProblemTemplate(
            "inventory", 4,
            {
                "boxes": range(3, 13), "per_box": range(6, 25, 2), "sold1": range(4, 37, 4), "sold2": range(4, 37, 4),
                "delivered": range(10, 51, 10),
            },
            steps=("t = boxes * per_box", "a = t - sold1", "b = a - sold2", "z = b + delivered"),
            program=(
                "{goods:var} = {boxes} * {per_box}",
                "{goods:var} = {goods:var} - {sold1} - {sold2}",
                "{goods:var} = {goods:var} + {delivered}",
                "print({goods:var})",
            ),
            numbers=_same, solve=lambda s: s["boxes"] * s["per_box"] - s["sold1"] - s["sold2"] + s["delivered"],
            valid=lambda p: p["sold1"] < p["sold2"] and p["boxes"] * p["per_box"] > p["sold1"] + p["sold2"],
            words=(Draw("goods", ("pencils", "lemons", "batteries", "soaps")),), either_order=(("sold1",), ("sold2",)),
            story=(
                "A shop has {boxes} boxes of {goods} with {per_box} {goods} in each box.",
                "It sells {sold1} {goods} on Monday and {sold2} {goods} on Tuesday.",
                "Then a delivery brings {delivered} more {goods}.",
            ),
            question="How many {goods} does the shop have now?",
            distractors=(
                "The shop has {n} employees.",
                "The shop is open {n} hours on Sundays.",
                "Each box of {goods} is {n} cm long.",
                "The delivery truck drove {n} km.",
            ),
        ),
    )
}  # fmt: skip
"""Every builtin:word_problems template by name."""
