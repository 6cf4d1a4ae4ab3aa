"""Answer and program extraction time against completion length, on the degenerate shapes of a repetition loop.

    python bench/extraction.py [--max-chars 1048576] [--out bench/results/extraction.json]

For each shape (an unclosed ``\\boxed{x `` repeated, ``<answer>x `` repeated, "```python " repeated, and the
same with newlines) and each length from 1 KB to 1 MB, the time of: the math verifier's extraction over the
whole text (``max_scan_chars=None``), the same with the default cap (the last 64 Ki characters), the format
verifier's default pattern, and the code verifier's fenced-block extraction. Linear extraction shows as time
growing 2x per doubling; the capped columns stay flat past the cap.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rewards import VerifierInput, build_verifier  # noqa: E402
from rewards.code import extract_program  # noqa: E402
from rewards.math import EXTRACTIONS, MathVerifierConfig, extract_answer  # noqa: E402

SHAPES = {
    "boxed": "\\boxed{x ",
    "answer_tag": "<answer>x ",
    "fence": "```python ",
    "fence_lines": "```python\n",
}


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-chars", type=int, default=1 << 20)
    parser.add_argument("--out", type=Path, default=Path("bench/results/extraction.json"))
    args = parser.parse_args()
    methods = [m for m in EXTRACTIONS if m in ("boxed", "answer_tag", "last_line")]
    cap = MathVerifierConfig().max_scan_chars
    fmt = build_verifier("format")
    rows = []
    print("| shape | chars | math, whole text (ms) | math, capped (ms) | format (ms) | code fences (ms) |")
    print("|---|---|---|---|---|---|")
    for shape, unit in SHAPES.items():
        length = 1 << 10
        while length <= args.max_chars:
            text = unit * (length // len(unit))
            row = {
                "shape": shape,
                "chars": len(text),
                "math_whole_ms": 1e3 * best_of(lambda t=text: extract_answer(t, methods, None)),
                "math_capped_ms": 1e3 * best_of(lambda t=text: extract_answer(t, methods, cap)),
                "format_ms": 1e3 * best_of(lambda t=text: fmt(VerifierInput("", t, None, {}))),
                "code_ms": 1e3 * best_of(lambda t=text: extract_program(t)),
            }
            rows.append(row)
            print(
                f"| {shape} | {row['chars']} | {row['math_whole_ms']:.2f} | {row['math_capped_ms']:.2f} | "
                f"{row['format_ms']:.2f} | {row['code_ms']:.2f} |"
            )
            length *= 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "cap": cap, "machine": platform.platform()}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
