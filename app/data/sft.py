"""Supervised examples: rows with a completion, tokenized so the loss covers the reply's tokens and nothing else.

A row's prompt is tokenized exactly as the rollout engines get it (`encode_prompt`: a plain prompt without special
tokens; a chat through the chat template with the generation prompt), so the model learns to continue the very
tokens it is later sampled from. The target is then:

- plain prompt rows: the completion's tokens and EOS;
- chat rows: what the model's own chat template adds when the completion is appended as the assistant's turn,
  up to and including the end-of-turn token (SmolLM2 and Qwen: ``<|im_end|>``). The template must render the
  conversation without the reply as a token prefix of the conversation with it (the generation prompt
  included), and must end the reply with a stop token; a template that does neither cannot be masked, and
  that is an error naming the model and the fix, never a guess. What a template writes after the stop token
  (a newline) is not trained: generation ends at the stop token.

Tool-use transcripts (rows of a task that has tools, given a ``transcripts`` format): the reply is split into
the model's text and the tools' observations (`ToolFormat.split_transcript`), each piece tokenized on its own and
the observation's ``before + body + after`` each apart, exactly as a rollout builds the trajectory
(app/rollout/episodes.py), then the end of the turn; the observations' tokens are context, not targets
(`Example.untrained`). A chat template must wrap the reply in nothing but its end-of-turn token for this.

An example longer than the model's context is an error naming the file, the row and the fix, or, with
``sft.on_long=drop``, left out and counted. Nothing is ever cut short.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from app.data.prepare import ModelText
from app.data.rows import _MAX_REPORTED_ERRORS, DatasetError, PromptRow
from tools.formats import ToolFormat
from trainer.model import encode_prompt
from trainer.sft import Example

log = logging.getLogger("trustbatch")


@dataclass
class Examples:
    examples: list[Example]
    rows: list[PromptRow]
    """The row of each example."""
    dropped: int = 0
    """Rows left out for their length (sft.on_long=drop)."""

    @property
    def target_tokens(self) -> int:
        return sum(e.num_targets for e in self.examples)


def _where(row: PromptRow) -> str:
    return row.origin or f"row id {row.id!r}"


def chat_target(tokenizer, prompt_ids: list[int], messages: list[dict], completion: str, stop: set[int],
                where: str) -> list[int]:  # fmt: skip
    """The tokens the chat template gives the assistant's reply ``completion`` after ``messages``, through the
    first stop token; ``prompt_ids`` is the conversation rendered with the generation prompt."""
    encoded = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": completion}], tokenize=True
    )
    full = list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)
    name = getattr(tokenizer, "name_or_path", "the model")
    if full[: len(prompt_ids)] != prompt_ids:
        raise DatasetError(
            f"{where}: the chat template of {name} does not render the conversation before the assistant's reply "
            f"(with its generation prompt) as the start of the conversation with it, so the reply's tokens cannot "
            f"be told apart from the prompt's; use plain prompt + completion rows, or a model whose template "
            f"appends each turn without rewriting the earlier ones"
        )
    reply = full[len(prompt_ids) :]
    end = next((i for i, t in enumerate(reply) if t in stop), None)
    if end is None:
        raise DatasetError(
            f"{where}: the chat template of {name} ends the assistant's reply with no stop token "
            f"(ids {sorted(stop)}), so the model would never learn to stop; use plain prompt + completion rows "
            f"(EOS is appended), or a model whose template closes each turn with its end-of-turn token"
        )
    if end == 0:
        raise DatasetError(f"{where}: the reply renders to no tokens before the end of the turn; write a reply")
    return reply[: end + 1]


def transcript_target(
    tokenizer, completion: str, fmt: ToolFormat, end: list[int]
) -> tuple[list[int], list[int]]:
    """A tool-use transcript's reply tokens (each piece tokenized apart, as a rollout builds them; module
    docstring) followed by ``end``, and the positions in it of the observations' tokens."""
    ids: list[int] = []
    untrained: list[int] = []

    def encode(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"]) if piece else []

    for piece, by_model in fmt.split_transcript(completion):
        if by_model:
            ids += encode(piece)
            continue
        body = piece[len(fmt.before) : len(piece) - len(fmt.after)]
        tokens = encode(fmt.before) + encode(body) + encode(fmt.after)
        untrained += range(len(ids), len(ids) + len(tokens))
        ids += tokens
    return ids + end, untrained


def tokenize_examples(
    rows: list[PromptRow],
    text: ModelText,
    *,
    on_long: str = "error",
    source_key: str = "data.train",
    source: str = "",
    transcripts: ToolFormat | None = None,
    tool_tasks: frozenset[str] = frozenset(),
) -> Examples:
    """Every row as an `Example` (prompt + target ids, the target's start); see the module docstring.
    ``transcripts``: the tool-call format of the rows whose task is in ``tool_tasks``."""
    tokenizer = text.tokenizer
    stop = set(text.stop_token_ids)
    if tokenizer.eos_token_id is None:
        raise DatasetError(f"the tokenizer of {text.where} has no EOS token, so no reply can end; set eos_token")
    examples: list[Example] = []
    kept: list[PromptRow] = []
    long: list[tuple[PromptRow, int]] = []
    for row in rows:
        if row.completion is None:
            raise DatasetError(
                f"{source_key}={source!r}: {_where(row)} has no completion to learn: end its messages with an "
                f"assistant turn, or add \"completion\": \"...\""
            )
        try:
            prompt = encode_prompt(tokenizer, row.prompt, row.messages)
        except ValueError as exc:  # a chat row for a model without a chat template
            raise DatasetError(f"{_where(row)}: cannot tokenize its messages: {exc}") from None
        if row.prompt is not None:
            target = list(tokenizer(row.completion, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        else:
            target = chat_target(tokenizer, prompt, row.messages, row.completion, stop, _where(row))
        untrained: list[int] = []
        if transcripts is not None and row.task in tool_tasks:
            if row.prompt is None and tokenizer.decode(target[:-1]).strip() != row.completion.strip():
                raise DatasetError(
                    f"{_where(row)}: the chat template of {text.where} wraps the assistant's reply in more than its "
                    "end-of-turn token, so a tool-use transcript cannot be tokenized as rollouts build it; use "
                    "plain prompt + completion rows"
                )
            target, untrained = transcript_target(tokenizer, row.completion, transcripts, target[-1:])
        ids = prompt + target
        if not prompt:
            raise DatasetError(f"{_where(row)}: the prompt renders to no tokens; write a prompt")
        if text.context is not None and len(ids) > text.context:
            long.append((row, len(ids)))
            continue
        examples.append(Example(tuple(ids), len(prompt), tuple(len(prompt) + i for i in untrained)))
        kept.append(row)
    if long and on_long == "error":
        shown = [f"{_where(r)}: {n} tokens" for r, n in long[:_MAX_REPORTED_ERRORS]]
        more = f"\n  ... and {len(long) - len(shown)} more" if len(long) > len(shown) else ""
        raise DatasetError(
            f"{source_key}={source!r}: {len(long)} example(s) (prompt + reply) longer than the model's context of "
            f"{text.context} tokens (max_position_embeddings of {text.where}):\n  " + "\n  ".join(shown) + more
            + "\nshorten or remove these rows, or set sft.on_long=drop to skip them (nothing is cut short)"
        )
    if long:
        log.warning(
            "%s: dropped %d of %d examples longer than the context of %d tokens (sft.on_long=drop)",
            source_key, len(long), len(rows), text.context,
        )  # fmt: skip
    if not examples:
        raise DatasetError(f"{source_key}={source!r}: no example is left to learn from")
    return Examples(examples, kept, len(long))
