"""Tools in rollouts: the one place where a run's or an evaluation's tool machinery is built from its config.

`load_toolkit(cfg.tools)` builds the tools of the ``tools`` section once, before any model is loaded
(tools/registry.py: an unknown name, a module that does not import or bad params stop here with the key and the
fix). `open_tool_rollouts(kit, ...)` then builds the sandbox they run in (the ``sandbox`` section), the call
format (``rollout.tool_format``; ``hermes`` is checked against the model's chat template), the tokenizer's part
(`EpisodeText`: the pause and end tokens) and the `ToolPool`, and yields a `ToolRollouts` over ``generate`` (the
fleet's, or an engine's). Training (app/training/setup.py) and `trustbatch eval` (app/evaluation/command.py) both
sample through it, so a tool-using answer is produced the same way in both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from app.data.prepare import stop_token_ids
from app.rollout.base import Completion, SamplingParams
from app.rollout.episodes import Episodes, EpisodeSettings, EpisodeText
from sandbox import executor as sandbox_executor
from sandbox.base import SandboxConfig
from tools import Tool, ToolPool, ToolSpec, build_tools
from tools.formats import FencedFormat, HermesFormat, ToolFormat

PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program in a sandbox and return what it prints (stdout, then stderr).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program; print what you need."}},
            "required": ["code"],
        },
    },
}


@dataclass
class ToolKit:
    """The run's tools, built once at start-up (before any model is loaded), by the name the model calls them."""

    specs: list[ToolSpec]
    tools: dict[str, Tool]
    tasks: frozenset[str]
    """The tasks whose rows may call a tool."""

    def chat_tools(self, tool_format: str) -> dict[str, list[dict]] | None:
        """Per task, the tool schemas its chat prompts are rendered with (hermes: the template shows them to the
        model); None for the fenced format, whose instruction is the row's own system message."""
        return tool_schemas(self.specs, self.tools) if tool_format == "hermes" else None


def load_toolkit(specs: list[ToolSpec]) -> ToolKit | None:
    """The ``tools`` section built (ValueError naming the key for a tool that cannot be built); None if empty."""
    if not specs:
        return None
    return ToolKit(list(specs), build_tools(list(specs)), frozenset(t for spec in specs for t in spec.tasks))


@dataclass
class ToolRollouts:
    """Sampling with tools: rows of a tool task get multi-turn episodes, the others one request."""

    episodes: Episodes
    tool_tasks: frozenset[str]

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        tasks: Sequence[str],
        *,
        progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        allowed = [task in self.tool_tasks for task in tasks]
        return await self.episodes.generate(prompts, params, allowed, progress=progress)


def pause_ids(tokenizer, marker: str) -> tuple[int, ...]:
    """Every token whose text holds the marker's last token's text: generation pauses after any of them and the
    driver decides whether a call is complete. SmolLM2 and "```": its two fence tokens; a model with a special
    ``</tool_call>`` token: that token alone."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    if not ids:
        raise ValueError(f"the tokenizer encodes the tool-call marker {marker!r} as no tokens")
    last = tokenizer.decode([ids[-1]])
    if not last.strip():
        raise ValueError(f"the tool-call marker {marker!r} ends in a whitespace token; pick a format whose marker does not")
    size = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(size)])
    return tuple(i for i, text in enumerate(texts) if last in text)


def tool_format(name: str, tokenizer, where: str) -> ToolFormat:
    """The call format ``rollout.tool_format`` names; hermes needs a chat template that renders tool messages."""
    if name == "fenced":
        return FencedFormat()
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"rollout.tool_format=hermes: the model at {where} has no chat template to render tool messages with; "
            "use rollout.tool_format=fenced"
        )

    def render(messages, add_generation_prompt):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    try:
        fmt = HermesFormat.from_template(render)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[PYTHON_SCHEMA], add_generation_prompt=True, tokenize=False
        )
    except ValueError as exc:
        raise ValueError(f"rollout.tool_format=hermes: the model at {where}: {exc}; use rollout.tool_format=fenced") from None
    if "python" not in rendered:
        raise ValueError(
            f"rollout.tool_format=hermes: the chat template of the model at {where} does not show the tools to the "
            "model (apply_chat_template(tools=...) leaves them out): use rollout.tool_format=fenced"
        )
    return fmt


def tool_schemas(specs: list[ToolSpec], tools: dict) -> dict[str, list[dict]]:
    """Per task, the schemas of its tools: the python tool's, or a user tool's ``schema`` attribute (an OpenAI
    function schema), else a bare one with its name."""
    out: dict[str, list[dict]] = {}
    for spec in specs:
        tool = tools[spec.call_name]
        schema = getattr(tool, "schema", None)
        if schema is None:
            schema = PYTHON_SCHEMA if spec.name == "python" and spec.call_name == "python" else {
                "type": "function", "function": {"name": spec.call_name, "parameters": {"type": "object"}}}
        for task in spec.tasks:
            out.setdefault(task, []).append(schema)
    return out


@contextlib.contextmanager
def open_tool_rollouts(
    kit: ToolKit,
    rollout,
    sandbox: SandboxConfig,
    generate,
    tokenizer,
    *,
    context: int | None,
    where: str,
    in_flight: int = 2,
) -> Iterator[ToolRollouts]:
    """The `ToolRollouts` of ``kit`` over ``generate`` (module docstring); the tool pool is closed on exit.
    ``rollout``: the run's RolloutConfig. ValueError for a format that cannot run with this model."""
    sandbox_executor.configure(sandbox)
    fmt = tool_format(rollout.tool_format, tokenizer, where)
    text = EpisodeText(
        encode=lambda s: list(tokenizer.encode(s, add_special_tokens=False)),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        pause_ids=pause_ids(tokenizer, fmt.stop_marker),
        end_ids=stop_token_ids(tokenizer),
    )
    settings = EpisodeSettings(
        max_turns=rollout.max_turns, max_total_tokens=rollout.total_tokens,
        max_output_tokens=rollout.max_tool_output_tokens, context=context,
        drop_void_turns=rollout.drop_void_turns, in_flight=in_flight,
    )  # fmt: skip
    pool = ToolPool(kit.tools, concurrency=rollout.tool_concurrency, timeout_s=rollout.tool_timeout_s)
    try:
        yield ToolRollouts(Episodes(generate, text, fmt, pool, settings), kit.tasks)
    finally:
        pool.close()
        sandbox_executor.close()  # the warm sandbox containers of this process go with the run
