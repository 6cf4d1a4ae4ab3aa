"""Where the test suite's wall time goes, from the per-phase times tests/conftest.py writes ($TRUSTBATCH_TEST_TIMES).

`make test` runs two pytest-xdist workers; the heavy tests (tests/conftest.py, HEAVY) run one after another on one
of them. The suite's wall time is therefore at least the heavy group's own time, and a worker that ends early
idles. This prints, per worker: its first start, its last stop, its busy time (the sum of its tests' phases) and
its idle time inside that span; then the heavy group's busy time against the rest, and the slowest tests (setup +
call + teardown).

    TRUSTBATCH_TEST_TIMES=/tmp/times.jsonl make test
    .venv/bin/python bench/ci_times.py /tmp/times.jsonl [--top 25]

`.ci/run` does both and prints the summary after the tests.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

HEAVY_SUFFIX = "@heavy"


def summarize(rows: list[dict], top: int) -> list[str]:
    by_test: dict[str, float] = defaultdict(float)
    workers: dict[str, dict[str, float]] = defaultdict(lambda: {"start": float("inf"), "stop": 0.0, "busy": 0.0})
    heavy = rest = 0.0
    for row in rows:
        by_test[row["nodeid"]] += row["duration"]
        w = workers[row["worker"]]
        if row.get("start") is not None:
            w["start"], w["stop"] = min(w["start"], row["start"]), max(w["stop"], row["stop"])
        w["busy"] += row["duration"]
        if row["nodeid"].endswith(HEAVY_SUFFIX):
            heavy += row["duration"]
        else:
            rest += row["duration"]
    first = min((w["start"] for w in workers.values()), default=0.0)
    lines = [f"{len(by_test)} tests; wall (first start to last stop) "
             f"{max((w['stop'] for w in workers.values()), default=0.0) - first:.0f} s"]  # fmt: skip
    for name, w in sorted(workers.items()):
        span = w["stop"] - w["start"]
        lines.append(f"  worker {name}: from +{w['start'] - first:.0f} s to +{w['stop'] - first:.0f} s, busy "
                     f"{w['busy']:.0f} s, idle {max(span - w['busy'], 0.0):.0f} s inside its span")  # fmt: skip
    lines.append(f"heavy group ({sum(1 for t in by_test if t.endswith(HEAVY_SUFFIX))} tests): {heavy:.0f} s busy; "
                 f"the rest: {rest:.0f} s")  # fmt: skip
    lines.append(f"slowest {top} (setup + call + teardown):")
    for nodeid, seconds in sorted(by_test.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {seconds:7.1f} s  {nodeid}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("times", type=Path, help="the JSON-lines file of $TRUSTBATCH_TEST_TIMES")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if not args.times.is_file():
        raise SystemExit(f"{args.times}: no such file; run the suite with TRUSTBATCH_TEST_TIMES={args.times}")
    rows = [json.loads(line) for line in args.times.read_text().splitlines() if line.strip()]
    print("\n".join(summarize(rows, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
