"""The tool pipeline against the text-only one on SmolLM2 word problems (issue 37): accuracy per evaluation set,
differences paired by problem, transcripts side by side, and accuracy against wall time.

Reads the JSON that `trustbatch eval --out` writes (every prompt with its completions). Each `--eval` names an
evaluation as SET:LABEL=PATH (e.g. `newword:tools=nw-tools.json`); the table gives each label's accuracy on each
set (the mean over problems of the fraction of a problem's samples judged right, ± its SE over problems), and each
`--pairs A:B` the difference A − B paired by problem on every set both evaluated. With several seeds of a label
(`--eval newword:tools#1=...`, `#2`, ...), the label's row is the mean over seeds ± the across-seed SE, and pairs
are taken seed by seed and then averaged (across-seed SE).

`--transcripts A=PATH B=PATH --n 20 [--stride K]` prints the first completions of n problems (every K-th) of two
evaluations of the same set side by side (e.g. before and after RL), with what each boxed and what the program
printed; `--audit LABEL=PATH ...` counts, over every sample, programs per answer, answers with several calls,
boxed numbers other than the last output, and right answers that copy a number of the problem with no program.

`--plot OUT.png --curve NAME=SECONDS:PATH,SECONDS:PATH,...` draws accuracy against wall time: one line per
pipeline, a point per stage (the base model at 0 s, then after SFT, then after RL).

    .venv/bin/python bench/tool_pipeline.py \\
        --eval newword:text=text-nw.json newword:tools=tools-nw.json --pairs tools:text
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.arithmetic_errors import mean, se  # noqa: E402


def per_problem(path: Path) -> dict[str, float]:
    """Problem id -> fraction of its samples judged right."""
    data = json.loads(Path(path).read_text())
    return {p["id"]: p["correct"] / p["samples"] for p in data["prompts"] if p["samples"]}


def split_label(label: str) -> tuple[str, str]:
    """`tools#2` -> (`tools`, `2`); `tools` -> (`tools`, ``)."""
    name, _, seed = label.partition("#")
    return name, seed


def summarise(evals: dict[str, dict[str, dict[str, float]]], pairs: list[tuple[str, str]]) -> dict:
    """{set: {"accuracy": {label: (mean, se, seeds)}, "pairs": {A-B: (mean, se, seeds or problems)}}}."""
    out: dict[str, dict] = {}
    for set_name, runs in evals.items():
        by_label: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
        for label, problems in runs.items():
            name, seed = split_label(label)
            by_label[name][seed] = problems
        accuracy = {}
        for name, seeds in by_label.items():
            if len(seeds) == 1:
                (problems,) = seeds.values()
                accuracy[name] = (mean(list(problems.values())), se(list(problems.values())), 1)
            else:
                means = [mean(list(p.values())) for p in seeds.values()]
                accuracy[name] = (mean(means), se(means), len(means))
        paired = {}
        for a, b in pairs:
            if a not in by_label or b not in by_label:
                continue
            common_seeds = sorted(set(by_label[a]) & set(by_label[b]))
            if common_seeds and common_seeds != [""]:  # seed by seed, then across seeds
                seed_means = [mean(_differences(by_label[a][s], by_label[b][s])) for s in common_seeds]
                paired[f"{a} - {b}"] = (mean(seed_means), se(seed_means), len(seed_means))
            else:  # one run each: over problems
                diffs = _differences(next(iter(by_label[a].values())), next(iter(by_label[b].values())))
                paired[f"{a} - {b}"] = (mean(diffs), se(diffs), len(diffs))
        out[set_name] = {"accuracy": accuracy, "pairs": paired}
    return out


def _differences(a: dict[str, float], b: dict[str, float]) -> list[float]:
    """a − b for every problem both evaluated."""
    return [a[i] - b[i] for i in a if i in b]


def pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{100 * x:.1f}"


def print_table(summary: dict) -> None:
    sets = list(summary)
    labels = list(dict.fromkeys(name for s in sets for name in summary[s]["accuracy"]))
    pair_names = list(dict.fromkeys(name for s in sets for name in summary[s]["pairs"]))
    print("| | " + " | ".join(sets) + " |")
    print("|---" * (len(sets) + 1) + "|")
    for name in labels + pair_names:
        cells = []
        for s in sets:
            row = summary[s]["accuracy"].get(name) or summary[s]["pairs"].get(name)
            cells.append("" if row is None else f"{pct(row[0])} ± {pct(row[1])}" + (
                f" ({row[2]} seeds)" if name in summary[s]["accuracy"] and row[2] > 1 else ""))
        print(f"| {name} | " + " | ".join(cells) + " |")


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_OUTPUT = re.compile(r"```output\n(.*?)```", re.S)
_PROGRAM = re.compile(r"```python\n(.*?)```", re.S)


def question(prompt: dict) -> str:
    """The problem as the model read it: the last message, or the plain prompt."""
    return prompt["messages"][-1]["content"] if prompt.get("messages") else prompt.get("prompt", "")


def pieces(completion: dict) -> tuple[str, list[str], list[str], list[str]]:
    """(transcript, programs, outputs, boxed answers) of one completion, the last three stripped, in order."""
    transcript = completion.get("transcript") or completion.get("text", "")
    return transcript, *([x.strip() for x in pattern.findall(transcript)] for pattern in (_PROGRAM, _OUTPUT, _BOXED))


def describe(completion: dict) -> str:
    """One completion as `program -> output -> boxed (right|wrong)`, or its text when it wrote no program."""
    transcript, programs, outputs, boxed = pieces(completion)
    programs = [p.replace("\n", "; ") for p in programs]
    verdict = "right" if completion.get("correct") else "wrong"
    if not programs:
        return f"(no program) {transcript[:160]!r} [{verdict}]"
    padded = (outputs + [None] * len(programs))[: len(programs)]
    parts = [f"`{p}` → {o!r}" for p, o in zip(programs, padded, strict=True)]
    return " ; ".join(parts) + f" → boxed {boxed[-1] if boxed else None} [{verdict}]"


def audit(path: Path) -> dict[str, float]:
    """What a tool model's completions do, over every sample of an evaluation: programs per answer, answers with
    more than one call (loops), answers whose boxed number is not what the last program printed, and right
    answers that box a number copied from the problem with no program run (a reward that costs nothing)."""
    counts = defaultdict(int)
    for prompt in json.loads(Path(path).read_text())["prompts"]:
        stated = set(re.findall(r"\d+", question(prompt)))
        for completion in prompt["completions"]:
            _, programs, outputs, boxed = pieces(completion)
            counts["answers"] += 1
            counts["programs"] += len(programs)
            counts["several calls"] += len(programs) > 1
            counts["no program"] += not programs
            counts["boxed other than printed"] += bool(boxed and outputs and boxed[-1] != outputs[-1])
            counts["right, copied, no program"] += bool(completion.get("correct") and not programs and boxed
                                                        and boxed[-1] in stated)
            counts["right"] += bool(completion.get("correct"))
    n = counts.pop("answers")
    return {"answers": n, **{k: v / n for k, v in counts.items()}}


def print_transcripts(before: Path, after: Path, n: int, stride: int = 1) -> None:
    a, b = (json.loads(Path(p).read_text())["prompts"] for p in (before, after))
    b_by_id = {p["id"]: p for p in b}
    for prompt in a[::stride][:n]:
        other = b_by_id.get(prompt["id"])
        if other is None:
            continue
        print(f"- *{question(prompt)}* (answer {prompt['answer']})")
        print(f"  - before: {describe(prompt['completions'][0])}")
        print(f"  - after:  {describe(other['completions'][0])}")


def plot(out: Path, curves: dict[str, list[tuple[float, float]]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, points in curves.items():
        xs, ys = zip(*points, strict=True)
        ax.plot([x / 60 for x in xs], [100 * y for y in ys], marker="o", label=name)
    ax.set_xlabel("wall time on 2 CPU cores (minutes: SFT, then RL)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval", nargs="+", default=[], metavar="SET:LABEL=PATH")
    parser.add_argument("--pairs", nargs="*", default=[], metavar="A:B")
    parser.add_argument("--transcripts", nargs=2, metavar="LABEL=PATH")
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--stride", type=int, default=1, help="--transcripts: every STRIDE-th problem")
    parser.add_argument("--audit", nargs="*", default=[], metavar="LABEL=PATH",
                        help="programs per answer, loops, boxed-but-not-printed, copied answers")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--curve", nargs="*", default=[], metavar="NAME=SECONDS:PATH,...")
    parser.add_argument("--title", default="SmolLM2-135M-Instruct, word problems")
    args = parser.parse_args()
    evals: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for spec in args.eval:
        key, _, path = spec.partition("=")
        set_name, _, label = key.partition(":")
        if not (path and label):
            parser.error(f"--eval {spec!r}: write SET:LABEL=PATH")
        evals[set_name][label] = per_problem(Path(path))
    if evals:
        print_table(summarise(evals, [tuple(p.split(":", 1)) for p in args.pairs]))
    if args.transcripts:
        (_, before), (_, after) = (t.split("=", 1) for t in args.transcripts)
        print_transcripts(Path(before), Path(after), args.n, args.stride)
    for spec in args.audit:
        label, _, path = spec.partition("=")
        result = audit(Path(path))
        print(f"{label}: {result['answers']} answers; " + ", ".join(
            f"{k} {100 * v:.1f}%" if k != "programs" else f"{v:.2f} programs an answer"
            for k, v in result.items() if k != "answers"))
    if args.plot:
        curves = {}
        for spec in args.curve:
            name, _, points = spec.partition("=")
            curves[name] = [
                (float(s), mean(list(per_problem(Path(p)).values())))
                for s, p in (point.split(":", 1) for point in points.split(","))
            ]
        plot(args.plot, curves, args.title)


if __name__ == "__main__":
    main()
