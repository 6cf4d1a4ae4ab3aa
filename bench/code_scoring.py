"""Code-reward throughput as training sees it: completions of builtin:python_functions scored by the `code`
verifier through the RewardRunner's worker pool, per sandbox backend, with a completion's assert tests in one
grader run (`batch_tests: true`, the default) against one run per test.

    python bench/code_scoring.py [--samples 96] [--workers 2] [--out bench/results/code_scoring.json]

The completions are each problem's reference solution in a ```python block (so every test runs to its end) and,
for a third of them, a wrong function (so failures are graded too), 3 tests each, like one training step of
configs/smollm2-code.yaml (4 prompts x 8 samples = 32 completions; --samples 96 is three steps). Reported: the
wall time to score the batch, completions/s and tests/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.data.tasks import PythonFunctionsConfig, python_function_prompts  # noqa: E402
from rewards import RewardsConfig, VerifierInput, VerifierSpec  # noqa: E402
from rewards.runner import RewardRunner  # noqa: E402
from sandbox import available_backends  # noqa: E402


def completions(n: int) -> list[VerifierInput]:
    rows = python_function_prompts(PythonFunctionsConfig(), "train", n)
    out = []
    for i, row in enumerate(rows):
        code = row.metadata["solution"]
        if i % 3 == 2:  # a wrong body: the tests fail
            code = code.split("\n", 1)[0] + "\n    return None\n"
        out.append(VerifierInput("", f"```python\n{code}```", row.tests, row.metadata))
    return out


def measure(backend: str, batch: bool, samples: list[VerifierInput], workers: int) -> dict:
    params = {"backend": backend, "batch_tests": batch, "require_code_block": True, "cpu_s": 2.0}
    cfg = RewardsConfig(verifiers=[VerifierSpec(name="code", tasks=["code"], params=params, timeout_s=30.0)],
                        num_workers=workers)  # fmt: skip
    runner = RewardRunner(cfg)
    try:
        runner.score(samples[:4], ["code"] * 4)  # warm: workers started, the Docker image cached
        t0 = time.perf_counter()
        scores, _ = runner.score(samples, ["code"] * len(samples))
        wall = time.perf_counter() - t0
    finally:
        runner.close()
    tests = sum(len(s.reference) for s in samples)
    errors = sum(s.error is not None for s in scores)
    return {
        "backend": backend,
        "batch_tests": batch,
        "workers": workers,
        "completions": len(samples),
        "tests": tests,
        "errors": errors,
        "correct": sum(bool(s.correct) for s in scores),
        "wall_s": wall,
        "completions_per_s": len(samples) / wall,
        "tests_per_s": tests / wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "code_scoring.json"))
    args = parser.parse_args()
    samples = completions(args.samples)
    rows = []
    for backend, reason in available_backends().items():
        if reason is not None:
            print(f"{backend}: unavailable ({reason})")
            continue
        for batch in (False, True):
            r = measure(backend, batch, samples, args.workers)
            rows.append(r)
            print(f"{backend:7s} batch_tests={str(batch):5s}: {r['completions']} completions ({r['tests']} tests) in "
                  f"{r['wall_s']:.2f} s = {r['completions_per_s']:.1f} completions/s, {r['tests_per_s']:.1f} "
                  f"tests/s; {r['correct']} correct, {r['errors']} errors")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    out.write_text(json.dumps({"rows": rows, "load_1min_at_end": load, "cpus": os.cpu_count(),
                               "platform": platform.platform()}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out} (load average {load:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
