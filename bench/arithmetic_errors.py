"""Where a word-problem model goes wrong: accuracy per kind of operation, and every "a + b = c" it writes checked.

Reads the JSON that `trustbatch eval --out` writes (every prompt with its row metadata and completions) and
reports, per evaluation:
- accuracy per operation kind: add, sub, mul, div (one operation) and two_step (two); built-in rows map their
  template to a kind (more -> add, fewer -> sub, packs -> mul, share -> div, unit_price and work_rate ->
  two_step), rows of bench/new_wording.py carry theirs;
- every arithmetic statement in the completions, `a <op> b = c` with + - × * x ÷ /, checked against its own
  operands (c against a <op> b, whether or not a and b were the right numbers to use): right, off by ±1, off by
  ±10 and other, per operator;
- with two evaluations of the same prompts (`--before A --after B`), each kind's change in accuracy paired by
  problem, with its standard error.

    .venv/bin/python bench/arithmetic_errors.py --eval sft=sft.json rl=rl.json
    .venv/bin/python bench/arithmetic_errors.py --eval before=a.json after=b.json --pairs before:after --out t.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path

KIND_OF_TEMPLATE = {
    "more": "add", "fewer": "sub", "packs": "mul", "share": "div", "unit_price": "two_step", "work_rate": "two_step",
}
KINDS = ("add", "sub", "mul", "div", "two_step")
_OPERATOR = {"+": "+", "-": "-", "−": "-", "×": "*", "*": "*", "x": "*", "÷": "/", "/": "/"}
STATEMENT = re.compile(r"(?<!\d)(?<!\d\.)(\d+)\s*([+\-−×*x÷/])\s*(\d+)\s*=\s*(-?\d+)(?!\d)(?!\.\d)")
ERROR_CLASSES = ("right", "+1", "-1", "+10", "-10", "other")


def kind_of(prompt: dict) -> str:
    """The operation kind of one prompt of an eval JSON (its metadata's op, else its built-in template's)."""
    meta = prompt.get("metadata") or {}
    if "op" in meta:
        return meta["op"]
    if meta.get("template") in KIND_OF_TEMPLATE:
        return KIND_OF_TEMPLATE[meta["template"]]
    ops = meta.get("num_ops")
    return f"{ops}_ops" if ops else "other"


def statements(text: str) -> list[tuple[int, str, int, int]]:
    """Every `a <op> b = c` in a completion, as (a, op, b, c) with op one of + - * /."""
    return [(int(a), _OPERATOR[op], int(b), int(c)) for a, op, b, c in STATEMENT.findall(text)]


def error_class(a: int, op: str, b: int, c: int) -> str:
    if op == "/":
        if b == 0:
            return "other"
        if a % b:  # a non-integral quotient: right if the integer written is the rounded-down one, else other
            return "right" if c == a // b else "other"
        true = a // b
    else:
        true = {"+": a + b, "-": a - b, "*": a * b}[op]
    diff = c - true
    return {0: "right", 1: "+1", -1: "-1", 10: "+10", -10: "-10"}.get(diff, "other")


def load(path: Path) -> dict:
    data = json.loads(Path(path).read_text())
    if "prompts" not in data:
        raise SystemExit(f"{path}: not the JSON of `trustbatch eval --out` (no 'prompts')")
    return data


def analyse(data: dict) -> dict:
    """Accuracy per kind, the statement histogram per operator, and per-problem accuracies (for pairing)."""
    per_kind: dict[str, list[float]] = defaultdict(list)
    per_problem: dict[str, tuple[str, float]] = {}
    histogram: dict[str, Counter] = defaultdict(Counter)
    for prompt in data["prompts"]:
        kind = kind_of(prompt)
        completions = prompt["completions"]
        accuracy = sum(bool(c["correct"]) for c in completions) / max(len(completions), 1)
        per_kind[kind].append(accuracy)
        per_kind["all"].append(accuracy)
        per_problem[prompt["id"]] = (kind, accuracy)
        for completion in completions:
            for a, op, b, c in statements(completion["text"] or ""):
                histogram[op][error_class(a, op, b, c)] += 1
    return {
        "settings": data.get("settings"),
        "model": (data.get("model") or {}).get("ref"),
        "accuracy": {k: {"mean": mean(v), "se": se(v), "problems": len(v)} for k, v in per_kind.items()},
        "statements": {op: dict(counts) for op, counts in sorted(histogram.items())},
        "per_problem": per_problem,
    }


def paired(before: dict, after: dict) -> dict[str, dict]:
    """after - before per kind, paired by problem id (the problems both evaluated)."""
    diffs: dict[str, list[float]] = defaultdict(list)
    for pid, (kind, acc) in after["per_problem"].items():
        if pid in before["per_problem"]:
            d = acc - before["per_problem"][pid][1]
            diffs[kind].append(d)
            diffs["all"].append(d)
    return {k: {"mean": mean(v), "se": se(v), "problems": len(v)} for k, v in diffs.items()}


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def se(values: list[float]) -> float:
    n = len(values)
    if n < 2:
        return float("nan")
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n)


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{100 * x:.1f}"


def print_tables(results: dict[str, dict], pairs: list[tuple[str, str]]) -> None:
    kinds = [k for k in (*KINDS, "all") if any(k in r["accuracy"] for r in results.values())]
    print("accuracy (%) per operation kind, mean ± SE over problems")
    print(f"{'eval':<24}" + "".join(f"{k:>16}" for k in kinds))
    for label, r in results.items():
        cells = [r["accuracy"].get(k) for k in kinds]
        print(f"{label:<24}" + "".join(
            f"{_pct(c['mean']) + ' ± ' + _pct(c['se']):>16}" if c else f"{'-':>16}" for c in cells))
    for a, b in pairs:
        diff = paired(results[a], results[b])
        print(f"{b + ' - ' + a:<24}" + "".join(
            f"{_pct(diff[k]['mean']) + ' ± ' + _pct(diff[k]['se']):>16}" if k in diff else f"{'-':>16}"
            for k in kinds))
    print("\narithmetic statements 'a op b = c' written, checked against their own operands")
    print(f"{'eval':<24}{'op':>4}{'n':>7}" + "".join(f"{c:>8}" for c in ERROR_CLASSES) + f"{'off-by-10 %':>13}")
    for label, r in results.items():
        for op in ("+", "-", "*", "/"):
            counts = r["statements"].get(op, {})
            n = sum(counts.values())
            if not n:
                continue
            ten = counts.get("+10", 0) + counts.get("-10", 0)
            print(f"{label:<24}{op:>4}{n:>7}" + "".join(f"{counts.get(c, 0):>8}" for c in ERROR_CLASSES)
                  + f"{100 * ten / n:>12.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval", nargs="+", required=True, metavar="LABEL=PATH",
                        help="evaluations to analyse (the JSON of `trustbatch eval --out`)")
    parser.add_argument("--pairs", nargs="*", default=[], metavar="BEFORE:AFTER",
                        help="label pairs whose change per kind is reported, paired by problem")
    parser.add_argument("--out", type=Path, help="write every table as JSON here")
    args = parser.parse_args()
    results = {}
    for item in args.eval:
        label, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"--eval {item!r}: give LABEL=PATH")
        results[label] = analyse(load(Path(path)))
    pairs = []
    for item in args.pairs:
        a, sep, b = item.partition(":")
        if not sep or a not in results or b not in results:
            raise SystemExit(f"--pairs {item!r}: give BEFORE:AFTER, two labels of --eval")
        pairs.append((a, b))
    print_tables(results, pairs)
    if args.out:
        out = {label: {k: v for k, v in r.items() if k != "per_problem"} for label, r in results.items()}
        out["paired"] = {f"{b} - {a}": paired(results[a], results[b]) for a, b in pairs}
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
