"""What the weight-publication check (app/rollout/probe.py) can see on a real model: its gaps, measured.

For a sequence of versions of one model (HF directories: a start model, then the versions a run published, in
order), with the probe text of the check:
- the engine's own gap: each version served by the embedded engine (the built-in server's engine) in float32
  and in bfloat16, scored against the trainer's float32 reference of the same version;
- what staleness looks like: the engine holding an older version (one version back, k versions back, the start
  model) scored against the newest version's reference, in each dtype;
- the tolerance the check would set at the start in each dtype (2x the start gap, at least 1e-3), and so
  which of those stale engines it catches.

    .venv/bin/python bench/publish_check.py --start DIR --version DIR [--version DIR ...] [--out FILE]

Runs in about a minute for SmolLM2-135M-Instruct (one thread). Prints a markdown table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.rollout.embedded import EmbeddedEngine
from app.rollout.probe import AUTO_FLOOR, gap, probe_ids, reference_logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=Path, required=True, help="the model the run started from")
    parser.add_argument("--version", type=Path, action="append", required=True, help="published versions, in order")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = ["start", *(p.name for p in args.version)]
    dirs = dict(zip(names, [args.start, *args.version], strict=True))
    ids = probe_ids(AutoTokenizer.from_pretrained(args.start))
    reference = {
        name: reference_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), ids)
        for name, path in dirs.items()
    }
    served = {
        (name, dtype): EmbeddedEngine.from_pretrained(path, dtype=getattr(torch, dtype)).score_sync(ids)[0]
        for name, path in dirs.items()
        for dtype in ("float32", "bfloat16")
    }
    newest = names[-1]
    rows, result = [], {"probe_tokens": len(ids), "versions": names, "dtypes": {}}
    for dtype in ("float32", "bfloat16"):
        start_gap = gap(served["start", dtype], reference["start"])
        tolerance = max(AUTO_FLOOR, 2 * start_gap)
        own = {name: gap(served[name, dtype], reference[name]) for name in names}
        stale = {name: gap(served[name, dtype], reference[newest]) for name in names[:-1]}
        result["dtypes"][dtype] = {"start_gap": start_gap, "tolerance": tolerance, "own": own, "stale": stale}
        for name in names:
            rows.append((dtype, f"{name} (its own version)", own[name], own[name] > tolerance, tolerance))
        for name in reversed(names[:-1]):
            rows.append((dtype, f"{name} when {newest} was published", stale[name], stale[name] > tolerance, tolerance))
    drift = {name: gap(reference[name], reference[newest]) for name in names[:-1]}
    result["float32_reference_distance_to_newest"] = drift
    print(f"probe: {len(ids)} tokens; float32 distance of each version to {newest}: "
          + ", ".join(f"{k} {v:.3g}" for k, v in drift.items()))  # fmt: skip
    print("| engine dtype | engine holds | mean gap (nats) | tolerance | flagged |")
    print("|---|---|---|---|---|")
    for dtype, what, value, flagged, tolerance in rows:
        print(f"| {dtype} | {what} | {value:.3g} | {tolerance:.3g} | {'yes' if flagged else 'no'} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
