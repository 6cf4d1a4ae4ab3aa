"""Nestable wall-clock limits for the main thread, on ``signal.setitimer``.

math-verify's own timeouts call ``signal.alarm`` (whole seconds) and cancel any alarm already set on the way
out, so the verifiers here call math-verify with its timeouts off and use this instead: one ITIMER_REAL shared by
a stack of deadlines, always armed for the earliest one, so a verifier's own limit (``MathVerifierConfig.timeout_s``)
and the runner's per-sample limit can be nested.

Limits of the approach (why the runner also kills hung worker processes): a signal handler runs only between
Python bytecodes, so a hang inside one C call (a catastrophic regex, one huge integer operation) is not interrupted
here; and signals work only in the main thread, so off the main thread ``time_limit`` cannot enforce anything and
says so through ``can_enforce()``.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class TimeLimitExceeded(BaseException):
    """Raised in the main thread when a ``time_limit`` expires.

    A BaseException, like math-verify's own TimeoutException, so ``except Exception`` in verifier code (and in
    math-verify) does not swallow it.
    """

    def __init__(self, seconds: float, what: str) -> None:
        super().__init__(f"{what} exceeded its time limit of {seconds:g} s")
        self.seconds = seconds
        self.what = what


_stack: list[tuple[float, TimeLimitExceeded]] = []  # (deadline on time.monotonic, exception to raise)
_fired: set[int] = set()  # ids of exceptions already raised (each limit fires once)


def can_enforce() -> bool:
    """True where a limit can be enforced: in the main thread of the main interpreter."""
    return threading.current_thread() is threading.main_thread()


def _arm() -> None:
    pending = [d for d, e in _stack if id(e) not in _fired]
    if not pending:
        signal.setitimer(signal.ITIMER_REAL, 0)
        return
    signal.setitimer(signal.ITIMER_REAL, max(min(pending) - time.monotonic(), 1e-6))


def _handler(signum, frame) -> None:
    now = time.monotonic()
    expired = [(d, e) for d, e in _stack if d <= now and id(e) not in _fired]
    if not expired:
        _arm()  # woke early (timer rounding): re-arm for what is left
        return
    # The outermost expired limit wins: its owner is the one whose budget ran out. The limits nested inside it
    # are being unwound by its exception, so they are spent too: one of them firing during that unwinding (a
    # nested limit of about the same length) would replace the outer exception with one nobody handles.
    _, exc = expired[0]
    inner = next(i for i, (_, e) in enumerate(_stack) if e is exc)
    _fired.update(id(e) for _, e in _stack[inner:])
    _arm()
    raise exc


@contextmanager
def time_limit(seconds: float | None, what: str = "call") -> Iterator[TimeLimitExceeded | None]:
    """Raise ``TimeLimitExceeded`` in the body if it runs longer than ``seconds`` (None or <= 0: no limit).

    Yields the exception this limit raises, so a caller that handles its own limit can tell it from an outer one
    (``except TimeLimitExceeded as e: if e is not mine: raise``). Off the main thread this is a no-op and yields
    None (see ``can_enforce``); the runner's process pool is what makes limits hold there.
    """
    if seconds is None or seconds <= 0 or not can_enforce():
        yield None
        return
    exc = TimeLimitExceeded(seconds, what)
    entry = (time.monotonic() + seconds, exc)
    outermost = not _stack
    if outermost:  # someone else's SIGALRM handler and timer are put back on the way out
        previous = signal.getsignal(signal.SIGALRM)
        foreign_s, _ = signal.getitimer(signal.ITIMER_REAL)
        entered = time.monotonic()
        signal.signal(signal.SIGALRM, _handler)
    _stack.append(entry)
    try:
        _arm()
        yield exc
    finally:
        _stack.remove(entry)
        _fired.discard(id(exc))
        if not outermost:
            _arm()
        else:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
            if foreign_s > 0:
                signal.setitimer(signal.ITIMER_REAL, max(foreign_s - (time.monotonic() - entered), 1e-6))
