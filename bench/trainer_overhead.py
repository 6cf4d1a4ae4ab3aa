"""Where `train_step` spends its time on the quickstart model, and what it costs over a bare PyTorch loop.

On the quickstart's warm-started tiny model (the model `trustbatch train configs/quickstart.yaml` trains), a
real step's batch: `--prompts` training prompts of builtin:arithmetic × 8 completions sampled by the embedded
engine at T = 1 (8 new tokens), ±1 advantages. Then, each in its own process (bench/real_model.py's (a)):

  - `trainer.step.train_step` (ESS objective, chunked log-softmax with entropy, global-norm clip, AdamW);
  - a bare loop over the same model, batch and micro-batches: forward, masked token cross-entropy, backward,
    clip, AdamW;
  - `train_step` with `trainer.share_prompts` (each group's prompt run once, its completions packed after it).

Tokens = attended (prompt + completion) tokens. Median of --repeats timed steps after a warm-up. Then
torch.profiler over --repeats `train_step` calls: the operators with the most self CPU time, and the share of
the step's wall time spent outside any operator (Python, the objective's bookkeeping).

    .venv/bin/python bench/trainer_overhead.py [--prompts 16] [--micro-batch 64] [--repeats 20]

About a minute here. Writes bench/results/trainer_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.real_model import measure_trainer  # noqa: E402


def sample_batch(model_dir: Path, prompts: int, seed: int):
    """`prompts` training prompts × 8 completions from the embedded engine, as a training step gets them."""
    from transformers import AutoTokenizer

    from app.config import load_config
    from app.data import load_split
    from app.rollout.base import SamplingParams
    from app.rollout.embedded import EmbeddedEngine

    cfg = load_config(REPO / "configs" / "quickstart.yaml", [])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = load_split(cfg.data, "train")[:prompts]
    ids = [tokenizer(row.prompt, add_special_tokens=False)["input_ids"] for row in rows]
    engine = EmbeddedEngine.from_pretrained(model_dir)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=1.0, n=cfg.rollout.group_size,
                            seed=seed)
    return engine.generate_sync(ids, params), tokenizer.pad_token_id


def profile_train_step(model_dir: Path, completions, pad_id: int, micro: int, repeats: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from app.training.batching import build_train_batch
    from trainer.distributed import LocalReducer
    from trainer.objective import ObjectiveConfig
    from trainer.optim import OptimConfig, build_optimizer
    from trainer.step import TrainerConfig, train_step

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(completions))]
    batch = build_train_batch(completions, advantages, pad_id=pad_id, temperature=1.0)
    optimizer, _ = build_optimizer(model, OptimConfig(lr=1e-7, schedule="constant"), total_steps=1000)
    cfg, objective, reducer = TrainerConfig(micro_batch_size=micro), ObjectiveConfig(name="ess"), LocalReducer()
    train_step(model, optimizer, batch, objective, reducer, cfg)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            train_step(model, optimizer, batch, objective, reducer, cfg)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    # Self time of the top-level operators only would double count nothing; self times of all operators add up
    # to the time spent inside ATen, the rest of the wall time is Python and the framework around the ops.
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e6
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {
        "wall_s_per_step": wall / repeats,
        "in_operators_share": in_ops / wall,
        "top_ops": [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / repeats,
                     "share": e.self_cpu_time_total / 1e6 / wall, "calls_per_step": e.count / repeats} for e in top],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "runs" / "models" / "tiny-arithmetic"),
                        help="HF directory (default: the quickstart's warm-started model; `make quickstart` or "
                             "`trustbatch bootstrap configs/quickstart.yaml` builds it)")
    parser.add_argument("--prompts", type=int, default=16,
                        help="prompts × 8 completions (16: the informative half of a quickstart step)")
    parser.add_argument("--micro-batch", type=int, default=64, help="trainer.micro_batch_size (the default)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "trainer_overhead.json"))
    args = parser.parse_args()
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"no model at {model_dir}: run `trustbatch bootstrap configs/quickstart.yaml` first")

    import torch

    torch.set_num_threads(1)
    completions, pad_id = sample_batch(model_dir, args.prompts, seed=0)
    loops = measure_trainer(model_dir, completions, pad_id, args.micro_batch, args.repeats, share_prompts=True)
    bare, ours = loops["loops"]["bare PyTorch"], loops["loops"]["trustbatch train_step"]
    print(f"batch: {loops['batch']}")
    print(f"{'loop':<27}{'s/step':>9}{'tokens/s':>11}")
    for name, loop in loops["loops"].items():
        print(f"{name:<27}{loop['seconds']:>9.4f}{loop['tokens_per_s']:>11.0f}")
    ratio = ours["tokens_per_s"] / bare["tokens_per_s"]
    shared = loops["loops"]["train_step, share_prompts"]
    print(f"train_step / bare: {ratio:.2f}x; with trainer.share_prompts: "
          f"{shared['tokens_per_s'] / bare['tokens_per_s']:.2f}x")

    profile = profile_train_step(model_dir, completions, pad_id, args.micro_batch, args.repeats)
    print(f"\ntrain_step under torch.profiler: {1e3 * profile['wall_s_per_step']:.1f} ms a step, "
          f"{100 * profile['in_operators_share']:.0f}% of it inside operators")
    print(f"{'operator':<40}{'ms/step':>9}{'share':>8}{'calls':>8}")
    for op in profile["top_ops"]:
        print(f"{op['op'][:39]:<40}{op['self_ms_per_step']:>9.2f}{100 * op['share']:>7.1f}%{op['calls_per_step']:>8.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"batch": loops["batch"], "loops": loops["loops"], "ratio": ratio,
                               "profile": profile}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
