"""How often a builtin:python_functions completion passes its own tests but is still wrong: every completion of an
evaluation (`trustbatch eval ... --data builtin:python_functions --out E.json`) graded again on many more inputs.

    python bench/code_strict.py E.json [E2.json ...] [--config configs/smollm2-code.yaml] [--extra 15]

For each problem the extra tests are drawn as its own tests are (app/data/tasks/python_functions.py
`make_problem`, with other seeds), so they come from the same argument kinds and are checked on the reference
solution. A completion is "strictly correct" when it passes its own tests and every extra one. Reported per
file: pass@1 on the problem's tests (what training rewards and evaluations report), pass@1 on the tests plus the
extra ones, and the share of passing completions that the extra tests catch (false passes), by template.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.data.tasks import FUNCTION_TEMPLATES, make_problem  # noqa: E402
from app.data.tasks.python_functions import function_problem_key  # noqa: E402
from rewards import VerifierInput, build_verifier  # noqa: E402


def extra_tests(row_key: str, num_tests: int, extra: int) -> list[dict]:
    """At least `extra` more tests of the problem `row_key`, none equal to another."""
    name, _, params = row_key.partition(":")
    spec = FUNCTION_TEMPLATES[name]
    slots = next(s for s in spec.problems() if function_problem_key(name, s) == row_key)
    seen: dict[str, dict] = {}
    seed = 1000
    while len(seen) < extra and seed < 1100:
        problem = make_problem(spec, slots, 5, seed)
        for code in problem.test_code():
            seen.setdefault(code, {"code": code})
        seed += 1
    return list(seen.values())[:extra]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("evals", nargs="+", type=Path)
    parser.add_argument("--extra", type=int, default=15)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--config", type=Path, default=None, help="the --config the evaluations ran with")
    args = parser.parse_args()
    verify = build_verifier("code", backend=args.backend, require_code_block=True, cpu_s=2.0)
    from app.config import load_config
    from app.data import load_split

    for path in args.evals:
        data = json.loads(path.read_text())
        n = len(data["prompts"])
        overrides = [f"data.eval={data['settings']['data']}", f"data.num_eval={n}", f"eval.num_prompts={n}"]
        cfg = load_config(args.config, overrides)
        rows = {row.id: row for row in load_split(cfg.data, "eval")}
        total = passed = strict = 0
        false_by_template: Counter = Counter()
        for prompt in data["prompts"]:
            row = rows[prompt["id"]]
            key = row.metadata["key"]
            more = extra_tests(key, len(row.tests), args.extra)
            for completion in prompt["completions"]:
                total += 1
                if not completion["correct"]:
                    continue
                passed += 1
                score = verify(VerifierInput("", completion["text"], more, {}))
                if score.correct:
                    strict += 1
                else:
                    false_by_template[row.metadata["template"]] += 1
        print(f"{path}: {total} completions; pass@1 on the problems' tests {100 * passed / total:.2f}%, with "
              f"{args.extra} more tests each {100 * strict / total:.2f}%; {passed - strict} of {passed} passes "
              f"({100 * (passed - strict) / max(passed, 1):.1f}%) were wrong elsewhere")  # fmt: skip
        if false_by_template:
            print("  false passes by template: " + ", ".join(f"{k} {v}" for k, v in false_by_template.most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
