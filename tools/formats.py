"""How a tool call looks in the model's text, and how its result is shown back: two formats.

``fenced`` (the ToRL / ReTool format; works with any model, SmolLM2 included). The model writes a
```python block; generation stops when the block closes; the driver appends the result in the same assistant turn
as a fenced output block, and generation continues after it::

    ```python
    a = 23 + 40
    print(a - 47)
    ```
    ```output
    16
    ```
    \\boxed{16}

``hermes`` (models whose chat template has tool calls, such as Qwen2.5): the model writes
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the result goes back as a ``tool`` message rendered
by the model's own chat template (its tokens around the content come from rendering a dummy conversation once,
`HermesFormat.from_template`), and the model answers in a new assistant turn.

Both are text-level here: which text stops generation (`stop_marker`), whether a turn that stopped there holds
a complete call (`parse`: a `ToolCall`, a `MalformedCall` to return to the model as an error, or None to keep
generating), the text of a result (`observation`), and how a written transcript splits into the model's text and
the tools' (`split_transcript`, what supervised fine-tuning masks). The driver turns texts into tokens, once each.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal, Protocol

from tools.types import ToolCall, ToolResult

FormatName = Literal["fenced", "hermes"]
FORMATS: tuple[str, ...] = ("fenced", "hermes")
PYTHON_TAGS = frozenset({"python", "py", "python3"})


@dataclass(frozen=True)
class MalformedCall:
    """A call the model botched (a Hermes call whose JSON does not parse): shown back to it as an error."""

    message: str
    raw: str


class ToolFormat(Protocol):
    name: str
    stop_marker: str
    """Generation pauses after a token whose text holds the end of this marker; `parse` then decides."""
    before: str
    after: str
    """An observation is ``before + body + after``; each of the three is tokenized on its own (the driver cuts the
    body's tokens to size), the same way in rollouts and in supervised fine-tuning."""

    def parse(self, turn: str) -> ToolCall | MalformedCall | None: ...

    def split_transcript(self, text: str) -> list[tuple[str, bool]]: ...


def observation_body(result: ToolResult) -> str:
    """The text of a result as the model reads it: its output without trailing newlines."""
    return result.output.rstrip("\n")


def observation(fmt: ToolFormat, result: ToolResult) -> str:
    """The whole observation text of ``result`` in ``fmt`` (what a written transcript holds)."""
    return fmt.before + observation_body(result) + fmt.after


def _fences(text: str) -> list[int]:
    """Positions of every ``` in ``text`` (a linear scan)."""
    out, pos = [], 0
    while (at := text.find("```", pos)) >= 0:
        out.append(at)
        pos = at + 3
    return out


@dataclass(frozen=True)
class FencedFormat:
    """```python blocks in, ```output blocks back (module docstring)."""

    name: str = "fenced"
    stop_marker: str = "```"
    before: str = "\n```output\n"
    after: str = "\n```\n"

    def parse(self, turn: str) -> ToolCall | MalformedCall | None:
        """The python block that ``turn`` (the model's text since the last observation) just closed, or None.

        A ``` that opens a block, or closes a block that is not python (an ```output the model wrote itself,
        a ```text), is no call: generation goes on. Only a turn whose last ``` closes a ```python block is."""
        fences = _fences(turn)
        if not fences or len(fences) % 2 or not turn.rstrip().endswith("```"):
            return None
        opener, closer = fences[-2], fences[-1]
        line_end = turn.find("\n", opener + 3)
        if line_end < 0 or line_end > closer:
            return None
        tag = turn[opener + 3 : line_end].strip().lower()
        if tag not in PYTHON_TAGS:
            return None
        return ToolCall("python", {"code": turn[line_end + 1 : closer]}, turn[opener : closer + 3])

    def split_transcript(self, text: str) -> list[tuple[str, bool]]:
        """(text, written by the model?) pieces of a transcript in this format: an output block right after a
        ```python block that the turn closed is the tool's (as `observation` writes it); the rest is the model's."""
        pieces: list[tuple[str, bool]] = []
        start = pos = 0
        while (at := text.find(self.before, pos)) >= 0:
            end = text.find(self.after, at + len(self.before))
            if end < 0:
                break
            if isinstance(self.parse(text[start:at]), ToolCall):
                pieces += [(text[start:at], True), (text[at : end + len(self.after)], False)]
                start = pos = end + len(self.after)
            else:  # an output block the model wrote with no call before it: the model's own text
                pos = at + 1
        pieces.append((text[start:], True))
        return [(piece, by_model) for piece, by_model in pieces if piece]


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes_payload(raw: str) -> ToolCall | MalformedCall:
    """The JSON between ``<tool_call>`` and ``</tool_call>``: a `ToolCall`, or a `MalformedCall` saying what is wrong."""
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as exc:
        return MalformedCall(f"the tool call is not valid JSON ({exc.msg} at position {exc.pos})", raw)
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return MalformedCall('a tool call must be a JSON object {"name": ..., "arguments": {...}}', raw)
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return MalformedCall("the tool call's arguments are not a JSON object", raw)
    if not isinstance(arguments, dict):
        return MalformedCall("the tool call's arguments are not a JSON object", raw)
    return ToolCall(payload["name"], arguments, f"<tool_call>{raw}</tool_call>")


def hermes_calls(text: str, limit: int = 64) -> tuple[str, list[ToolCall | MalformedCall]]:
    """Every ``<tool_call>{json}</tool_call>`` of a reply (at most ``limit``), parsed, and the reply's text with them
    taken out (what `trustbatch serve` returns as OpenAI ``tool_calls`` and ``content``)."""
    calls = [parse_hermes_payload(raw) for raw in _HERMES.findall(text)[:limit]]
    return _HERMES.sub("", text).strip(), calls


@dataclass(frozen=True)
class HermesFormat:
    """``<tool_call>{json}</tool_call>`` in, a ``tool`` message of the chat template back (module docstring).

    ``before`` and ``after``: the template's text around a tool message's content when it follows the model's
    ``</tool_call>`` (the end of the assistant turn and the tool message's header; its footer and the next
    assistant header), from `from_template`."""

    before: str
    after: str
    name: str = "hermes"
    stop_marker: str = "</tool_call>"

    @classmethod
    def from_template(cls, render) -> HermesFormat:
        """The text around a tool result, from ``render(messages, add_generation_prompt) -> str`` (the chat
        template): a dummy conversation rendered with and without a tool message after the assistant's call.
        ValueError when the template does not render a tool message after an assistant one."""
        call = '<tool_call>\n{"name": "probe", "arguments": {}}\n</tool_call>'
        content = "TRUSTBATCH-TOOL-RESULT-7f3a"
        base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": call}]
        try:
            without = render(base, False)
            with_tool = render([*base, {"role": "tool", "content": content}], True)
        except Exception as exc:  # noqa: BLE001 - a template that raises on a tool message cannot run hermes
            raise ValueError(f"the chat template cannot render a tool message ({type(exc).__name__}: {exc})") from None
        at = without.rfind(call)
        if at < 0 or not with_tool.startswith(without[: at + len(call)]) or with_tool.count(content) != 1:
            raise ValueError("the chat template does not render a tool message after the assistant's tool call")
        tail = with_tool[at + len(call) :]
        before, after = tail.split(content)
        return cls(before=before, after=after)

    def parse(self, turn: str) -> ToolCall | MalformedCall | None:
        if not turn.rstrip().endswith("</tool_call>"):
            return None
        calls = _HERMES.findall(turn)
        if not calls:
            return None
        return parse_hermes_payload(calls[-1])

    def split_transcript(self, text: str) -> list[tuple[str, bool]]:
        """Tool messages (``before`` + content + ``after``) are the tools'; the rest is the model's."""
        pieces: list[tuple[str, bool]] = []
        start = 0
        while (at := text.find(self.before, start)) >= 0:
            end = text.find(self.after, at + len(self.before))
            if end < 0:
                break
            pieces.append((text[start:at], True))
            pieces.append((text[at : end + len(self.after)], False))
            start = end + len(self.after)
        pieces.append((text[start:], True))
        return [(piece, by_model) for piece, by_model in pieces if piece]
