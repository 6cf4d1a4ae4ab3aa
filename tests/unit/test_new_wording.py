"""bench/new_wording.py: the committed evaluation sets are what the generator writes, they load as prompt rows, and
the tool set asks the same problems under the python tool's instruction."""

from __future__ import annotations

from app.data import load_prompts
from app.data.rows import WORD_PROBLEM_INSTRUCTION, WORD_PROBLEM_TOOL_INSTRUCTION
from bench.new_wording import COUNTS, DEFAULT_OUT, TOOL_OUT, jsonl, problems


def test_the_committed_sets_are_the_generators_and_differ_only_in_the_instruction():
    text, tool = problems(0), problems(0, WORD_PROBLEM_TOOL_INSTRUCTION)
    assert DEFAULT_OUT.read_text() == jsonl(text) and TOOL_OUT.read_text() == jsonl(tool)
    assert len(text) == len(tool) == sum(COUNTS.values())
    for a, b in zip(text, tool, strict=True):
        assert a["messages"][0] == {"role": "system", "content": WORD_PROBLEM_INSTRUCTION}
        assert b["messages"][0] == {"role": "system", "content": WORD_PROBLEM_TOOL_INSTRUCTION}
        assert {**a, "messages": a["messages"][1:]} == {**b, "messages": b["messages"][1:]}
    rows = load_prompts(TOOL_OUT)
    assert len({row.id for row in rows}) == len(rows) and all(row.task == "math" and row.answer for row in rows)
