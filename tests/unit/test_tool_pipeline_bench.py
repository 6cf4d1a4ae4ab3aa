"""bench/tool_pipeline.py: accuracy per set, differences paired by problem (one seed and across seeds), and the
audit of tool transcripts (programs, loops, boxed numbers other than the output, copied answers)."""

from __future__ import annotations

import json

import pytest

from bench.tool_pipeline import audit, per_problem, summarise


def write_eval(path, rows):
    """An eval JSON as `trustbatch eval --out` writes it: per prompt, its id, messages, samples, correct, completions."""
    prompts = [
        {"id": pid, "messages": [{"role": "user", "content": question}], "samples": len(completions),
         "correct": sum(c["correct"] for c in completions), "completions": completions}
        for pid, question, completions in rows
    ]
    path.write_text(json.dumps({"prompts": prompts}))
    return path


def answer(transcript: str, correct: bool) -> dict:
    return {"text": transcript, "transcript": transcript, "correct": correct}


PROGRAM = "```python\nprint({e})\n```\n```output\n{o}\n```\n\\boxed{{{b}}}"


def test_accuracy_and_paired_differences_one_seed_and_across_seeds(tmp_path):
    a = write_eval(tmp_path / "a.json", [("p0", "q", [answer("", True), answer("", True)]),
                                         ("p1", "q", [answer("", True), answer("", False)])])
    b = write_eval(tmp_path / "b.json", [("p0", "q", [answer("", False)]), ("p1", "q", [answer("", False)])])
    assert per_problem(a) == {"p0": 1.0, "p1": 0.5}
    out = summarise({"set": {"tools": per_problem(a), "text": per_problem(b)}}, [("tools", "text")])["set"]
    assert out["accuracy"]["tools"][:1] == (0.75,) and out["accuracy"]["text"][0] == 0.0
    assert out["pairs"]["tools - text"][0] == pytest.approx(0.75) and out["pairs"]["tools - text"][2] == 2
    seeds = {"tools#0": {"p0": 1.0}, "tools#1": {"p0": 0.0}, "text#0": {"p0": 0.0}, "text#1": {"p0": 0.0}}
    out = summarise({"set": seeds}, [("tools", "text")])["set"]
    assert out["accuracy"]["tools"] == (0.5, 0.5, 2)
    assert out["pairs"]["tools - text"] == (0.5, 0.5, 2)


def test_the_audit_counts_loops_mismatches_and_copied_answers(tmp_path):
    path = write_eval(tmp_path / "e.json", [
        ("p0", "Ann has 36 and 55.", [
            answer(PROGRAM.format(e="36 + 55", o="91", b="91"), True),
            answer(PROGRAM.format(e="36 - 55", o="-19", b="19"), False),     # boxes other than it printed
            answer(PROGRAM.format(e="1", o="1", b="") + PROGRAM.format(e="2", o="2", b="2"), False),  # two calls
            answer("The answer is \\boxed{36}", True),                        # copied, no program, rewarded
        ]),
    ])
    result = audit(path)
    assert result["answers"] == 4
    assert result["programs"] == pytest.approx(4 / 4) and result["several calls"] == pytest.approx(1 / 4)
    assert result["no program"] == pytest.approx(1 / 4) and result["boxed other than printed"] == pytest.approx(1 / 4)
    assert result["right, copied, no program"] == pytest.approx(1 / 4) and result["right"] == pytest.approx(2 / 4)
