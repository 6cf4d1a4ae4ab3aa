"""How close the trainer and the built-in engine come to this machine: achieved FLOP/s and bytes/s against the
ceilings measured by the same script, at one torch thread (what training runs use on this 2-core CPU).

Ceilings: the best median FLOP/s of square bf16 and float32 matmuls (--sizes), and memory bandwidth from a
--mib buffer (far past the caches): a copy (read + write bytes) and a read-only `.sum()`, best of --repeats.

Work, on SmolLM2-135M-Instruct (the `make smollm2` cache) with the settings of --config (configs/smollm2-math.yaml:
bf16 compute over float32 weights, share_prompts, micro-batch 16, ESS, AdamW; rollout.dtype bfloat16):

  (a) trainer: `train_step` (median of --repeats after a warm-up) on --groups groups of the config's group size,
      chat prompts of held-out builtin:word_problems rows, each completion the first --completion-tokens tokens
      the built-in engine sampled for that prompt in (c), with its behaviour logprobs, advantages +-1.
  (b) engine prefill: `EmbeddedEngine.generate_sync` in bf16, max_new_tokens 1, n 1, on --prefill-prompts prompts.
  (c) engine decode: --decode-prompts prompts x the group size, the config's max_new_tokens and temperature, its
      stop tokens (the API cannot ignore EOS, so every step counts the rows it really ran). An `on_step` callback
      timestamps each step and replays the engine's row bookkeeping (finished rows stay in the batch until they
      are a quarter of it); decode time = first to last step, so the prefill and the first sample are excluded.

FLOP counts (W = non-embedding linear weights, L layers, Hq x dh query heads, h hidden, V vocab):
  forward = 2 W T + 4 L Hq dh P + 2 h V S     T tokens through the layers, P (query, key) pairs of QK^T and AV,
                                               S positions the tied output head runs on
  training = 3 x forward                       (backward ~ 2 x forward; softmax, norms, AdamW not counted)
  "computed" counts what the kernels do: padded tokens, and every pair of a dense masked attention (SDPA with an
  explicit mask has no causal block skipping); "useful" counts real tokens and attended pairs only. Trainer:
  per micro-batch, the packed shared-prompt layout of trainer/logprobs.py (G groups x L' columns, the head from
  the first column that predicts a completion token); useful S = completion tokens. Prefill: left-padded
  [prompts, width], the head on the last position only. Decode step with r rows and k cached columns:
  FLOPs 2 W r + 4 L Hq dh r k + 2 h V r; bytes = every bf16 parameter once (the tied embedding/head once) +
  the K and V cache read once, r k L 2 Hkv dh 2 (padding columns included: they are read).

    OMP_NUM_THREADS=1 .venv/bin/python bench/roofline.py [--repeats 3] [--groups 4] [--decode-prompts 16]
                                                         [--out bench/results/roofline.json]

About 4 minutes here with the defaults. Writes the JSON (bench/results/ is git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from app.rollout.base import Completion, SamplingParams  # noqa: E402
from bench.real_model import chat_prompts  # noqa: E402
from bench.training_runs import machine  # noqa: E402

GIGA = 1e9


def timings(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(timings(fn, repeats))


# ---------------------------------------------------------------------------------------------------- ceilings


def matmul_peak(dtype: torch.dtype, sizes: list[int], repeats: int) -> dict:
    by_size = {}
    for n in sizes:
        a, b, c = (torch.randn(n, n).to(dtype) for _ in range(3))
        by_size[n] = 2 * n**3 / median_time(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), repeats)
    return {"flops_per_s": max(by_size.values()), "by_size": by_size}


def bandwidth(mib: int, repeats: int) -> dict:
    src = torch.ones(mib * 2**20 // 4)  # float32, every page touched
    dst = torch.ones_like(src)
    size = src.numel() * 4
    copy = 2 * size / min(timings(lambda: dst.copy_(src), repeats))  # read src + write dst
    read = size / min(timings(src.sum, repeats))
    return {"bytes_per_s": max(copy, read), "copy_bytes_per_s": copy, "read_bytes_per_s": read,
            "buffer_bytes": size}  # fmt: skip


# ------------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    linear_weights: int  # non-embedding nn.Linear weights (the tied head excluded)
    params: int  # every distinct parameter (the tied embedding/head once)

    @classmethod
    def of(cls, model: torch.nn.Module) -> Shape:
        c, head = model.config, model.get_output_embeddings()
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_dim,
                   c.vocab_size, linear, sum(p.numel() for p in model.parameters()))  # fmt: skip

    def forward_flops(self, tokens: int, pairs: int, head_positions: int) -> int:
        return (2 * self.linear_weights * tokens + 4 * self.layers * self.heads * self.head_dim * pairs
                + 2 * self.hidden * self.vocab * head_positions)  # fmt: skip

    def kv_bytes_per_token(self, element: int = 2) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * element


FORMULAS = {
    "forward_flops": "2*W*T + 4*L*Hq*dh*P + 2*h*V*S (W non-embedding linear weights, T tokens through the layers, "
                     "P attention (query, key) pairs, S output-head positions)",
    "training_flops": "3 * forward_flops (backward ~ 2 x forward)",
    "decode_bytes_per_step": "2*params (bf16, tied embedding/head once) + r*k*L*2*Hkv*dh*2 (K and V read once)",
    "decode_flops_per_step": "2*W*r + 4*L*Hq*dh*r*k + 2*h*V*r (r rows in the batch, k cached columns)",
}  # fmt: skip


def rate(work: float, seconds: float) -> float:
    return work / seconds if seconds > 0 else float("nan")


# ---------------------------------------------------------------------------------------------- (b), (c) engine


def prefill(engine, shape: Shape, prompts: list[list[int]], repeats: int) -> dict:
    params = SamplingParams(max_new_tokens=1, temperature=1.0, n=1, seed=0)
    seconds = median_time(lambda: engine.generate_sync(prompts, params), repeats)
    width, lengths = max(map(len, prompts)), [len(p) for p in prompts]
    computed = shape.forward_flops(len(prompts) * width, len(prompts) * width * width, len(prompts))
    useful = shape.forward_flops(sum(lengths), sum(p * (p + 1) // 2 for p in lengths), len(prompts))
    return {"prompts": len(prompts), "width": width, "prompt_tokens": sum(lengths), "seconds": seconds,
            "flops_computed": computed, "flops_useful": useful,
            "flops_per_s": rate(computed, seconds), "useful_flops_per_s": rate(useful, seconds)}  # fmt: skip


class DecodeTrace:
    """`on_step` callback: a timestamp per step, and the (rows, cached columns) of the forward that follows it,
    replaying `EmbeddedEngine._generate_chunk`'s bookkeeping (rows leave once finished ones are a quarter)."""

    def __init__(self, rows: int, width: int, steps: int) -> None:
        self.rows, self.width, self.steps = rows, width, steps
        self.times: list[float] = []
        self.live: list[int] = []
        self.forwards: list[tuple[int, int]] = []

    def __call__(self, seqs: list[int], tokens, logprobs, finished: list[str | None]) -> None:
        step = len(self.times)
        self.times.append(time.perf_counter())
        self.live.append(len(seqs))
        left = sum(reason is None for reason in finished)
        if left and step + 1 < self.steps:
            if left <= 0.75 * self.rows:
                self.rows = left
            self.forwards.append((self.rows, self.width + step + 1))


def decode(engine, shape: Shape, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, list[Completion]]:
    engine.generate_sync(prompts[:2], replace(params, n=2, max_new_tokens=4))  # warm-up
    trace = DecodeTrace(len(prompts) * params.n, max(map(len, prompts)), params.max_new_tokens)
    start = time.perf_counter()
    completions = engine.generate_sync(prompts, params, on_step=trace)
    assert len(trace.forwards) == len(trace.times) - 1, "the trace lost track of the engine's steps"
    seconds = trace.times[-1] - trace.times[0]
    weights = 2 * shape.params
    kv = sum(r * k for r, k in trace.forwards) * shape.kv_bytes_per_token()
    total = weights * len(trace.forwards) + kv
    flops = sum(shape.forward_flops(r, r * k, r) for r, k in trace.forwards)
    tokens = sum(trace.live[1:])
    return {"sequences": len(prompts) * params.n, "prompts": len(prompts), "n": params.n,
            "max_new_tokens": params.max_new_tokens, "prefill_and_first_sample_s": trace.times[0] - start,
            "decode_steps": len(trace.forwards), "decode_s": seconds, "decode_tokens": tokens,
            "generated_tokens": sum(trace.live), "row_steps": sum(r for r, _ in trace.forwards),
            "tokens_per_s": rate(tokens, seconds), "weight_bytes_per_step": weights, "kv_bytes": kv,
            "bytes": total, "bytes_per_s": rate(total, seconds),
            "bytes_per_s_with_cache_cat": rate(total + 2 * kv, seconds),  # DynamicCache's torch.cat: read + write
            "flops": flops, "flops_per_s": rate(flops, seconds)}, completions  # fmt: skip


# ---------------------------------------------------------------------------------------------------- (a) trainer


def trainer_flops(batch, cfg, shape: Shape) -> dict:
    """The forward FLOPs of `train_step` on `batch`: micro-batches as `plan_step` cuts them, each packed by shared
    prompt as `shared_prefix_token_logprobs` packs it (or right-padded when share_prompts is off)."""
    from trainer.distributed import LocalReducer
    from trainer.logprobs import _first_predictor, shared_prefix_plan
    from trainer.step import plan_step

    count = {"tokens": 0, "useful_tokens": 0, "pairs": 0, "useful_pairs": 0, "head": 0, "useful_head": 0}
    for mb in plan_step(batch, cfg.micro_batch_size, LocalReducer(), torch.device("cpu")).micro_batches:
        if cfg.share_prompts:
            plan = shared_prefix_plan(mb.input_ids, mb.attention_mask, mb.mask)
            groups, width = plan.input_ids.shape
            real = [int(plan.packed_col[plan.group == g].max()) + 1 for g in range(groups)]
            pads = sum(width - r for r in real)  # each padding column attends to itself
            count["useful_pairs"] += int(plan.allowed.sum()) - pads
            count["useful_tokens"] += sum(real)
            count["head"] += groups * (width - int(plan.predictor.min()))
        else:
            groups, width = mb.input_ids.shape
            real = mb.attention_mask.sum(1).tolist()
            count["useful_pairs"] += sum(r * (r + 1) // 2 for r in real)
            count["useful_tokens"] += sum(real)
            count["head"] += groups * (width - _first_predictor(mb.mask))
        count["tokens"] += groups * width
        count["pairs"] += groups * width * width
        count["useful_head"] += int(mb.mask.sum())
    computed = shape.forward_flops(count["tokens"], count["pairs"], count["head"])
    useful = shape.forward_flops(count["useful_tokens"], count["useful_pairs"], count["useful_head"])
    return {**count, "forward_flops_computed": computed, "forward_flops_useful": useful}


def trainer(model_dir: Path, config, completions: list[Completion], pad_id: int, shape: Shape, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    from app.training.batching import build_train_batch
    from trainer.distributed import LocalReducer
    from trainer.optim import build_optimizer
    from trainer.step import train_step

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer, _ = build_optimizer(model, config.optim, total_steps=1000)
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(completions))]
    batch = build_train_batch(completions, advantages, pad_id=pad_id, temperature=config.rollout.temperature)
    reducer = LocalReducer()
    seconds = median_time(lambda: train_step(model, optimizer, batch, config.objective, reducer, config.trainer),
                          repeats)  # fmt: skip
    for p in model.parameters():  # one AdamW step alone, on zero gradients: the step's time outside fwd+bwd
        p.grad = torch.zeros_like(p)
    adamw = median_time(optimizer.step, repeats)
    flops = trainer_flops(batch, config.trainer, shape)
    computed, useful = 3 * flops["forward_flops_computed"], 3 * flops["forward_flops_useful"]
    return {"sequences": batch.batch_size, "attended_tokens": int(batch.attention_mask.sum()),
            "completion_tokens": int(batch.loss_mask.sum()), "micro_batch_size": config.trainer.micro_batch_size,
            "share_prompts": config.trainer.share_prompts, "compute_dtype": config.trainer.compute_dtype,
            **flops, "train_flops_computed": computed, "train_flops_useful": useful, "seconds": seconds,
            "adamw_s": adamw, "flops_per_s": rate(computed, seconds), "useful_flops_per_s": rate(useful, seconds),
            "fwd_bwd_flops_per_s": rate(computed, seconds - adamw)}  # fmt: skip


# ------------------------------------------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="HF directory (default: the `make smollm2` cache)")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "smollm2-math.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048], help="square matmul sizes")
    parser.add_argument("--mib", type=int, default=1024, help="bandwidth buffer (MiB)")
    parser.add_argument("--groups", type=int, default=4, help="groups in the trainer's batch")
    parser.add_argument("--completion-tokens", type=int, default=30, help="tokens kept of each completion in (a)")
    parser.add_argument("--prefill-prompts", type=int, default=16)
    parser.add_argument("--decode-prompts", type=int, default=16)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "roofline.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    wall, cpu = time.perf_counter(), time.process_time()

    from app.config import load_config
    from app.convert import smollm2_paths
    from app.rollout.embedded import EmbeddedEngine

    model_dir = Path(args.model) if args.model else smollm2_paths()["model"]
    if not (model_dir / "config.json").exists():
        print(f"no model at {model_dir}: run `make smollm2` first (or pass --model DIR)", file=sys.stderr)
        return 2
    config = load_config(args.config)
    group = config.rollout.group_size
    prompts, stops, pad_id = chat_prompts(model_dir, max(args.prefill_prompts, args.decode_prompts, args.groups))
    print(f"{model_dir.name}, {args.config.name}: 1 torch thread, load {os.getloadavg()[0]:.2f}", flush=True)

    print("ceilings: matmuls, bandwidth ...", flush=True)
    peaks = {str(d).removeprefix("torch."): matmul_peak(d, args.sizes, args.repeats)
             for d in (torch.bfloat16, torch.float32)}  # fmt: skip
    memory = bandwidth(args.mib, args.repeats)

    engine_dtype = getattr(torch, config.rollout.dtype)
    engine = EmbeddedEngine.from_pretrained(model_dir, dtype=engine_dtype)
    shape = Shape.of(engine.model)
    print(f"(b) prefill, {args.prefill_prompts} prompts, {config.rollout.dtype} ...", flush=True)
    pre = prefill(engine, shape, prompts[: args.prefill_prompts], args.repeats)
    print(f"(c) decode, {args.decode_prompts} prompts x n {group}, <= {config.rollout.max_new_tokens} tokens ...",
          flush=True)  # fmt: skip
    params = SamplingParams(max_new_tokens=config.rollout.max_new_tokens, temperature=config.rollout.temperature,
                            top_p=config.rollout.top_p, n=group, stop_token_ids=stops, seed=0)  # fmt: skip
    dec, sampled = decode(engine, shape, prompts[: args.decode_prompts], params)
    del engine
    k = args.completion_tokens
    completions = [replace(c, output_ids=c.output_ids[:k], output_logprobs=c.output_logprobs[:k])
                   for c in sampled[: args.groups * group]]  # fmt: skip
    print(f"(a) train_step, {len(completions)} sequences ...", flush=True)
    train = trainer(model_dir, config, completions, pad_id, shape, args.repeats)

    bf16, f32, bw = peaks["bfloat16"]["flops_per_s"], peaks["float32"]["flops_per_s"], memory["bytes_per_s"]
    rows = [
        ("bf16 matmul peak, GFLOP/s", bf16, bf16),
        ("float32 matmul peak (vs bf16), GFLOP/s", f32, bf16),
        ("bandwidth copy, GB/s", memory["copy_bytes_per_s"], bw),
        ("bandwidth read (.sum), GB/s", memory["read_bytes_per_s"], bw),
        ("(a) train_step computed, GFLOP/s", train["flops_per_s"], bf16),
        ("(a) train_step useful, GFLOP/s", train["useful_flops_per_s"], bf16),
        ("(a) fwd+bwd (step - AdamW), GFLOP/s", train["fwd_bwd_flops_per_s"], bf16),
        ("(b) prefill computed, GFLOP/s", pre["flops_per_s"], bf16),
        ("(b) prefill useful, GFLOP/s", pre["useful_flops_per_s"], bf16),
        ("(c) decode weights+KV, GB/s", dec["bytes_per_s"], bw),
        ("(c) decode, GFLOP/s", dec["flops_per_s"], bf16),
    ]  # fmt: skip
    print(f"\n{'row':<38} {'achieved':>10} {'ceiling':>10} {'fraction':>9}")
    for name, achieved, ceiling in rows:
        print(f"{name:<38} {achieved / GIGA:>10.1f} {ceiling / GIGA:>10.1f} {achieved / ceiling:>9.1%}")
    print(f"(a) {train['sequences']} sequences, {train['tokens']} tokens through the layers "
          f"({train['useful_tokens']} real), {train['pairs']} attention pairs computed ({train['useful_pairs']} "
          f"attended), head on {train['head']} positions ({train['useful_head']} read); {train['seconds']:.2f} s a "
          f"step, of which AdamW alone {train['adamw_s']:.2f} s")  # fmt: skip
    print(f"(b) {pre['prompts']} prompts x width {pre['width']} ({pre['prompt_tokens']} real tokens), "
          f"{pre['seconds']:.2f} s")  # fmt: skip
    print(f"(c) {dec['decode_tokens']} tokens in {dec['decode_steps']} steps, {dec['decode_s']:.2f} s: "
          f"{dec['tokens_per_s']:.1f} tokens/s; {dec['weight_bytes_per_step'] / 2**20:.0f} MiB of weights a step, "
          f"{dec['kv_bytes'] / 2**20:.0f} MiB of KV in all; with the cache's torch.cat copies "
          f"{dec['bytes_per_s_with_cache_cat'] / GIGA:.1f} GB/s")  # fmt: skip
    print("forward FLOPs = " + FORMULAS["forward_flops"] + "; training = 3 x forward")
    share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    busy = "" if share >= 0.95 else "; well under 100%: other processes took its core, every rate is low"
    print(f"this process was on a CPU {share:.0%} of its wall time (load {os.getloadavg()[0]:.2f}, "
          f"{os.cpu_count()} CPUs){busy}")  # fmt: skip
    report = {"bench": "roofline", "model": str(model_dir), "config": str(args.config),
              "machine": {**machine(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                          "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load": os.getloadavg()[0],
                          "cpu_share": share},
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "shape": vars(shape), "formulas": FORMULAS, "completion_ids": "sampled by the built-in engine in (c)",
              "ceilings": {"matmul": peaks, "memory": memory}, "trainer": train, "prefill": pre, "decode": dec,
              "table": [{"row": n, "achieved": a, "ceiling": c, "fraction": a / c} for n, a, c in rows]}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
