"""bench/more_steps.py: the committed three- and four-operation sets are what the generator writes, hold only such
problems of the test split, and the tool set asks the same problems under the python tool's instruction."""

from __future__ import annotations

from app.data import load_prompts
from app.data.rows import WORD_PROBLEM_INSTRUCTION, WORD_PROBLEM_TOOL_INSTRUCTION
from app.data.tasks.word_problems import WordProblemsConfig, word_problem_prompts
from bench.more_steps import COUNT, DEFAULT_OUT, TOOL_OUT, problems
from bench.new_wording import jsonl


def test_the_committed_sets_are_the_generators_and_no_training_problem_is_in_them():
    text, tool = problems(0), problems(0, tool=True)
    assert DEFAULT_OUT.read_text() == jsonl(text) and TOOL_OUT.read_text() == jsonl(tool)
    assert len(text) == len(tool) == COUNT
    for a, b in zip(text, tool, strict=True):
        assert a["messages"][0] == {"role": "system", "content": WORD_PROBLEM_INSTRUCTION}
        assert b["messages"][0] == {"role": "system", "content": WORD_PROBLEM_TOOL_INSTRUCTION}
        assert {**a, "messages": a["messages"][1:]} == {**b, "messages": b["messages"][1:]}
        assert a["metadata"]["num_ops"] in (3, 4)
    assert {r["metadata"]["num_ops"] for r in text} == {3, 4}
    # The pipelines train on one- and two-operation problems of the train split: no user message is shared.
    trained = word_problem_prompts(WordProblemsConfig(min_ops=1, max_ops=2, min_distractors=0, max_distractors=4),
                                   "train", 2000)
    assert not {r.messages[1]["content"] for r in trained} & {r["messages"][1]["content"] for r in text}
    rows = load_prompts(TOOL_OUT)
    assert len({row.id for row in rows}) == len(rows) == COUNT and all(row.task == "math" and row.answer for row in rows)
