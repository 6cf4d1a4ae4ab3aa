"""Ctrl-C and SIGTERM: the first signal stops a command cleanly and says so at once; a second stops it now.

`train`, `sft`, `eval` and `serve` run under a `Stopping`. On the first SIGINT or SIGTERM it writes, right away,
that the command is stopping and what it waits for, and calls the command's ``on_first`` (the training loop
cancels its work; with ``checkpoint.on_stop`` it lets the step in progress finish and checkpoints it). The
command then stops its children itself: rollout servers (each in a process group of its own, so a terminal's
Ctrl-C reaches the trainer alone and the trainer decides when they stop), reward workers, the tool pool's
sandbox containers; marks its MLflow run KILLED; and exits with 128 + the signal (130 for Ctrl-C). A second
signal kills the registered children and exits at once, without cleaning up the rest.

Blocking calls of the asynchronous commands run in `DaemonThreads`, the event loop's default executor: a thread
still busy (a training step, a generation) never holds the process back once the command has stopped, which an
asyncio worker thread would (asyncio.run joins them at exit: a stopped run used to sit out its step).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """The command stopped on a signal; the CLI exits 128 + signal. A BaseException, as KeyboardInterrupt is:
    raised from a signal handler at any point, it must pass through libraries' ``except Exception`` (MLflow's
    store wraps those) up to the command, which cleans up and marks its run KILLED."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Stopping:
    """Signal handling of one command (module docstring). ``waiting``: what the command waits for once asked to
    stop, as a phrase or a function giving one. ``on_first``: called once, on the first signal (in the main thread,
    or in the event loop with `install_in_loop`). ``kill``: called on the second signal before exiting at once."""

    def __init__(self, command: str, *, waiting: str | Callable[[], str], on_first: Callable[[int], None],
                 kill: Callable[[], None] = lambda: None) -> None:  # fmt: skip
        self.command, self.waiting, self.on_first, self.kill = command, waiting, on_first, kill
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _say(self, text: str) -> None:
        with contextlib.suppress(OSError):
            os.write(sys.stderr.fileno(), f"\n{text}\n".encode())

    def handle(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
            waiting = self.waiting() if callable(self.waiting) else self.waiting
            self._say(f"trustbatch {self.command}: {signal.Signals(signum).name}: stopping; {waiting}. "
                      "Press Ctrl-C again to stop at once.")  # fmt: skip
            self.on_first(signum)
            return
        self._say(f"trustbatch {self.command}: {signal.Signals(signum).name} again: stopping now")
        with contextlib.suppress(Exception):
            self.kill()
        os._exit(128 + (self.signum or signum))

    @contextlib.contextmanager
    def installed(self) -> Iterator[Stopping]:
        """Handle SIGINT and SIGTERM in the main thread for the duration (restored after)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, lambda s, _frame: self.handle(s))
        try:
            yield self
        finally:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)

    def install_in_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Handle SIGINT and SIGTERM in ``loop`` (its wakeup fd wakes it at once); `remove_from_loop` undoes it."""
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.handle, sig)

    def remove_from_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in SIGNALS:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


class DaemonThreads(ThreadPoolExecutor):
    """An executor of daemon threads, one per call: what an asynchronous command's event loop uses for its blocking
    calls (module docstring). `shutdown` waits for them, unless `abandon` was called: then it returns at once. (A
    ThreadPoolExecutor only by type, which asyncio requires of a default executor; none of its workers start.)"""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._abandoned = False

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=f"trustbatch-{getattr(fn, '__name__', 'call')}", daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()
        return future

    def abandon(self) -> None:
        """Threads still running are left to the interpreter's exit (the command is stopping)."""
        self._abandoned = True

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if not wait or self._abandoned:
            return
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join()
