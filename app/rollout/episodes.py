"""The multi-turn episode driver: generate -> tool -> append tokens -> generate, over any rollout engine.

`Episodes.generate(prompts, params, allowed)` returns the same prompt-major list of completions as an engine's
``generate``, each a `Trajectory` handed over as a `Completion` (app/rollout/trajectory.py): training and
`trustbatch eval` take it as they take a single-turn answer. One episode, for each of the ``params.n`` samples of
a prompt whose row may call tools (``allowed``):

    while the budget lasts:
        sample the model's next tokens, pausing at a token that may end a call (the format's marker)
        append them (sampled: their logprobs and the version that sampled them)
        the model ended its reply (EOS / end of turn) -> status answered
        a complete call -> run it in the tool pool -> append the observation's tokens (not sampled)
        no call yet (an opening ```, or a block that is not python) -> keep sampling, same turn

Tokens in, tokens out: the engine's output ids are appended as they are, and generation continues from the ids,
never from decoded text. The text of the model's turn is decoded only to find the call in it. An observation is
encoded once, from its text alone, and cut to ``max_output_tokens`` with its head and tail kept.

Budgets are tokens: ``max_total_tokens`` after the prompt for the whole trajectory (model and tool tokens, and
never past the model's context), ``max_new_tokens`` for each request, ``max_turns`` model turns; a call made on
the last turn ends the episode as ``max_turns``. Every episode ends with a status (trajectory.STATUSES).

Batching without waiting for tools: the episodes' requests go to the engine together, as one ``generate`` per
distinct request size, whenever a sending slot is free (``in_flight`` slots); an episode whose tool is running
simply joins a later request, so one slow tool holds up no other trajectory. Requests carry no seed: which
requests share a batch depends on when tools return, so tool runs are not bitwise reproducible (docs/tools.md).

Rows whose task has no tool (``allowed`` False) are answered in one request, as without tools.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from app.rollout.base import Completion, SamplingParams
from app.rollout.trajectory import Trajectory
from tools.formats import MalformedCall, ToolFormat, observation_body
from tools.pool import ToolPool
from tools.types import ToolCall, ToolResult

ANSWER_MARK = "\\boxed"
"""A model turn holding this counts as a final answer (not a void turn)."""


@dataclass(frozen=True)
class EpisodeText:
    """The tokenizer's part: text <-> ids, and the token ids that pause or end generation."""

    encode: Callable[[str], list[int]]
    """Text -> ids with no special tokens added (an observation's tokens)."""
    decode: Callable[[list[int]], str]
    pause_ids: tuple[int, ...]
    """Tokens whose text holds the end of the format's call marker: generation pauses there for `parse`."""
    end_ids: tuple[int, ...]
    """EOS and end-of-turn tokens: the model's reply is over."""


@dataclass(frozen=True)
class EpisodeSettings:
    """The budgets of one episode (``rollout.*`` of the run config)."""

    max_turns: int = 4
    max_total_tokens: int = 512
    max_output_tokens: int = 128
    context: int | None = None
    """The model's context (prompt + trajectory never passes it)."""
    drop_void_turns: bool = False
    in_flight: int = 2

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 1 or self.max_output_tokens < 8 or self.in_flight < 1:
            raise ValueError(
                f"episode settings need max_turns >= 1, max_total_tokens >= 1, max_output_tokens >= 8 and "
                f"in_flight >= 1; got {self}"
            )


class _Batcher:
    """Sends the waiting turn requests of all episodes together (module docstring, "Batching")."""

    def __init__(self, generate, params: SamplingParams, pause_ids: tuple[int, ...], in_flight: int) -> None:
        self._generate = generate
        self._params, self._pause_ids = params, pause_ids
        self._waiting: dict[tuple[int, bool], list[tuple[list[int], asyncio.Future]]] = {}
        self._slots = asyncio.Semaphore(in_flight)
        self._sender: asyncio.Task | None = None
        self._sends: set[asyncio.Task] = set()

    async def sample(self, ids: list[int], max_new_tokens: int, pause: bool) -> Completion:
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault((max_new_tokens, pause), []).append((ids, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_waiting())
        return await future

    def params(self, max_new_tokens: int, pause: bool) -> SamplingParams:
        stops = self._params.stop_token_ids + (self._pause_ids if pause else ())
        return replace(self._params, n=1, max_new_tokens=max_new_tokens, stop_token_ids=tuple(dict.fromkeys(stops)),
                       seed=None)  # fmt: skip

    async def _send_waiting(self) -> None:
        while self._waiting:
            await self._slots.acquire()
            await asyncio.sleep(0)  # requests made in this event-loop turn join the batch
            if not self._waiting:
                self._slots.release()
                break
            key, items = self._waiting.popitem()
            task = asyncio.create_task(self._send(key, items))
            self._sends.add(task)
            task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task) -> None:
        self._sends.discard(task)
        self._slots.release()

    async def _send(self, key: tuple[int, bool], items: list[tuple[list[int], asyncio.Future]]) -> None:
        try:
            completions = await self._generate([ids for ids, _ in items], self.params(*key))
        except asyncio.CancelledError:
            for _, future in items:
                future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - every episode waiting on this request hears of it
            for _, future in items:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), completion in zip(items, completions, strict=True):
            if not future.done():
                future.set_result(completion)

    async def close(self) -> None:
        tasks = [t for t in (self._sender, *self._sends) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Episodes:
    """Multi-turn rollouts over ``generate`` (an engine's or the fleet's), with a format, a tool pool and budgets."""

    def __init__(self, generate, text: EpisodeText, fmt: ToolFormat, pool: ToolPool, settings: EpisodeSettings):
        self._generate = generate
        self.text, self.fmt, self.pool, self.settings = text, fmt, pool, settings

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        allowed: Sequence[bool],
        *,
        progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """``params.n`` trajectories of every prompt, prompt-major; ``allowed[i]``: prompt i's row may call tools.
        What each episode did is in its completion's ``meta`` (trajectory.trajectory_metrics sums it up)."""
        if len(allowed) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(allowed)} tool flags")
        batcher = _Batcher(self._generate, params, self.text.pause_ids, self.settings.in_flight)
        jobs = [
            asyncio.create_task(self._episode(batcher, prompt, params.max_new_tokens, ok, progress))
            for prompt, ok in zip(prompts, allowed, strict=True)
            for _ in range(params.n)
        ]
        try:
            trajectories = await asyncio.gather(*jobs)
        except BaseException:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            raise
        finally:
            await batcher.close()
        drop = self.settings.drop_void_turns
        return [t.to_completion(train=not (drop and t.void_turns > 0)) for t in trajectories]

    async def _episode(
        self, batcher: _Batcher, prompt: list[int], max_new_tokens: int, allowed: bool,
        progress: Callable[[int], None] | None,
    ) -> Trajectory:  # fmt: skip
        s, start = self.settings, time.perf_counter()
        trajectory, turn, turn_text = Trajectory(list(prompt)), 0, ""
        budget = s.max_total_tokens if allowed else max_new_tokens
        if s.context is not None:
            budget = min(budget, s.context - len(prompt))
        while trajectory.status is None:
            room = budget - len(trajectory)
            if room <= 0:
                trajectory.status = "budget"
                break
            trajectory.requests += 1
            completion = await batcher.sample(list(prompt) + trajectory.ids, min(max_new_tokens, room), allowed)
            if trajectory.start_version is None:
                trajectory.start_version = completion.policy_version
            trajectory.append(completion.output_ids, sampled=True, turn=turn, version=completion.policy_version,
                              logprobs=completion.output_logprobs)  # fmt: skip
            turn_text += self.text.decode(completion.output_ids)
            last = completion.output_ids[-1] if completion.output_ids else None
            if completion.finish_reason == "abort":
                trajectory.status = "abort"
            elif completion.finish_reason == "stop" and last in self.text.end_ids:
                trajectory.status = "answered"
            elif completion.finish_reason != "stop" or not allowed or last not in self.text.pause_ids:
                trajectory.status = "budget"  # the request's own cap, the total budget or the context
            else:
                call = self.fmt.parse(turn_text)
                if call is None:
                    continue  # an opening fence, or a block that is not a call: the same turn goes on
                if turn + 1 >= s.max_turns:
                    trajectory.status = "max_turns"
                    break
                wait = time.perf_counter()
                result = await self._call(call)
                trajectory.tool_wait_s += time.perf_counter() - wait
                observation, cut = self._observation_ids(result)
                status = "malformed" if isinstance(call, MalformedCall) else result.status
                trajectory.tool_calls.append(
                    {"turn": turn, "tool": getattr(call, "name", None), "status": status, "tokens": len(observation),
                     "cut": cut, "reason": result.detail.get("reason")}
                )  # fmt: skip
                if result.detail.get("reason") in ("sandbox", "refused"):
                    trajectory.status = "tool_error"  # no tool can run: the answer ends here
                    break
                trajectory.append(observation[: max(budget - len(trajectory), 0)], sampled=False, turn=turn)
                turn, turn_text = turn + 1, ""
        if allowed and trajectory.status in ("answered", "budget") and ANSWER_MARK not in turn_text:
            trajectory.void_turns = 1
        trajectory.wall_s = time.perf_counter() - start
        if progress is not None:
            progress(1)
        return trajectory

    async def _call(self, call: ToolCall | MalformedCall) -> ToolResult:
        if isinstance(call, MalformedCall):
            return ToolResult(f"error: {call.message}", "error", {"reason": "malformed"})
        return await self.pool.call(call)

    def _observation_ids(self, result: ToolResult) -> tuple[list[int], bool]:
        """The observation's tokens, ``before + body + after`` each encoded alone (as supervised fine-tuning
        encodes a written transcript), the body cut to ``max_output_tokens`` with its head and tail kept; and
        whether it was cut."""
        limit = self.settings.max_output_tokens
        body = self.text.encode(observation_body(result))
        cut = len(body) > limit
        if cut:
            guess = self.text.encode(f"\n[... {len(body)} tokens cut ...]\n")  # the marker's length, near enough
            keep = max(limit - len(guess), 2)
            marker = self.text.encode(f"\n[... {len(body) - keep} tokens cut ...]\n")
            body = body[: keep // 2] + marker + body[len(body) - (keep - keep // 2) :]
        return self.text.encode(self.fmt.before) + body + self.text.encode(self.fmt.after), cut
