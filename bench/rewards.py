"""Reward throughput: math verifications/s and sandbox executions/s per backend, with 1 and 2 workers.

    python bench/rewards.py [--seconds 5] [--out bench/results/rewards.json]

Math: the `math` verifier through the RewardRunner's process pool, on LaTeX answers that math-verify must
really parse and compare (fractions, decimals, radicals; the verdict cache is off, so every call does the
work), and on the built-in arithmetic task's integer answers (the fast path). Sandbox: the same program as
bench/sandbox_throughput.py, per available backend.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sandbox_throughput import LIMITS, PROGRAM, STDIN, measure  # noqa: E402
from rewards import RewardsConfig, VerifierInput, VerifierSpec  # noqa: E402
from rewards.runner import RewardRunner  # noqa: E402
from sandbox import available_backends, execute  # noqa: E402


def latex_samples(n: int, rng: random.Random) -> list[VerifierInput]:
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(2, 99)
        gold = f"\\frac{{{a}}}{{{b}}}"
        pred = rng.choice([f"\\boxed{{\\frac{{{a}}}{{{b}}}}}", f"\\boxed{{{a / b:.6f}}}",
                           f"\\boxed{{\\frac{{{a + 1}}}{{{b}}}}}", f"\\boxed{{\\sqrt{{{a}}}}}"])
        out.append(VerifierInput("", pred, gold, {"task": "math"}))
    return out


def integer_samples(n: int, rng: random.Random) -> list[VerifierInput]:
    out = []
    for _ in range(n):
        gold = rng.randint(-100, 800)
        out.append(VerifierInput("", str(gold + rng.choice([0, 0, 1, -3, 10])), str(gold), {"task": "math"}))
    return out


def measure_math(kind: str, workers: int, seconds: float) -> dict:
    cfg = RewardsConfig(verifiers=[VerifierSpec(name="math", params={"cache_size": 0})], num_workers=workers)
    rng = random.Random(0)
    make = latex_samples if kind == "latex" else integer_samples
    with RewardRunner(cfg) as runner:
        runner.score(make(64, rng))  # warm-up: worker start and math-verify's first-call cost
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            scores, metrics = runner.score(make(256, rng))
            assert metrics["reward/error_rate"] == 0.0, metrics
            done += len(scores)
        elapsed = time.perf_counter() - start
    return {"what": f"math ({kind})", "workers": workers, "count": done, "seconds": round(elapsed, 3),
            "per_s": round(done / elapsed, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="measuring time per cell")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rewards.json"))
    args = parser.parse_args()
    rows = [measure_math(kind, w, args.seconds) for kind in ("latex", "integer") for w in (1, 2)]
    skipped = {}
    for backend, reason in available_backends().items():
        if reason is not None or backend == "none":
            skipped[backend] = reason or "not a sandbox"
            continue
        execute(PROGRAM, stdin=STDIN, limits=LIMITS, backend=backend)  # warm-up (docker: start the pool)
        for workers in (1, 2):
            r = measure(backend, workers, args.seconds)
            rows.append({"what": f"sandbox ({backend})", "workers": workers, "count": r["executions"],
                         "seconds": r["seconds"], "per_s": r["executions_per_s"],
                         "latency_p50_ms": r["latency_p50_ms"]})
    print(f"{'what':18} {'workers':>7} {'per s':>10} {'count':>7}")
    for r in rows:
        print(f"{r['what']:18} {r['workers']:>7} {r['per_s']:>10} {r['count']:>7}")
    for backend, reason in skipped.items():
        print(f"sandbox ({backend}): skipped ({reason})")
    report = {"bench": "rewards", "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                             "python": platform.python_version()},
              "results": rows, "skipped": skipped}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
