"""`ToolPool`: tool calls run off the event loop, a bounded number at a time, each within a wall-clock limit.

The episode driver awaits ``pool.call(call)`` for each call the model makes; other trajectories keep generating
meanwhile. Every call ends, whatever the tool does:
- at most ``concurrency`` calls run at once (a semaphore; the rest wait their turn);
- a call still running after ``timeout_s`` is abandoned: the model gets a timeout observation at once. The
  built-in python tool cannot outlive its own sandbox limit; a user tool's thread runs on until it returns, and
  while ``max_abandoned`` such threads are still running, further calls are refused with an error observation
  instead of queueing behind them (threads cannot be killed; a tool that can hang should bound itself);
- an exception, a wrong return type or an oversized output becomes an ``error`` result, never a raised error;
- each call runs in a daemon thread of its own, so a call still running never keeps the process from exiting;
  `close` stops taking calls, and a cancelled episode's call is given up with it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from tools.types import Tool, ToolCall, ToolResult

MAX_OUTPUT_CHARS = 65536
"""A tool's output longer than this is cut (head and tail kept) before the driver tokenizes it."""


def cut_middle(text: str, limit: int, marker: str) -> str:
    """``text`` with its middle replaced by ``marker`` so that at most ``limit`` characters of it remain."""
    if len(text) <= limit:
        return text
    head = limit // 2
    return text[:head] + marker + text[len(text) - (limit - head) :]


def _run(tool: Tool, call: ToolCall) -> ToolResult:
    try:
        result = tool(call)
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt from a tool are its failure too
        return ToolResult(f"the tool failed: {type(exc).__name__}: {exc}"[:2000], "error", {"reason": "raised"})
    if not isinstance(result, ToolResult):
        return ToolResult(f"the tool returned {type(result).__name__}, not a ToolResult", "error",
                          {"reason": "bad return"})  # fmt: skip
    if not isinstance(result.output, str):
        return ToolResult("the tool returned a non-text output", "error", {"reason": "bad return"})
    if len(result.output) > MAX_OUTPUT_CHARS:
        cut = cut_middle(result.output, MAX_OUTPUT_CHARS, f"\n[... {len(result.output):,} characters, cut ...]\n")
        return ToolResult(cut, result.status, {**result.detail, "output_chars": len(result.output)})
    return result


class ToolPool:
    """Runs the calls of a run's tools (module docstring). Create and use it inside one event loop."""

    def __init__(self, tools: dict[str, Tool], *, concurrency: int = 8, timeout_s: float = 30.0,
                 max_abandoned: int = 4) -> None:  # fmt: skip
        if concurrency < 1 or not timeout_s > 0 or max_abandoned < 0:
            raise ValueError(
                f"ToolPool needs concurrency >= 1, timeout_s > 0 and max_abandoned >= 0; got {concurrency}, "
                f"{timeout_s}, {max_abandoned}"
            )
        self.tools = dict(tools)
        self.concurrency, self.timeout_s, self.max_abandoned = concurrency, float(timeout_s), max_abandoned
        self.closed = False
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self.abandoned_running = 0
        """Timed-out calls whose thread has not returned yet."""
        self.counts: Counter[str] = Counter()
        """calls, ok, error, timeout, refused: all tools together."""
        self.busy_s = 0.0
        """Seconds summed over calls, from start to result (what `tools/time_s` reports)."""

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call; always returns a result (module docstring)."""
        self.counts["calls"] += 1
        if self.closed:
            raise RuntimeError("the tool pool is closed")
        tool = self.tools.get(call.name)
        if tool is None:
            self.counts["error"] += 1
            return ToolResult(f"there is no tool named {call.name!r}; the tools are {sorted(self.tools)}", "error",
                              {"reason": "unknown tool"})  # fmt: skip
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # a semaphore serves one event loop
            self._slots, self._slots_loop = asyncio.Semaphore(self.concurrency), loop
        async with self._slots:
            if self.abandoned_running >= self.max_abandoned:
                self.counts["refused"] += 1
                self.counts["error"] += 1
                return ToolResult(f"the tool is unavailable: {self.abandoned_running} earlier calls hung", "error",
                                  {"reason": "refused"})  # fmt: skip
            start = time.perf_counter()
            future = self._start(loop, tool, call)
            try:
                async with asyncio.timeout(self.timeout_s):
                    result = await asyncio.shield(future)
            except TimeoutError:
                self.abandoned_running += 1
                future.add_done_callback(self._returned)
                result = ToolResult(f"(stopped: the tool took more than {self.timeout_s:g} s)", "timeout",
                                    {"reason": "pool timeout"})  # fmt: skip
            finally:
                self.busy_s += time.perf_counter() - start
        self.counts[result.status] += 1
        return result

    def _start(self, loop: asyncio.AbstractEventLoop, tool: Tool, call: ToolCall) -> asyncio.Future:
        """Run the call in a daemon thread of its own (a thread pool's workers are joined at interpreter exit, so
        one hung tool would keep the process alive); its result comes back to ``loop``."""
        future = loop.create_future()

        def deliver(result: ToolResult) -> None:
            if not future.done():
                future.set_result(result)

        def work() -> None:
            result = _run(tool, call)
            if not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(deliver, result)
                except RuntimeError:  # the loop closed meanwhile: nobody waits for this result
                    pass

        threading.Thread(target=work, name=f"tool-{call.name}", daemon=True).start()
        return future

    def _returned(self, _future) -> None:
        self.abandoned_running -= 1

    def close(self) -> None:
        """Stop taking calls. A call still running finishes in its daemon thread, unwaited; it never keeps the
        process from exiting."""
        self.closed = True
