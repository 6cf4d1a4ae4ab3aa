"""The nestable SIGALRM time limit that replaces math-verify's own (which cancels outer alarms)."""

import signal
import threading
import time

import pytest

from rewards.time_limit import TimeLimitExceeded, time_limit


def _spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_limit_interrupts_a_python_loop():
    with pytest.raises(TimeLimitExceeded), time_limit(0.05):
        _spin(5)  # ends without an exception (and fails the test) unless the limit interrupts it


def test_no_limit_when_the_body_is_fast_and_state_is_restored():
    before = signal.getsignal(signal.SIGALRM)
    timer_before, _ = signal.getitimer(signal.ITIMER_REAL)  # pytest-timeout's own alarm, if it set one
    with time_limit(1.0):
        pass
    assert signal.getsignal(signal.SIGALRM) is before
    timer_after, _ = signal.getitimer(signal.ITIMER_REAL)
    assert (timer_after == 0.0) if timer_before == 0.0 else (0 < timer_after <= timer_before)


def test_inner_limit_fires_first_and_outer_stays_armed():
    with time_limit(0.3, "outer") as outer:
        with pytest.raises(TimeLimitExceeded) as info, time_limit(0.05, "inner") as inner:
            _spin(5)
        assert info.value is inner
        with pytest.raises(TimeLimitExceeded) as info:
            _spin(5)
        assert info.value is outer


def test_outer_limit_wins_when_it_expires_first():
    with pytest.raises(TimeLimitExceeded) as info, time_limit(0.05, "outer") as outer:
        with time_limit(10, "inner"):
            _spin(5)
    assert info.value is outer


def test_an_inner_limit_just_after_the_outer_never_replaces_its_exception():
    # The math verifier's own limit nested in the runner's, both 2 s (seen in bench/fuzz_rewards.py): the outer
    # fired, and the inner, armed a moment later, fired while the inner owner was unwinding, so an exception
    # nobody handled killed the reward worker. Here the inner owner re-raises what is not its own, slowly.
    for _ in range(5):
        with pytest.raises(TimeLimitExceeded) as info, time_limit(0.05, "outer") as outer:
            with time_limit(0.0501, "inner") as inner:
                try:
                    _spin(5)
                except TimeLimitExceeded as e:
                    assert e is not inner
                    _spin(0.05)  # the inner deadline passes while its owner handles the outer exception
                    raise
        assert info.value is outer


def test_off_the_main_thread_it_is_a_no_op():
    seen = []

    def body():
        with time_limit(0.01) as exc:
            time.sleep(0.05)
        seen.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [None]


def test_a_foreign_timer_and_handler_are_put_back():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with time_limit(5.0):
            pass
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 0.3
        time.sleep(0.5)
        assert fired == [1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
