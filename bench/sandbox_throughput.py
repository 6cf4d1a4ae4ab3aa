"""Sandbox executions per second per backend, with 1 and 2 worker threads (the sandbox half of bench/rewards.py).

    python bench/sandbox_throughput.py [--seconds 5] [--backends bwrap,docker] [--out bench/results/sandbox_throughput.json]

Each execution runs a small program that reads stdin and prints (what a code-reward test case looks like).
A warm-up run per backend comes first, so docker numbers are for a warm pool (one `docker exec` each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandbox import Limits, available_backends, execute  # noqa: E402

PROGRAM = "import sys\nnums = [int(x) for x in sys.stdin.read().split()]\nprint(sum(nums))\n"
STDIN = " ".join(str(i) for i in range(1000))
EXPECTED = f"{sum(range(1000))}\n"
LIMITS = Limits(wall_s=10, memory_mb=256, max_processes=16)


def measure(backend: str, workers: int, seconds: float) -> dict:
    latencies: list[float] = []
    failures = 0
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker():
        nonlocal failures
        while time.monotonic() < stop:
            t = time.monotonic()
            result = execute(PROGRAM, stdin=STDIN, limits=LIMITS, backend=backend)
            with lock:
                latencies.append(time.monotonic() - t)
                failures += result.stdout != EXPECTED

    start = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    latencies.sort()
    return {
        "backend": backend,
        "workers": workers,
        "executions": len(latencies),
        "failures": failures,
        "seconds": round(elapsed, 3),
        "executions_per_s": round(len(latencies) / elapsed, 2),
        "latency_p50_ms": round(1000 * statistics.median(latencies), 1),
        "latency_p95_ms": round(1000 * latencies[int(0.95 * (len(latencies) - 1))], 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--seconds", type=float, default=5.0, help="measuring time per (backend, workers) cell"
    )
    parser.add_argument("--backends", default="bwrap,docker")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sandbox_throughput.json"))
    args = parser.parse_args()
    available = available_backends()
    rows, skipped = [], {}
    for backend in args.backends.split(","):
        if available.get(backend) is not None:
            skipped[backend] = available[backend]
            continue
        execute(PROGRAM, stdin=STDIN, limits=LIMITS, backend=backend)  # warm-up (docker: start the pool)
        for workers in (int(w) for w in args.workers.split(",")):
            rows.append(measure(backend, workers, args.seconds))
    header = (
        f"{'backend':8} {'workers':>7} {'exec/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'runs':>6} {'failed':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['backend']:8} {r['workers']:>7} {r['executions_per_s']:>8} {r['latency_p50_ms']:>8} "
            f"{r['latency_p95_ms']:>8} {r['executions']:>6} {r['failures']:>6}"
        )
    for backend, reason in skipped.items():
        print(f"{backend}: skipped ({reason})")
    report = {
        "bench": "sandbox_throughput",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "program": "sum of 1000 ints read from stdin",
        "results": rows,
        "skipped": skipped,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
