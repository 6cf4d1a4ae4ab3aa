"""Evaluation progress: completions done, rate and time left, also while nothing finishes (a slow first batch)."""

from __future__ import annotations

import logging
import threading
import time

from app.evaluation.run import Progress


def test_progress_logs_a_heartbeat_while_waiting_and_a_last_line_with_the_total(caplog):
    caplog.set_level(logging.INFO, logger="trustbatch")
    progress = Progress("eval at step 3 (sampled)", total=40, every_s=0.05)
    deadline = time.monotonic() + 10
    while not caplog.records and time.monotonic() < deadline:  # nothing done yet: the heartbeat still speaks
        time.sleep(0.01)
    assert caplog.records and "0/40 completions" in caplog.records[0].getMessage()
    threads = [threading.Thread(target=lambda: [progress(1) for _ in range(10)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    progress.close()
    last = caplog.records[-1].getMessage()
    assert last.startswith("eval at step 3 (sampled): 40/40 completions, ") and "left" not in last
    count = len(caplog.records)
    time.sleep(0.2)
    assert len(caplog.records) == count  # closed: the heartbeat stopped


def test_the_line_gives_the_rate_and_the_time_left():
    progress = Progress("eval", total=100, every_s=60)
    progress.t0 -= 10.0  # 10 s ago
    progress(25)
    line = progress.line()
    progress.close()
    assert line.startswith("eval: 25/100 completions, 2.5/s, 10 s, about 30 s left")


def test_before_anything_returns_the_line_says_the_time_left_is_unknown_not_nan():
    progress = Progress("eval", total=800, every_s=60)
    progress.t0 -= 90.0  # an engine that reports whole batches: nothing back after 90 s
    line = progress.line()
    progress.close()
    assert line == "eval: 0/800 completions, 0.0/s, 90 s, time left unknown until the first completions return"
