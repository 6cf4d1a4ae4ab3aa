"""Fuzz the reward runner: 10,000 hostile completions, one at a time, timed per sample.

    python bench/fuzz_rewards.py [--n 10000] [--seed 0] [--backend auto] [--math-timeout 5]
                                 [--out bench/results/fuzz_rewards.json]

The samples come from tests/fuzz_inputs.py (the suite's fuzz test draws 1,200 from the same generator): garbage
bytes, expression bombs, odd unicode, megabyte repetition loops, mixtures and code-grader hacks. Each goes
through a real RewardRunner (one worker process, math-verify, the sandbox) on its own, so the time of every
sample is measured. Printed: exceptions that escaped the runner, worker restarts (a hang killed from outside or
a crashed worker), timeouts, the error rate, samples rewarded although nothing in them may pass, and the
p50 / p99 / max seconds per sample, overall and per kind, against the time limit. Expression bombs cost up to
the math limit each (a verdict cache keeps repeats cheap, until a worker is killed), so the run's length is
mostly --math-timeout times the number of distinct bombs and bomb-laden mixtures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rewards import RewardsConfig, VerifierSpec  # noqa: E402
from rewards.runner import RewardRunner  # noqa: E402
from tests.fuzz_inputs import hostile_samples  # noqa: E402

CODE_TIMEOUT_S = 20.0


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", help="sandbox backend for the code samples")
    parser.add_argument(
        "--math-timeout", type=float, default=5.0, help="the math verifier's timeout_s (the runner's is twice it)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/fuzz_rewards.json"))
    args = parser.parse_args()
    math_timeout_s = args.math_timeout

    cfg = RewardsConfig(
        verifiers=[
            VerifierSpec(name="math", tasks=["math"], params={"timeout_s": math_timeout_s}),
            VerifierSpec(name="format", weight=0.0, tasks=["math"]),
            VerifierSpec(
                name="code", tasks=["code"], timeout_s=CODE_TIMEOUT_S, params={"backend": args.backend}
            ),
        ],
        num_workers=1,
        timeout_s=2 * math_timeout_s,  # the runner's limit outside the verifier's own, as in the defaults (5 s / 10 s)
    )
    samples = hostile_samples(args.n, seed=args.seed)
    times: dict[str, list[float]] = defaultdict(list)
    escaped, restarts, timeouts, errors, rewarded = 0, 0, Counter(), Counter(), []
    start = time.perf_counter()
    with RewardRunner(cfg) as runner:
        for i, item in enumerate(samples):
            t = time.perf_counter()
            try:
                (score,), metrics = runner.score([item.sample], [item.task])
            except Exception as e:  # noqa: BLE001 - counting what escapes is the point
                escaped += 1
                print(f"sample {i} ({item.kind}): {type(e).__name__}: {e}", file=sys.stderr)
                continue
            times[item.kind].append(time.perf_counter() - t)
            restarts += int(metrics["reward/worker_restarts"])
            if score.error:
                errors[item.kind] += 1
                if "timeout" in score.error:
                    timeouts[item.kind] += 1
            if score.reward != 0 and not item.may_pass:
                rewarded.append((i, item.kind, item.sample.completion[:100]))
            if (i + 1) % 1000 == 0:
                print(f"  {i + 1}/{len(samples)} samples, {time.perf_counter() - start:.0f} s", flush=True)
    total_s = time.perf_counter() - start

    everything = [x for values in times.values() for x in values]
    rows = []
    for kind in sorted(times) + ["all"]:
        values = everything if kind == "all" else times[kind]
        rows.append(
            {
                "kind": kind,
                "samples": len(values),
                "errors": sum(errors.values()) if kind == "all" else errors[kind],
                "timeouts": sum(timeouts.values()) if kind == "all" else timeouts[kind],
                "p50_s": quantile(values, 0.5),
                "p99_s": quantile(values, 0.99),
                "max_s": max(values) if values else float("nan"),
            }
        )
    print(
        f"\n{len(samples)} samples in {total_s:.0f} s (load average {os.getloadavg()[0]:.2f}); math check limit "
        f"{math_timeout_s:g} s inside a {2 * math_timeout_s:g} s runner limit, code limit {CODE_TIMEOUT_S:g} s"
    )
    print(
        f"exceptions out of the runner: {escaped}   worker restarts: {restarts}   rewarded: {len(rewarded)}"
    )
    print("\n| kind | samples | errors | timeouts | p50 s | p99 s | max s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kind']} | {r['samples']} | {r['errors']} ({r['errors'] / max(1, r['samples']):.1%}) | "
            f"{r['timeouts']} | {r['p50_s']:.4f} | {r['p99_s']:.3f} | {r['max_s']:.2f} |"
        )
    for i, kind, text in rewarded[:10]:
        print(f"REWARDED sample {i} ({kind}): {text!r}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "n": len(samples),
                "seed": args.seed,
                "escaped": escaped,
                "worker_restarts": restarts,
                "rewarded": len(rewarded),
                "total_s": total_s,
                "rows": rows,
                "machine": platform.platform(),
                "load_average": os.getloadavg()[0],
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
