"""Word problems of three and four operations from builtin:word_problems' test split: an evaluation set that
neither SmolLM2 pipeline trains on (both train on one- and two-operation problems, `max_ops: 2`).

The templates of three and four operations (shopping, travel, sharing, savings, savings_goal, recipe, ages: 3;
shopping_change, travel_remaining, inventory: 4) tell the same kinds of stories as the one- and two-operation
templates the pipelines learn from, with more steps between the numbers and the answer. A text-only model works
every step by hand, and each is another chance to slip; with the python tool the arithmetic is the program's, and
what is left is writing the expression. Rows are in the row schema (app/data/rows.py), under the system message
of builtin:word_problems (or, with --tool, of its `solutions: tool`), with the same 0-1 distractor sentences as
training; `metadata` names the template and its number of operations.

    .venv/bin/python bench/more_steps.py            # writes bench/data/word_problems_3_4_ops.jsonl
    .venv/bin/python bench/more_steps.py --tool     # the same problems under the python tool's instruction
    .venv/bin/trustbatch eval MODEL --data bench/data/word_problems_3_4_ops.jsonl ...
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.data.tasks.word_problems import WordProblemsConfig, word_problem_prompts  # noqa: E402
from bench.new_wording import DATA, write_set  # noqa: E402

DEFAULT_OUT = DATA / "word_problems_3_4_ops.jsonl"
TOOL_OUT = DATA / "word_problems_3_4_ops_tool.jsonl"
COUNT = 240


def problems(seed: int = 0, tool: bool = False, count: int = COUNT) -> list[dict]:
    """`count` distinct test-split problems of three or four operations, as row-schema dicts (no `completion`:
    the set is for evaluation only)."""
    cfg = WordProblemsConfig(
        min_ops=3, max_ops=4, min_distractors=0, max_distractors=1, seed=seed, solutions="tool" if tool else "text"
    )
    return [
        {
            "messages": row.messages,
            "answer": row.answer,
            "task": row.task,
            "id": row.id.replace("word_problems-test", "3_4_ops"),
            "metadata": row.metadata,
        }
        for row in word_problem_prompts(cfg, "test", count)
    ]


def main() -> None:
    rows = write_set(__doc__, DEFAULT_OUT, TOOL_OUT, problems)
    ops = {n: sum(r["metadata"]["num_ops"] == n for r in rows) for n in (3, 4)}
    print(f"  {ops[3]} of three operations, {ops[4]} of four")


if __name__ == "__main__":
    main()
