"""Tools: the registry (as verifiers: by name or dotted path, checked at start-up), the pool that bounds every
call, the two call formats, and the python tool through the real sandbox."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from app.config import ConfigError, load_config
from tools import REGISTRY, ToolCall, ToolPool, ToolResult, ToolSpec, build_tools, check_specs
from tools.formats import FencedFormat, HermesFormat, MalformedCall, observation
from tools.pool import MAX_OUTPUT_CHARS

REPO = Path(__file__).resolve().parents[2]

PLUGINS = "tests.fixtures.plugins.my_tools"


def test_the_python_tool_is_registered_and_a_plugin_builds_by_dotted_path():
    assert "python" in REGISTRY
    tools = build_tools([ToolSpec(name=f"{PLUGINS}:make_calculator", label="calc", params={"max_digits": 5})])
    assert tools["calc"](ToolCall("calc", {"expression": "3*4+1"})) == ToolResult("13", "ok")
    assert tools["calc"](ToolCall("calc", {"expression": "10**100"})).status == "error"  # not evaluated


@pytest.mark.parametrize(
    "override, match",
    [
        ("tools=[{name: nope, tasks: [math]}]", r"tools\[0\] \(nope\): unknown tool 'nope'; registered tools: \['python'\]"),
        ("tools=[{name: 'no_such_pkg.tools:make', tasks: [math]}]", r"cannot import module 'no_such_pkg.tools'.*PYTHONPATH"),
        (f"tools=[{{name: '{PLUGINS}:missing', tasks: [math]}}]", "has no attribute 'missing'"),
        ("tools=[{name: python, params: {wall_s: 0}}]", r"tools\[0\] \(python\): python tool params.wall_s=0 must be > 0"),
        ("tools=[{name: python, params: {walls: 1}}]", r"unknown parameter\(s\) \['walls'\]; valid parameters"),
        ("tools=[{name: python, tasks: []}]", "must list at least one task"),
        ("tools=[{name: python}, {name: python}]", "also tools\\[0\\]'s; give one of them another `label`"),
        ("tools=[{name: python}]\nrollout.max_turns=1", None),
    ],
)
def test_a_tool_that_cannot_be_built_stops_the_config_with_the_key_and_the_fix(override, match):
    overrides = override.split("\n")
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs" / "quickstart.yaml", overrides)
    if match is None:
        assert "rollout.max_turns=1" in str(info.value) and "set rollout.max_turns >= 2" in str(info.value)
    else:
        assert info.value.args and __import__("re").search(match, str(info.value)), str(info.value)


def test_a_factory_that_refuses_its_params_is_named_at_build_time():
    with pytest.raises(ValueError, match=r"tools\[0\] \(.*broken_factory\): its factory refused params"):
        build_tools([ToolSpec(name=f"{PLUGINS}:broken_factory", params={"a": 1})])
    check_specs([ToolSpec(name=f"{PLUGINS}:broken_factory")])  # dotted paths' params are checked when built


def run(coro):
    return asyncio.run(coro)


def pool_of(**factories) -> ToolPool:
    return ToolPool(build_tools([ToolSpec(name=f"{PLUGINS}:{f}", label=label) for label, f in factories.items()]),
                    concurrency=2, timeout_s=0.5, max_abandoned=2)  # fmt: skip


def test_a_hung_tool_becomes_a_timeout_observation_and_hung_threads_are_bounded():
    pool = pool_of(hang="make_hanging_tool")

    async def calls(k):
        return await asyncio.gather(*[pool.call(ToolCall("hang", {})) for _ in range(k)])

    async def two_rounds():
        return await calls(2) + await calls(2)

    results = run(two_rounds())
    assert [r.status for r in results[:2]] == ["timeout", "timeout"] and "0.5 s" in results[0].output
    # Two threads still hang (max_abandoned=2): later calls are refused at once instead of queueing behind them.
    assert [r.detail.get("reason") for r in results[2:]] == ["refused", "refused"]
    assert pool.counts["timeout"] == 2 and pool.counts["refused"] == 2 and pool.counts["calls"] == 4
    pool.close()


@pytest.mark.parametrize(
    "factory, status, text",
    [
        ("make_crashing_tool", "error", "the tool failed: RuntimeError: the tool fell over"),
        ("make_exiting_tool", "error", "the tool failed: SystemExit: 3"),
        ("make_wrong_type_tool", "error", "returned int, not a ToolResult"),
    ],
)
def test_a_tool_that_crashes_or_misbehaves_becomes_an_error_observation(factory, status, text):
    pool = pool_of(bad=factory)
    result = run(pool.call(ToolCall("bad", {})))
    assert result.status == status and text in result.output
    pool.close()


def test_ten_megabytes_of_output_are_cut_with_head_and_tail_kept():
    pool = pool_of(flood="make_flooding_tool")
    result = run(pool.call(ToolCall("flood", {})))
    assert len(result.output) <= MAX_OUTPUT_CHARS + 100 and "characters, cut" in result.output
    assert result.output.startswith("xxx") and result.output.endswith("xxx")
    assert result.detail["output_chars"] == 10 << 20
    pool.close()


def test_an_unknown_tool_name_is_an_error_observation():
    pool = pool_of(calc="make_calculator")
    result = run(pool.call(ToolCall("search", {})))
    assert result.status == "error" and "no tool named 'search'" in result.output and "calc" in result.output
    pool.close()


def test_the_pool_never_runs_more_calls_at_once_than_its_concurrency():
    import threading
    import time

    running, peak, lock = [0], [0], threading.Lock()

    def slow(call):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return ToolResult("done")

    pool = ToolPool({"slow": slow}, concurrency=3, timeout_s=30)

    async def calls():
        return await asyncio.gather(*[pool.call(ToolCall("slow", {})) for _ in range(12)])

    assert all(r.output == "done" for r in run(calls()))
    assert peak[0] == 3
    pool.close()


# ---------------------------------------------------------------------------------------------- formats


def test_fenced_calls_are_closed_python_blocks_only():
    fenced = FencedFormat()
    call = fenced.parse("Let me compute.\n```python\nprint(23 + 40 - 47)\n```")
    assert call == ToolCall("python", {"code": "print(23 + 40 - 47)\n"}, "```python\nprint(23 + 40 - 47)\n```")
    assert fenced.parse("```python") is None  # the opening fence: keep generating
    assert fenced.parse("```python\nx = 1") is None
    assert fenced.parse("```text\nhi\n```") is None  # a block that is not python
    assert fenced.parse("```output\n16\n```") is None  # an output block the model wrote itself
    assert fenced.parse("no code") is None


def test_a_transcript_splits_into_the_models_text_and_the_tools_observations():
    fenced = FencedFormat()
    transcript = ("```python\nprint(2 + 2)\n```" + observation(fenced, ToolResult("4\n")) + "So 4.\n```python\nprint()\n```"
                  + observation(fenced, ToolResult("")) + "\\boxed{4}")  # fmt: skip
    pieces = fenced.split_transcript(transcript)
    assert [by_model for _, by_model in pieces] == [True, False, True, False, True]
    assert pieces[1][0] == "\n```output\n4\n```\n" and pieces[3][0] == "\n```output\n\n```\n"
    assert "".join(piece for piece, _ in pieces) == transcript
    # An output block the model wrote without a call before it is the model's own text.
    made_up = "```output\n4\n```\n\\boxed{4}"
    assert fenced.split_transcript(made_up) == [(made_up, True)]


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def render_with(template: str):
    from jinja2 import Template

    def render(messages, add_generation_prompt):
        return Template(template).render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None)

    return render


def test_hermes_calls_parse_json_and_a_malformed_one_is_returned_as_an_error():
    hermes = HermesFormat.from_template(render_with(HERMES_TEMPLATE))
    assert hermes.before == "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
    assert hermes.after == "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    call = hermes.parse('<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>')
    assert call.name == "python" and call.arguments == {"code": "print(1)"}
    as_string = hermes.parse('<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>')
    assert as_string.arguments == {"expression": "1+1"}
    bad = hermes.parse("<tool_call>{name: python}</tool_call>")
    assert isinstance(bad, MalformedCall) and "not valid JSON" in bad.message
    assert isinstance(hermes.parse('<tool_call>["python"]</tool_call>'), MalformedCall)
    assert hermes.parse("I will call <tool_call>") is None
    text = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>' + observation(hermes, ToolResult("2")) + "\\boxed{2}"
    assert [by_model for _, by_model in hermes.split_transcript(text)] == [True, False, True]
    assert json.dumps(hermes.split_transcript(text)[1][0]).count("tool_response") == 2


def test_a_template_that_cannot_render_tool_messages_is_refused():
    refusing = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{{ m.content }}{% endfor %}"

    def render(messages, add_generation_prompt):
        from jinja2 import Environment

        env = Environment()
        env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(ValueError(msg))
        return env.from_string(refusing).render(messages=messages)

    with pytest.raises(ValueError, match="cannot render a tool message"):
        HermesFormat.from_template(render)
    dropping = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="does not render a tool message"):
        HermesFormat.from_template(render_with(dropping))
