"""`trustbatch serve` with tools: the model's Hermes-style calls come back as OpenAI `tool_calls`, spoken to with the
official `openai` client; the client runs the tool and sends its result back as a `tool` message. serve never
executes model code.

The model is a tiny Qwen2 with a chat template that shows tools (Qwen2.5's layout, cut down), warm-started on
two kinds of turn: a question -> a `<tool_call>`, and the tool's answer -> a sentence with the result.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from app.data.prepare import ModelText
from app.data.rows import PromptRow
from app.data.sft import tokenize_examples
from app.serving.server import build_app
from app.training.sft_loop import FitSettings, fit
from trainer.model import build_tiny_model, build_tiny_tokenizer, save_model

from .conftest import TINY
from .model_refs import ThreadServer

pytestmark = pytest.mark.slow

NAME = "tiny-tools"
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALC = {"type": "function", "function": {"name": "calc", "description": "Add two numbers.",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}  # fmt: skip


def call_text(a: int, b: int) -> str:
    return '<tool_call>{"name": "calc", "arguments": {"expression": "' + f"{a}+{b}" + '"}}</tool_call>'


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    model = build_tiny_model(TINY, tokenizer)
    rows = []
    for a in range(10):
        for b in range(10):
            question = [{"role": "user", "content": f"add {a} and {b}"}]
            first = tokenizer.apply_chat_template(question, tools=[CALC], add_generation_prompt=True, tokenize=False)
            rows.append(PromptRow(first, None, "0", None, "math", f"q{a}{b}", completion=call_text(a, b)))
            answered = [*question, {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calc", "arguments": {"expression": f"{a}+{b}"}}}]},
                {"role": "tool", "content": str(a + b)}]  # fmt: skip
            second = tokenizer.apply_chat_template(answered, tools=[CALC], add_generation_prompt=True, tokenize=False)
            rows.append(PromptRow(second, None, "0", None, "math", f"a{a}{b}", completion=f"It is {a + b}."))
    examples = tokenize_examples(rows, ModelText(tokenizer, 256, "the tools model")).examples
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    settings = FitSettings(steps=250, batch_size=32, micro_batch_size=32, max_grad_norm=1.0, show_progress=False)
    fit(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), tokenizer.pad_token_id,
        examples, [], settings)  # fmt: skip
    model.eval()
    out = tmp_path_factory.mktemp("models") / "tools"
    save_model(model, tokenizer, out)
    return out


@pytest.fixture(scope="module")
def client(tools_model):
    server = ThreadServer(build_app(tools_model, model_name=NAME, batch_window_ms=20))
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
    server.close()


def test_the_models_call_comes_back_as_tool_calls_and_the_client_sends_the_result(client):
    question = [{"role": "user", "content": "add 3 and 4"}]
    out = client.chat.completions.create(model=NAME, messages=question, tools=[CALC], temperature=0, max_tokens=80)
    [choice] = out.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calc" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)  # the model's own call (this tiny model may add wrongly)
    assert set(arguments) == {"expression"} and __import__("re").fullmatch(r"\d\+\d", arguments["expression"])
    assert choice.message.content is None and "<tool_call>" not in (choice.message.content or "")
    # The client runs the tool (serve never does) and sends the result back.
    result = str(eval(json.loads(call.function.arguments)["expression"]))  # the test is the client here
    follow = [*question, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": result}]  # fmt: skip
    out = client.chat.completions.create(model=NAME, messages=follow, tools=[CALC], temperature=0, max_tokens=40)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content.startswith("It is ")
    assert out.choices[0].message.tool_calls is None


def test_without_tools_the_same_reply_is_plain_content(client):
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "add 3 and 4"}],
                                         temperature=0, max_tokens=80)  # fmt: skip
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [CALC], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "calc"}}}, "tool_choice"),
        ({"tools": [CALC], "stream": True}, "stream"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [CALC] * 65}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "x", "description": "y" * 70_000}}]}, "tools"),
        ({"functions": [CALC["function"]]}, "functions"),
    ],
)
def test_tool_requests_it_cannot_honour_get_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "add 1 and 2"}],
                                       max_tokens=4, **extra)  # fmt: skip
    assert info.value.body["param"] == param, info.value.body


def test_a_template_that_does_not_show_tools_refuses_them(tiny_model_dir):
    server = ThreadServer(build_app(tiny_model_dir, model_name="plain", batch_window_ms=20))
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as plain:
            with pytest.raises(openai.BadRequestError, match="does not show tools"):
                plain.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}], tools=[CALC])
    finally:
        server.close()


def test_a_hermes_episode_runs_the_call_and_the_model_answers_after_the_tool_message(tools_model):
    """rollout.tool_format=hermes in the episode driver: the model's <tool_call> pauses generation, the calculator
    plug-in runs, its result goes back as the template's tool message, and the model answers in a new turn."""
    import asyncio

    from app.config import load_config
    from app.rollout.base import SamplingParams
    from app.rollout.embedded import EmbeddedEngine
    from app.rollout.trajectory import completion_text
    from app.tooling import load_toolkit, open_tool_rollouts

    from .conftest import REPO

    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        "rollout.tool_format=hermes", "rollout.max_turns=3", "rollout.max_new_tokens=80", "rollout.max_total_tokens=200",
        "tools=[{name: 'tests.fixtures.plugins.my_tools:make_calculator', tasks: [math], label: calc}]",
    ])  # fmt: skip
    text = ModelText.from_dir(tools_model)
    kit = load_toolkit(cfg.tools)
    schemas = kit.chat_tools("hermes")["math"]
    assert schemas[0]["function"]["name"] == "calc"
    prompt = text.tokenizer.apply_chat_template([{"role": "user", "content": "add 2 and 5"}], tools=schemas,
                                                add_generation_prompt=True, tokenize=False)  # fmt: skip
    ids = text.tokenizer.encode(prompt, add_special_tokens=False)
    engine = EmbeddedEngine.from_pretrained(tools_model)
    params = SamplingParams(max_new_tokens=80, temperature=0.0, n=1, stop_token_ids=text.stop_token_ids)

    async def go():
        with open_tool_rollouts(kit, cfg.rollout, cfg.sandbox, engine.generate, text.tokenizer, context=text.context,
                                where=str(tools_model)) as tools:  # fmt: skip
            return await tools.generate([ids], params, ["math"])

    [completion] = asyncio.run(go())
    [call] = completion.meta["tool_calls"]
    assert call["tool"] == "calc" and call["status"] == "ok"
    assert completion.meta["status"] == "answered" and max(completion.output_turns) == 1
    transcript = text.tokenizer.decode(completion.output_ids, skip_special_tokens=False)
    assert "<tool_response>" in transcript and "</tool_response>" in transcript  # the template's tool message
    assert completion_text(completion, text.decode).endswith(".")  # the model's answer after the tool's
