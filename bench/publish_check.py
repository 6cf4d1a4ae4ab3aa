"""What the weight-publication check (app/rollout/probe.py) can see on a real model: its gaps, measured.

For a sequence of versions of one model (HF directories: a start model, then the versions a run published, in
order), with the probe text of the check, in three modes: a float32 engine against the float32 reference; a
bfloat16 engine against the float32 reference (the check before 2026-12-06); a bfloat16 engine against the
reference of the weights rounded to bf16 (what the check does now for an engine known to hold bf16 weights):
- the engine's own gap: each version served by the embedded engine (the built-in server's engine), scored
  against that version's reference, and the check's verdict when the versions are published in order
  (`PublishCheck`, its automatic tolerance set at the start: 2x the start gap, at least 1e-3);
- what staleness looks like: the engine holding an older version (one version back, k versions back, the start
  model) when the newest is published, its gap and the check's verdict.

    .venv/bin/python bench/publish_check.py --start DIR --version DIR [--version DIR ...] [--out FILE]

Runs in about a minute for SmolLM2-135M-Instruct (one thread). Prints a markdown table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.rollout.base import ProbeReading
from app.rollout.embedded import EmbeddedEngine
from app.rollout.probe import PublishCheck, PublishCheckConfig, gap, probe_ids, reference_logprobs

MODES = (("float32", None), ("bfloat16", None), ("bfloat16", "bfloat16"))
"""(engine dtype, the reference's weight dtype): float32 weights, or rounded to the engine's."""


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
    reference = {}
    for name, path in dirs.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for rounded in (None, "bfloat16"):
            reference[name, rounded] = reference_logprobs(model, ids, weight_dtype=rounded)
    served = {
        (name, dtype): EmbeddedEngine.from_pretrained(path, dtype=getattr(torch, dtype)).score_sync(ids)[0]
        for name, path in dirs.items()
        for dtype in ("float32", "bfloat16")
    }
    newest = names[-1]
    rows, result = [], {"probe_tokens": len(ids), "versions": names, "modes": {}}
    for dtype, rounded in MODES:
        mode = f"{dtype} engine, {'bf16-rounded' if rounded else 'float32'} reference"

        def reading(name: str, label: str, dtype: str = dtype) -> list[ProbeReading]:
            return [ProbeReading("engine", label, served[name, dtype])]

        check = PublishCheck(PublishCheckConfig(), ids, weight_dtype=rounded)
        check.start(reading("start", "0"), reference["start", rounded], 0)
        own, verdicts = {}, {}
        for k, name in enumerate(names[1:], start=1):
            own[name] = gap(served[name, dtype], reference[name, rounded])
            before_newest = copy.deepcopy(check) if name == newest else None
            verdicts[name] = "fails" if check.failures(reading(name, str(k)), reference[name, rounded], k) else "passes"
        stale, stale_verdicts = {}, {}
        for name in names[:-1]:  # an older version's weights under the newest label
            trial = copy.deepcopy(before_newest)
            stale[name] = gap(served[name, dtype], reference[newest, rounded])
            failed = trial.failures(reading(name, str(len(names) - 1)), reference[newest, rounded], len(names) - 1)
            stale_verdicts[name] = "caught" if failed else "missed"
        result["modes"][mode] = {
            "start_gap": check.start_gap, "tolerance": check.tolerance, "own": own, "verdicts": verdicts,
            "stale": stale, "stale_verdicts": stale_verdicts,
        }  # fmt: skip
        rows.append((mode, "start (its own version)", check.start_gap, check.tolerance, "sets the tolerance"))
        for name in names[1:]:
            rows.append((mode, f"{name} (its own version)", own[name], check.tolerance, verdicts[name]))
        for name in reversed(names[:-1]):
            rows.append((mode, f"{name} when {newest} was published", stale[name], check.tolerance, stale_verdicts[name]))
    drift = {name: gap(reference[name, None], reference[newest, None]) for name in names[:-1]}
    result["float32_reference_distance_to_newest"] = drift
    print(f"probe: {len(ids)} tokens; float32 distance of each version to {newest}: "
          + ", ".join(f"{k} {v:.3g}" for k, v in drift.items()))  # fmt: skip
    print("| mode | engine holds | mean gap (nats) | tolerance | the check |")
    print("|---|---|---|---|---|")
    for mode, what, value, tolerance, verdict in rows:
        print(f"| {mode} | {what} | {value:.3g} | {tolerance:.3g} | {verdict} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
