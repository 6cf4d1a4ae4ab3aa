"""Word problems in wording that builtin:word_problems never uses: an evaluation set, never trained on.

The built-in templates (app/data/tasks/word_problem_templates.py) word every problem of a kind the same way
("{name} has {a} {goods}. {name} buys {b} more {goods}."), so a held-out problem of the test split differs
from the training problems only in its numbers and names. These problems were written apart from those
templates, with other stories, other sentence shapes and other quantities, to measure what a model learnt
beyond the templates' phrasing. Each kind of problem has several wordings; each row names its operations:

    add, sub, mul, div      one operation
    two_step                two: a + b - c, a - b + c, a * b + c, c - a * b, a + b + c, (a + b) / c

Rows are in the row schema (app/data/rows.py) with the system message of builtin:word_problems, so the model
is asked exactly as in training; `metadata` holds the kind, the expression and each step's operands and result
(what bench/arithmetic_errors.py checks the model's own "a + b = c" lines against).

    .venv/bin/python bench/new_wording.py                 # writes bench/data/word_problems_new_wording.jsonl
    .venv/bin/python bench/new_wording.py --tool          # the same problems under the python tool's instruction
    .venv/bin/trustbatch eval MODEL --data bench/data/word_problems_new_wording.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.data.rows import WORD_PROBLEM_INSTRUCTION, WORD_PROBLEM_TOOL_INSTRUCTION  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
DEFAULT_OUT = DATA / "word_problems_new_wording.jsonl"
TOOL_OUT = DATA / "word_problems_new_wording_tool.jsonl"
COUNTS = {"add": 50, "sub": 50, "mul": 40, "div": 40, "two_step": 60}


@dataclass(frozen=True)
class Kind:
    """One wording: its text over the numbers, how the numbers are drawn, and the steps from them to the answer."""

    op: str
    text: str
    draw: Callable[[random.Random], dict[str, int]]
    steps: tuple[str, ...]
    """Each step ``"x = a + b"`` over the numbers and earlier results; the last step's result is the answer."""


def _add(rng: random.Random) -> dict[str, int]:
    return {"a": rng.randint(11, 59), "b": rng.randint(11, 59)}


def _sub(rng: random.Random) -> dict[str, int]:
    a = rng.randint(21, 99)
    return {"a": a, "b": rng.randint(11, a - 2)}


def _mul(rng: random.Random) -> dict[str, int]:
    return {"a": rng.randint(3, 12), "b": rng.randint(3, 15)}


def _div(rng: random.Random) -> dict[str, int]:
    k, q = rng.randint(2, 9), rng.randint(3, 15)
    return {"total": k * q, "k": k}


def _plus_minus(rng: random.Random) -> dict[str, int]:
    a, b = rng.randint(11, 60), rng.randint(11, 40)
    return {"a": a, "b": b, "c": rng.randint(5, a + b - 5)}


def _minus_plus(rng: random.Random) -> dict[str, int]:
    a = rng.randint(25, 70)
    return {"a": a, "b": rng.randint(5, a - 10), "c": rng.randint(5, 30)}


def _times_plus(rng: random.Random) -> dict[str, int]:
    return {"a": rng.randint(2, 9), "b": rng.randint(3, 12), "c": rng.randint(2, 20)}


def _budget(rng: random.Random) -> dict[str, int]:
    a, b = rng.randint(2, 6), rng.randint(3, 9)
    return {"a": a, "b": b, "c": a * b + rng.randint(2, 30)}


def _three(rng: random.Random) -> dict[str, int]:
    return {"a": rng.randint(5, 40), "b": rng.randint(5, 40), "c": rng.randint(5, 40)}


def _pooled(rng: random.Random) -> dict[str, int]:
    c, q = rng.randint(2, 6), rng.randint(3, 12)
    a = rng.randint(1, c * q - 1)
    return {"a": a, "b": c * q - a, "c": c}


KINDS: tuple[Kind, ...] = (
    # one addition
    Kind("add", "A library shelf holds {a} novels and {b} biographies. How many books are on the shelf?", _add,
         ("z = a + b",)),
    Kind("add", "On Monday a bakery sold {a} muffins, and on Tuesday it sold {b}. How many muffins did it sell "
                "over the two days?", _add, ("z = a + b",)),
    Kind("add", "A train is carrying {a} passengers. At the next station, {b} more people get on and nobody gets "
                "off. How many passengers are on the train now?", _add, ("z = a + b",)),
    Kind("add", "Maya scored {a} points in the first game and {b} points in the second game. What is her total "
                "score?", _add, ("z = a + b",)),
    Kind("add", "The morning temperature was {a} degrees, and by the afternoon it had climbed {b} degrees higher. "
                "What was the afternoon temperature?", _add, ("z = a + b",)),
    # one subtraction
    Kind("sub", "A parking lot had {a} cars in it. Then {b} cars drove away. How many cars are still in the "
                "lot?", _sub, ("z = a - b",)),
    Kind("sub", "A book has {a} pages. Leo has already read {b} pages. How many pages does he still have to "
                "read?", _sub, ("z = a - b",)),
    Kind("sub", "There are {a} students in the hall, and {b} of them are boys. How many girls are in the hall?",
         _sub, ("z = a - b",)),
    Kind("sub", "A rope is {a} centimetres long. A piece {b} centimetres long is cut off. How long is the rest of "
                "the rope?", _sub, ("z = a - b",)),
    Kind("sub", "Grandpa is {a} years old, and Aunt Rosa is {b} years younger than him. How old is Aunt Rosa?",
         _sub, ("z = a - b",)),
    # one multiplication
    Kind("mul", "A theater has {a} rows with {b} seats in every row. How many seats does the theater have?",
         _mul, ("z = a * b",)),
    Kind("mul", "One bus ticket costs {b} dollars. What do {a} tickets cost?", _mul, ("z = a * b",)),
    Kind("mul", "A garden has {a} flower beds, and each bed holds {b} tulips. How many tulips grow in the "
                "garden?", _mul, ("z = a * b",)),
    Kind("mul", "Nina walks {b} kilometres every day. How far does she walk in {a} days?", _mul, ("z = a * b",)),
    # one division
    Kind("div", "{total} stickers are split evenly among {k} albums. How many stickers go into each album?",
         _div, ("z = total / k",)),
    Kind("div", "A ribbon {total} centimetres long is cut into {k} pieces of equal length. How long is each "
                "piece?", _div, ("z = total / k",)),
    Kind("div", "A coach divides {total} players into {k} teams of the same size. How many players are on each "
                "team?", _div, ("z = total / k",)),
    Kind("div", "{k} identical notebooks cost {total} dollars altogether. What is the price of one notebook?",
         _div, ("z = total / k",)),
    # two operations
    Kind("two_step", "A jar held {a} marbles. Kim put in {b} more marbles and then took out {c}. How many marbles "
                     "are in the jar now?", _plus_minus, ("x = a + b", "z = x - c")),
    Kind("two_step", "A bus left the depot with {a} riders. At the first stop {b} riders got off and {c} got on. "
                     "How many riders are on the bus now?", _minus_plus, ("x = a - b", "z = x + c")),
    Kind("two_step", "Pens cost {b} dollars each. Omar buys {a} pens and one notebook for {c} dollars. How many "
                     "dollars does he spend?", _times_plus, ("x = a * b", "z = x + c")),
    Kind("two_step", "Lena had {c} dollars. She bought {a} sandwiches that cost {b} dollars each. How many dollars "
                     "does she have left?", _budget, ("x = a * b", "z = c - x")),
    Kind("two_step", "Three friends collected shells on the beach: Ana found {a}, Ben found {b} and Cleo found "
                     "{c}. How many shells did they find together?", _three, ("x = a + b", "z = x + c")),
    Kind("two_step", "A basket holds {a} red apples and {b} green apples. The apples are shared equally among {c} "
                     "children. How many apples does each child get?", _pooled, ("x = a + b", "z = x / c")),
)

_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a // b,
}


def solve(steps: tuple[str, ...], numbers: dict[str, int]) -> list[dict]:
    """Each step with its operands and result, e.g. {"left": 23, "op": "+", "right": 40, "result": 63}."""
    values, out = dict(numbers), []
    for step in steps:
        target, expression = (s.strip() for s in step.split("="))
        left, op, right = expression.split()
        a, b = values[left], values[right]
        if op == "/" and a % b:
            raise AssertionError(f"{step} over {numbers} is not a whole number")
        values[target] = _OPS[op](a, b)
        out.append({"left": a, "op": op, "right": b, "result": values[target]})
    return out


def problems(seed: int = 0, instruction: str = WORD_PROBLEM_INSTRUCTION, counts: dict[str, int] = COUNTS) -> list[dict]:
    """The evaluation rows: `counts[op]` distinct problems per kind of operation, wordings in turn, each asked under
    `instruction` (the system message)."""
    rng = random.Random(f"new_wording:{seed}")
    rows: list[dict] = []
    for op, count in counts.items():
        kinds = [k for k in KINDS if k.op == op]
        seen: set[tuple] = set()
        while len(seen) < count:
            kind = kinds[len(seen) % len(kinds)]
            numbers = kind.draw(rng)
            key = (kind.text, tuple(sorted(numbers.items())))
            if key in seen:
                continue
            seen.add(key)
            steps = solve(kind.steps, numbers)
            if any(s["result"] <= 0 for s in steps):
                raise AssertionError(f"{kind.text} over {numbers}: a step is not positive")
            rows.append({
                "messages": [
                    {"role": "system", "content": instruction},
                    {"role": "user", "content": kind.text.format(**numbers)},
                ],
                "answer": str(steps[-1]["result"]),
                "task": "math",
                "id": f"new_wording-{op}-{len(seen) - 1}",
                "metadata": {"source": "new_wording", "op": op, "steps": steps, "wording": KINDS.index(kind)},
            })
    return rows


def jsonl(rows: list[dict]) -> str:
    """The rows as the committed files hold them: one JSON object per line."""
    return "".join(json.dumps(row) + "\n" for row in rows)


def write_set(doc: str, default_out: Path, tool_out: Path, build: Callable[[int, bool], list[dict]]) -> list[dict]:
    """The command line of an evaluation-set script (--out, --seed, --tool): build(seed, tool) written as JSONL
    to --out (default: `default_out`, or `tool_out` with --tool); returns the rows."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help=f"default {default_out}, or with --tool {tool_out}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool", action="store_true",
                        help="ask under the python tool's instruction (builtin:word_problems with solutions: tool)")
    args = parser.parse_args()
    out = args.out or (tool_out if args.tool else default_out)
    rows = build(args.seed, args.tool)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(jsonl(rows))
    print(f"{len(rows)} problems -> {out}")
    return rows


def main() -> None:
    rows = write_set(__doc__, DEFAULT_OUT, TOOL_OUT, lambda seed, tool: problems(
        seed, WORD_PROBLEM_TOOL_INSTRUCTION if tool else WORD_PROBLEM_INSTRUCTION))
    counts = {op: sum(row["metadata"]["op"] == op for row in rows) for op in COUNTS}
    print("  " + ", ".join(f"{n} {op}" for op, n in counts.items()))


if __name__ == "__main__":
    main()
