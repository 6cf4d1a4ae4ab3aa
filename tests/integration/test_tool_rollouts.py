"""Tools in the loop on the tiny model: multi-turn episodes through the real sandbox, in training and evaluation.

The models here are tiny Qwen2s warm-started on tool transcripts (the fenced format), so they really write
```python blocks and read the output blocks the driver appends: one model learnt the arithmetic task's
transcripts (`data.arithmetic.solutions=tool`), one learnt to call the tool after every output (a looping
policy, for the budgets). The python tool runs in bubblewrap (docker is covered per backend in
tests/sandbox/test_tool_hostile.py); the hostile tools are the plug-ins of tests/fixtures/plugins/my_tools.py.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

from app.config import load_config
from app.data.prepare import ModelText
from app.data.rows import PromptRow
from app.data.sft import tokenize_examples
from app.rollout.base import SamplingParams
from app.rollout.embedded import EmbeddedEngine
from app.rollout.trajectory import completion_text, trajectory_metrics
from app.tooling import load_toolkit, open_tool_rollouts
from app.training.loop import run
from app.training.records import summary_lines
from app.training.sft_loop import FitSettings, fit
from tools import ToolResult
from tools.formats import FencedFormat, observation
from trainer.logprobs import token_logprobs
from trainer.model import build_tiny_model, build_tiny_tokenizer, save_model

from .conftest import REPO, TINY, TOOL_DATA

pytestmark = pytest.mark.slow

TOOLS = ["tools=[{name: python, tasks: [math], params: {backend: bwrap}}]", "sandbox.backend=bwrap"]
PLUGINS = "tests.fixtures.plugins.my_tools"


@pytest.fixture(scope="module")
def tool_model(tool_model_dir) -> Path:
    return tool_model_dir


@pytest.fixture(scope="module")
def looping_model(tmp_path_factory) -> Path:
    """A tiny model that learnt to answer every output block with another call: it never stops on its own."""
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(TINY, tokenizer)
    fenced = FencedFormat()
    step = "```python\nprint(1)\n```" + observation(fenced, ToolResult("1"))
    rows = [PromptRow(f"{a}+{b}=", None, "0", None, "math", f"r{a}{b}", completion=step * 4) for a in range(5)
            for b in range(5)]  # fmt: skip
    text = ModelText(tokenizer, 256, "the looping model")
    examples = tokenize_examples(rows, text, transcripts=fenced, tool_tasks=frozenset({"math"})).examples
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    settings = FitSettings(steps=150, batch_size=16, micro_batch_size=16, max_grad_norm=1.0, show_progress=False)
    fit(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), tokenizer.pad_token_id,
        examples, [], settings)  # fmt: skip
    model.eval()
    out = tmp_path_factory.mktemp("models") / "looping"
    save_model(model, tokenizer, out)
    return out


def tool_config(tmp_path, model_dir, *extra):
    return load_config(REPO / "configs" / "quickstart.yaml", [
        *TOOL_DATA, *TOOLS, f"run.dir={tmp_path / 'run'}", f"model.path={model_dir}", "run.steps=3",
        "rollout.prompts_per_step=8", "rollout.group_size=4", "trainer.micro_batch_size=32", "rollout.max_new_tokens=24",
        "rollout.max_total_tokens=64", "rollout.max_turns=3", "eval.samples_per_prompt=2", "eval.every=0",
        "checkpoint.every=0", *extra,
    ])  # fmt: skip


def episodes(model_dir: Path, cfg, prompts: list[str], n: int = 2, temperature: float = 1.0):
    """Run tool episodes for ``prompts`` on the embedded engine; returns their completions."""
    engine = EmbeddedEngine.from_pretrained(model_dir)
    text = ModelText.from_dir(model_dir)
    ids = [text.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=temperature, n=n,
                            stop_token_ids=text.stop_token_ids)  # fmt: skip

    async def go():
        with open_tool_rollouts(load_toolkit(cfg.tools), cfg.rollout, cfg.sandbox, engine.generate, text.tokenizer,
                                context=text.context, where=str(model_dir)) as tools:  # fmt: skip
            return await tools.generate(ids, params, ["math"] * len(ids))

    return asyncio.run(go()), text


def test_training_with_the_python_tool_logs_statuses_tool_metrics_and_per_turn_gaps(tmp_path, tool_model):
    summary = run(tool_config(tmp_path, tool_model, "rollout.max_lag=0"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and len(rows) == 3
    for row in rows:
        assert row["tools/calls_per_trajectory"] > 0.5  # the warm-started model calls the tool
        assert sum(row[f"rollout/status/{s}"] for s in ("answered", "budget", "max_turns", "tool_error", "abort")) == pytest.approx(1)
        assert row["tools/error_rate"] < 0.5 and 0 <= row["tools/wait_frac"] <= 1
        # Synchronous, one float32 engine and trainer: the model tokens of every turn score as the engine sampled them.
        assert row["loss/tokens_turn/0"] > 0 and row["loss/tokens_turn/1"] > 0
        assert row["loss/logprob_gap_turn/0"] < 1e-3 and row["loss/logprob_gap_turn/1"] < 1e-3
        assert row["loss/ess_turn/1"] > 0.999
    # The held-out evaluation ran the same episodes: its samples hold whole transcripts with the tool's output.
    sampled = [json.loads(line) for line in (tmp_path / "run" / "eval" / "step-000003-sampled.jsonl").read_text().splitlines()]
    with_call = [s for s in sampled if s["tool_calls"]]
    assert with_call and all("```output\n" in s["transcript"] and "```output" not in s["text"] for s in with_call)
    assert summary["final_accuracy"] > 0.3
    # The summary and what `trustbatch train` prints say what the tools did, turn by turn.
    tools = summary["tools"]
    assert tools["tools/calls_per_trajectory"] > 0.5 and set(tools["per_turn"]) >= {"0", "1"}
    assert sum(tools["statuses"].values()) == pytest.approx(1)
    lines = summary_lines(summary)
    assert any(line.startswith("tools: ") for line in lines) and any(line.startswith("per turn ") for line in lines)
    assert (tmp_path / "run" / "training.png").stat().st_size > 1000


def test_the_trainer_scores_every_model_token_as_the_engine_sampled_it_and_never_a_tools(tool_model):
    """Token in, token out: the trajectory's model tokens, rescored by the trainer's forward over the whole
    transcript, carry the engine's logprobs; the observation tokens are masked and never compared."""
    cfg = tool_config(Path("/tmp"), tool_model)
    completions, text = episodes(tool_model, cfg, ["3+4=", "7*2=", "9-5="])
    model = torch.nn.Module()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tool_model).eval()
    checked = 0
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.output_ids])
        with torch.no_grad():
            logprobs, _ = token_logprobs(model, ids, torch.ones_like(ids))
        p = len(c.prompt_ids)
        for t, (sampled, engine_lp) in enumerate(zip(c.output_mask, c.output_logprobs, strict=True)):
            if sampled:
                assert abs(float(logprobs[0, p + t]) - engine_lp) < 1e-4
                checked += 1
        assert c.meta["status"] in ("answered", "budget")
    assert checked > 50 and any(not m for c in completions for m in c.output_mask)


def test_a_model_that_calls_the_tool_every_turn_stops_at_max_turns(looping_model):
    cfg = tool_config(Path("/tmp"), looping_model, "rollout.max_turns=3", "rollout.max_total_tokens=200")
    completions, text = episodes(looping_model, cfg, ["1+2=", "3+3="], n=1, temperature=0.0)
    assert {c.meta["status"] for c in completions} == {"max_turns"}
    assert all(len(c.meta["tool_calls"]) == 2 for c in completions)  # the third call, on the last turn, is not run
    assert all(max(c.output_turns) == 2 for c in completions)
    metrics = trajectory_metrics(completions)
    assert metrics["rollout/status/max_turns"] == 1.0 and metrics["tools/calls_per_trajectory"] == 2.0


def test_the_token_budget_ends_a_looping_model_and_counts_it(looping_model):
    cfg = tool_config(Path("/tmp"), looping_model, "rollout.max_turns=50", "rollout.max_total_tokens=60")
    completions, _ = episodes(looping_model, cfg, ["1+2=", "4+1="], n=1, temperature=0.0)
    assert {c.meta["status"] for c in completions} == {"budget"}
    assert all(len(c.output_ids) <= 60 for c in completions)


@pytest.mark.parametrize(
    "factory, timeout, status, says",
    [
        ("make_hanging_tool", "1", "timeout", "took more than 1 s"),
        ("make_crashing_tool", "30", "error", "the tool fell over"),
        ("make_flooding_tool", "30", "ok", "tokens cut"),
    ],
    ids=["hung", "crashing", "10MB"],
)
def test_a_hung_crashing_or_flooding_tool_is_an_observation_never_a_stalled_episode(looping_model, factory, timeout, status, says):
    cfg = tool_config(Path("/tmp"), looping_model, "rollout.max_turns=2", "rollout.max_total_tokens=200",
                      f"tools=[{{name: '{PLUGINS}:{factory}', tasks: [math], label: python}}]",
                      f"rollout.tool_timeout_s={timeout}", "rollout.max_tool_output_tokens=64")  # fmt: skip
    completions, text = episodes(looping_model, cfg, ["1+2=", "2+2="], n=1, temperature=0.0)
    for c in completions:
        # The episode went on after the observation (this model may answer instead of calling again).
        assert c.meta["status"] in ("max_turns", "answered") and [call["status"] for call in c.meta["tool_calls"]] == [status]
        assert max(c.output_turns) == 1
        observed = text.tokenizer.decode([t for t, m in zip(c.output_ids, c.output_versions, strict=True) if m < 0])
        assert says in observed
        assert c.meta["tool_calls"][0]["tokens"] <= 64 + 20  # the body is cut to 64 tokens; the fences around it
    assert trajectory_metrics(completions)["tools/calls_per_trajectory"] == 1.0


def test_a_thousand_tool_calls_all_end_and_are_counted(tool_model):
    cfg = tool_config(Path("/tmp"), tool_model, "rollout.tool_concurrency=16")
    prompts = [f"{a}{op}{b}=" for a in range(10) for b in range(10) for op in "+-*"][:250]
    completions, _ = episodes(tool_model, cfg, prompts, n=4)
    calls = [call for c in completions for call in c.meta["tool_calls"]]
    assert len(completions) == 1000 and len(calls) >= 900
    assert all(call["status"] in ("ok", "error") for call in calls)  # none timed out, none lost
    assert all(c.meta["status"] in ("answered", "budget", "max_turns") for c in completions)
    decode = ModelText.from_dir(tool_model).decode
    right = sum(completion_text(c, decode).endswith(f"\\boxed{{{eval(prompt[:-1])}}}")
                for prompt, group in zip(prompts, [completions[i:i + 4] for i in range(0, 1000, 4)], strict=True)
                for c in group)  # fmt: skip
    assert right > 300


def test_sft_learns_a_transcript_with_the_loss_on_the_models_tokens_only(tool_model):
    """The tools' output blocks are context: masked, and tokenized exactly as the episode driver appends them."""
    text = ModelText.from_dir(tool_model)
    fenced = FencedFormat()
    completion = "```python\nprint(6*7)\n```" + observation(fenced, ToolResult("42")) + "\\boxed{42}"
    row = PromptRow("6*7=", None, "42", None, "math", "r", completion=completion)
    example = tokenize_examples([row], text, transcripts=fenced, tool_tasks=frozenset({"math"})).examples[0]
    tokenizer = text.tokenizer
    untrained = tokenizer.decode([example.ids[i] for i in example.untrained])
    assert untrained == "\n```output\n42\n```\n"
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    expected = encode("6*7=") + encode("```python\nprint(6*7)\n```") + encode(fenced.before) + encode("42") + \
        encode(fenced.after) + encode("\\boxed{42}") + [tokenizer.eos_token_id]  # fmt: skip
    assert list(example.ids) == expected
    assert example.num_targets == len(expected) - len(encode("6*7=")) - len(example.untrained)
    # A row of a task without tools is learnt whole, as before.
    other = tokenize_examples([row], text, transcripts=fenced, tool_tasks=frozenset({"code"})).examples[0]
    assert other.untrained == () and math.isclose(other.num_targets, len(other.ids) - other.start)
