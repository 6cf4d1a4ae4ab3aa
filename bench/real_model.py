"""SmolLM2-135M-Instruct on CPU: trustbatch's trainer and rollout servers against plain PyTorch / transformers.

All four measurements run side by side in one invocation, on the model `make smollm2` converts (float32, one
torch thread per process, as a training run uses them), with chat prompts from the held-out split of
builtin:word_problems:

  (a) trainer tokens/s: `trainer.step.train_step` (ESS objective, chunked log-softmax with entropy, global-norm
      clipping, AdamW) against a bare loop over the same model, batch and micro-batches: forward, masked
      token cross-entropy, backward, AdamW step. Tokens = attended (prompt + completion) tokens of the batch.
  (b) rollout tokens/s: the built-in CPU rollout server (`trustbatch rollout-server`, driven through
      trustbatch's SGLang client) against `model.generate` of transformers on the same prompts, sampling
      settings (T = 1, top_p = 1, n samples each, the same stop tokens) and max_new_tokens. Tokens = generated
      tokens up to and including the stop token.
  (c) real SGLang 0.5.23 on CPU (.venv-sglang, `make sglang-env`) on the same requests as (b).
  (d) peak memory: the peak RSS of each loop of (a) (each runs in its own process), and of each server's process
      tree (VmHWM summed over the server and its children).
  (f) with --lora R: `train_step` with LoRA adapters of rank R on every linear layer (trainer.lora) against full
      fine-tuning, and the time of one disk publication of each (gather, merge the adapters, write the HF
      directory); --lora-only skips (c) and transformers generate. Beside them, `train_step` with every weight
      frozen and the input embeddings requiring gradients ("no weight gradients"): the same forward and every
      activation gradient, no weight gradient and no optimizer work, which is what any LoRA costs at rank 0,
      so full / that is the ceiling of LoRA's speed-up on this model and machine.
  (e) with --bf16: bfloat16 against float32 on each side. The built-in server with rollout.dtype=bfloat16 in
      (b), `train_step` with trainer.compute_dtype=bfloat16 in (a), and what it costs in agreement: for each
      pair (engine dtype, trainer compute dtype), the trainer's logprobs of the engine's own completions at
      the same weights (lag 0) against the engine's behaviour logprobs: mean and largest |gap| per token, and
      the ESS of the ratios, (sum r)^2 / (n sum r^2), as the objective computes it.

Each timing is the median of --repeats runs after one warm-up. The batch of (a) is made of the completions the
built-in server sampled in (b) (the first --train-sequences: two groups of the learning config), with their
behaviour logprobs and +-1 advantages, so its lengths and padding are those of a training step.

    .venv/bin/python bench/real_model.py [--prompts 8] [--n 8] [--new 64] [--micro-batch 8]
                                         [--train-sequences 16] [--repeats 2] [--no-sglang] [--bf16]
                                         [--lora RANK [--lora-only]]
                                         [--out bench/results/real_model.json]

Takes about 15-20 minutes here with the defaults. Writes the JSON (bench/results/ is git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from app.rollout.base import Completion, SamplingParams  # noqa: E402

SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
MIB = 1024**2


def chat_prompts(model_dir: Path, count: int) -> tuple[list[list[int]], tuple[int, ...], int]:
    """Token ids of `count` held-out word problems in the model's chat template, the stop tokens, the pad id."""
    from transformers import AutoTokenizer

    from app.data import DataConfig, load_split
    from app.data.prepare import stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = load_split(DataConfig(eval="builtin:word_problems", num_eval=count), "eval")[:count]
    prompts = [
        list(tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
        for row in rows
    ]  # fmt: skip
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return prompts, stop_token_ids(tokenizer), pad


def tree_peak_rss(pid: int) -> int:
    """Sum of VmHWM (peak resident set) over a process and its descendants, in bytes (Linux /proc)."""

    def children(p: int) -> list[int]:
        out = []
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return out

    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
        todo += children(p)
    return total


def generated_tokens(completions: list[Completion]) -> int:
    return sum(len(c.output_ids) for c in completions)


# -------------------------------------------------------------------------------------------- (b), (c) servers


async def _time_server(url: str, prompts, params: SamplingParams, repeats: int, timeout_s: float):
    from app.rollout.sglang import SGLangClient, SGLangClientConfig

    cfg = SGLangClientConfig(urls=[url], timeout_s=timeout_s, max_retries=0, health_timeout_s=600)
    async with SGLangClient(cfg) as client:
        await client.wait_healthy()
        await client.generate(prompts[:2], SamplingParams(max_new_tokens=8, temperature=1.0, n=1))  # warm-up
        times, tokens, completions = [], [], []
        for r in range(repeats):
            start = time.perf_counter()
            completions = await client.generate(prompts, replace(params, seed=r))
            times.append(time.perf_counter() - start)
            tokens.append(generated_tokens(completions))
    return times, tokens, completions


def measure_server(server, prompts, params: SamplingParams, repeats: int) -> dict:
    server.start()
    try:
        server.wait_ready()
        times, tokens, completions = asyncio.run(_time_server(server.url, prompts, params, repeats, 1800))
        peak = tree_peak_rss(server.pid)
    finally:
        server.stop()
    seconds = statistics.median(times)
    return {"seconds": round(seconds, 3), "new_tokens": round(statistics.mean(tokens)),
            "tokens_per_s": round(statistics.mean(tokens) / seconds, 1),
            "completions_per_s": round(len(completions) / seconds, 2),
            "stop_frac": round(sum(c.finish_reason == "stop" for c in completions) / len(completions), 3),
            "peak_rss_mib": round(peak / MIB), "_completions": completions}  # fmt: skip


def measure_hf_generate(model_dir: Path, prompts, params: SamplingParams, pad_id: int, repeats: int) -> dict:
    """transformers `generate`: one left-padded batch of every prompt, n return sequences each, sampling."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    stops = list(params.stop_token_ids)

    def run(seed: int, max_new_tokens: int) -> int:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=params.temperature,
                                 top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                                 num_return_sequences=params.n, eos_token_id=stops, pad_token_id=pad_id)  # fmt: skip
        new = out[:, width:]
        count = 0
        for row in new.tolist():  # tokens up to and including the first stop token
            for j, token in enumerate(row):
                if token in stops:
                    count += j + 1
                    break
            else:
                count += len(row)
        return count

    run(0, 8)  # warm-up
    times, tokens = [], []
    for r in range(repeats):
        start = time.perf_counter()
        tokens.append(run(r, params.max_new_tokens))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    completions = len(prompts) * params.n
    return {"seconds": round(seconds, 3), "new_tokens": round(statistics.mean(tokens)),
            "tokens_per_s": round(statistics.mean(tokens) / seconds, 1),
            "completions_per_s": round(completions / seconds, 2)}  # fmt: skip


# ------------------------------------------------------------------------------------------------ (a) trainer


def _trainer_child(
    which: str, model_dir: str, completions: list[Completion], pad_id: int, micro: int, repeats: int, queue,
    lora_rank: int = 0,
):  # which: bare | trustbatch | shared | bf16 | lora | frozen
    """One loop in a fresh process, so that its peak RSS is that loop's own."""
    import torch
    from transformers import AutoModelForCausalLM

    from app.training.batching import build_train_batch
    from trainer.distributed import LocalReducer
    from trainer.objective import ObjectiveConfig
    from trainer.optim import OptimConfig, build_optimizer
    from trainer.step import TrainerConfig, train_step

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if which == "lora":
        from trainer.lora import LoraConfig, apply_lora

        apply_lora(model, LoraConfig(rank=lora_rank))
    if which == "frozen":  # every activation gradient, no weight gradient: LoRA's ceiling
        model.requires_grad_(False)
        model.enable_input_require_grads()
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(completions))]
    batch = build_train_batch(completions, advantages, pad_id=pad_id, temperature=1.0)
    tokens = int(batch.attention_mask.sum())
    loss_tokens = int(batch.loss_mask.sum())

    if which == "frozen":  # nothing to train: an optimizer over one stand-in scalar, so train_step runs as is
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-7)
    else:
        optimizer, _ = build_optimizer(model, OptimConfig(lr=1e-7, schedule="constant"), total_steps=1000)
    cfg = TrainerConfig(micro_batch_size=micro, share_prompts=which == "shared",
                        compute_dtype="bfloat16" if which == "bf16" else "float32")  # fmt: skip
    objective, reducer = ObjectiveConfig(name="ess"), LocalReducer()

    def trustbatch_step() -> None:
        train_step(model, optimizer, batch, objective, reducer, cfg)

    def bare_step() -> None:
        # The same micro-batches (rows in order, right-padded to their own longest row), masked cross-entropy.
        for first in range(0, batch.batch_size, micro):
            width = int(batch.attention_mask[first : first + micro].sum(1).max())
            ids = batch.input_ids[first : first + micro, :width]
            attn = batch.attention_mask[first : first + micro, :width]
            mask = batch.loss_mask[first : first + micro, 1:width]
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="none"
            ).view_as(mask)
            ((nll * mask).sum() / loss_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step = bare_step if which == "bare" else trustbatch_step
    step()  # warm-up (and AdamW's state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    train_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before the publication's copies
    publish_s = None
    if which in ("trustbatch", "lora"):  # a disk publication: gather (and merge the adapters), write the directory
        from transformers import AutoTokenizer

        from trainer.checkpoint import save_hf_checkpoint

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            save_hf_checkpoint(model, tokenizer, Path(out) / "v1")
            publish_s = round(time.perf_counter() - start, 3)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put({"batch": {"sequences": batch.batch_size, "width": batch.input_ids.shape[1], "tokens": tokens,
                         "loss_tokens": loss_tokens, "micro_batch_size": micro},
               "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
               "peak_rss_mib": round(peak / MIB), "train_peak_rss_mib": round(train_peak / MIB),
               "publish_s": publish_s})  # fmt: skip


def measure_trainer(
    model_dir: Path, completions, pad_id: int, micro: int, repeats: int, *, share_prompts: bool = False,
    bf16: bool = False, lora_rank: int = 0,
) -> dict:
    """Both loops (and `train_step` with trainer.share_prompts if asked), each in its own spawned process, one
    after the other. tokens/s counts the padded batch's attended tokens for every loop: the same work."""
    ctx = multiprocessing.get_context("spawn")
    loops = {}
    which_loops = [("bare", "bare PyTorch"), ("trustbatch", "trustbatch train_step")]
    if share_prompts:
        which_loops.append(("shared", "train_step, share_prompts"))
    if bf16:
        which_loops.append(("bf16", "train_step, bf16 compute"))
    if lora_rank:
        which_loops.append(("lora", f"train_step, LoRA r={lora_rank}"))
        which_loops.append(("frozen", "train_step, no weight grads"))
    for which, name in which_loops:
        queue = ctx.Queue()
        child = ctx.Process(target=_trainer_child,
                            args=(which, str(model_dir), completions, pad_id, micro, repeats, queue, lora_rank))  # fmt: skip
        child.start()
        result = queue.get()
        child.join()
        loops[name] = {
            k: result[k] for k in ("seconds", "tokens_per_s", "peak_rss_mib", "train_peak_rss_mib", "publish_s")
        }
    return {"batch": result["batch"], "loops": loops}


# ------------------------------------------------------------------------------------------------ (e) agreement


def precision_agreement(model_dir: Path, samples: dict[str, list[Completion]], pad_id: int, micro: int) -> dict:
    """For each (engine dtype, trainer compute dtype): the trainer's logprobs of the engine's completions at the
    same weights against the engine's own, per valid token: mean |gap|, largest |gap|, and the ESS."""
    import torch
    from transformers import AutoModelForCausalLM

    from app.training.batching import build_train_batch
    from trainer.logprobs import token_logprobs
    from trainer.objective import ess_from_sums, ess_partial_sums, valid_token_mask
    from trainer.precision import compute

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    for engine_dtype, completions in samples.items():
        batch = build_train_batch(completions, [0.0] * len(completions), pad_id=pad_id, temperature=1.0)
        valid = valid_token_mask(batch.loss_mask, batch.old_logprobs)
        for trainer_dtype in ("float32", "bfloat16"):
            gaps, sums = [], torch.zeros(3, dtype=torch.float64)
            for first in range(0, batch.batch_size, micro):
                rows = slice(first, first + micro)
                with torch.no_grad(), compute(model, trainer_dtype):
                    logprobs, _ = token_logprobs(model, batch.input_ids[rows], batch.attention_mask[rows])
                mask = valid[rows]
                log_ratio = (logprobs - batch.old_logprobs[rows])[mask]
                gaps.append(log_ratio.abs())
                sums += ess_partial_sums((logprobs - batch.old_logprobs[rows]).exp(), mask)
            gap = torch.cat(gaps)
            out[f"engine {engine_dtype}, trainer {trainer_dtype}"] = {
                "tokens": int(gap.numel()), "mean_abs_gap": round(float(gap.mean()), 5),
                "max_abs_gap": round(float(gap.max()), 4), "ess": round(ess_from_sums(sums), 5),
            }  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="HF directory (default: the `make smollm2` cache)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (the learning config's group size)")
    parser.add_argument("--new", type=int, default=64, help="max_new_tokens")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--train-sequences", type=int, default=16, help="completions in the batch of (a)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-sglang", action="store_true", help="skip (c)")
    parser.add_argument("--bf16", action="store_true", help="also bfloat16 on each side, and (e)")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="also train_step with LoRA adapters of this rank on every linear layer (trainer.lora)")
    parser.add_argument("--lora-only", action="store_true",
                        help="with --lora: only the trainer loops of (a) (train_step with and without LoRA)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "real_model.json"))
    args = parser.parse_args()

    from app.convert import smollm2_paths
    from app.rollout.process import LocalServerProcess
    from app.rollout.sglang_server import SGLangLaunchConfig, SGLangServerProcess

    model_dir = Path(args.model) if args.model else smollm2_paths()["model"]
    if not (model_dir / "config.json").exists():
        print(f"no model at {model_dir}: run `make smollm2` first (or pass --model DIR)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts, stops, pad_id = chat_prompts(model_dir, args.prompts)
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0, top_p=1.0, n=args.n, stop_token_ids=stops)
    print(f"{model_dir.name}: {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens) "
          f"x n {args.n}, <= {args.new} new tokens, T 1, load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip

    rollout: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as logs:
        print("(b) built-in rollout server ...", flush=True)
        builtin = LocalServerProcess(model_dir, max_batch_size=256, log_path=Path(logs) / "builtin.log")
        rollout["built-in server"] = measure_server(builtin, prompts, params, args.repeats)
        if args.bf16:
            print("(b) built-in rollout server, bfloat16 ...", flush=True)
            builtin = LocalServerProcess(model_dir, max_batch_size=256, log_path=Path(logs) / "builtin16.log",
                                         dtype="bfloat16")  # fmt: skip
            rollout["built-in server, bf16"] = measure_server(builtin, prompts, params, args.repeats)
        if not args.lora_only:
            print("(b) transformers generate ...", flush=True)
            rollout["transformers generate"] = measure_hf_generate(model_dir, prompts, params, pad_id, args.repeats)
        if args.lora_only:
            pass
        elif not args.no_sglang and SGLANG_PYTHON.exists():
            print("(c) SGLang 0.5.23 on CPU ...", flush=True)
            cfg = SGLangLaunchConfig(num_servers=1, python=str(SGLANG_PYTHON), cpu=True, dtype="float32",
                                     max_total_tokens=32768, random_seed=0, startup_timeout_s=600,
                                     extra_args=["--log-level", "warning"])  # fmt: skip
            sglang = SGLangServerProcess(model_dir, cfg, index=0, log_path=Path(logs) / "sglang.log", weight_version=0)
            rollout["SGLang (CPU)"] = measure_server(sglang, prompts, params, args.repeats)
        elif not args.no_sglang:
            print(f"(c) skipped: no {SGLANG_PYTHON} (make sglang-env)")
    completions = rollout["built-in server"].pop("_completions")[: args.train_sequences]
    samples = {"float32": completions}
    if args.bf16:
        samples["bfloat16"] = rollout["built-in server, bf16"].pop("_completions")[: args.train_sequences]
    rollout.get("SGLang (CPU)", {}).pop("_completions", None)

    print("(a) trainer against a bare fwd+bwd+AdamW loop ...", flush=True)
    trainer = measure_trainer(model_dir, completions, pad_id, args.micro_batch, args.repeats, bf16=args.bf16,
                              lora_rank=args.lora)  # fmt: skip
    agreement = precision_agreement(model_dir, samples, pad_id, args.micro_batch) if args.bf16 else {}

    bare, ours = trainer["loops"]["bare PyTorch"], trainer["loops"]["trustbatch train_step"]
    base_gen = rollout.get("transformers generate", rollout["built-in server"])["tokens_per_s"]
    print(f"\n(a) trainer, {trainer['batch']['sequences']} sequences x {trainer['batch']['width']} "
          f"({trainer['batch']['tokens']} tokens, micro-batch {args.micro_batch})")  # fmt: skip
    for name, r in trainer["loops"].items():
        published = f", a disk publication {r['publish_s']:.2f} s" if r.get("publish_s") is not None else ""
        print(f"    {name:<24} {r['tokens_per_s']:>8.1f} tokens/s  ({r['seconds']:.2f} s a step, "
              f"peak RSS {r['peak_rss_mib']} MiB, {r['train_peak_rss_mib']} MiB before any publication"
              f"{published})")  # fmt: skip
    if args.lora:
        lora = trainer["loops"][f"train_step, LoRA r={args.lora}"]
        frozen = trainer["loops"]["train_step, no weight grads"]
        print(f"    LoRA / full train_step = {lora['tokens_per_s'] / ours['tokens_per_s']:.2f}  (target >= 1.4); "
              f"ceiling (no weight grads / full) = {frozen['tokens_per_s'] / ours['tokens_per_s']:.2f}; "
              f"LoRA / ceiling = {lora['tokens_per_s'] / frozen['tokens_per_s']:.2f}")  # fmt: skip
    print(f"    ratio trustbatch / bare = {ours['tokens_per_s'] / bare['tokens_per_s']:.2f}  (target >= 0.9)")
    print(f"(b, c) rollout, {len(prompts)} prompts x n {args.n}, <= {args.new} new tokens")
    for name, r in rollout.items():
        print(f"    {name:<24} {r['tokens_per_s']:>8.1f} tokens/s  {r['completions_per_s']:>6.2f} completions/s "
              f"({r['seconds']:.1f} s, {r['new_tokens']} tokens)  x{r['tokens_per_s'] / base_gen:.2f} of generate")  # fmt: skip
    for name, r in agreement.items():
        print(f"(e) {name:<34} mean |gap| {r['mean_abs_gap']:.5f}  max {r['max_abs_gap']:.4f}  "
              f"ESS {r['ess']:.5f}  ({r['tokens']} tokens)")  # fmt: skip
    if args.bf16:
        print(f"(e) bf16 / float32: trainer x{trainer['loops']['train_step, bf16 compute']['tokens_per_s'] / ours['tokens_per_s']:.2f}, "
              f"server x{rollout['built-in server, bf16']['tokens_per_s'] / rollout['built-in server']['tokens_per_s']:.2f}")  # fmt: skip
    print("(d) peak RSS: " + "; ".join(
        [f"{k} {r['peak_rss_mib']} MiB" for k, r in trainer["loops"].items()]
        + [f"{k} {r['peak_rss_mib']} MiB" for k, r in rollout.items() if "peak_rss_mib" in r]))  # fmt: skip
    report = {"bench": "real_model", "model": str(model_dir),
              "settings": {"prompts": len(prompts), "n": args.n, "max_new_tokens": args.new,
                           "micro_batch_size": args.micro_batch, "repeats": args.repeats},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load": os.getloadavg()[0]},
              "trainer": trainer, "rollout": rollout, "agreement": agreement,
              "ratios": {"trainer_vs_bare": round(ours["tokens_per_s"] / bare["tokens_per_s"], 3),
                         **{f"{k}_vs_generate": round(r["tokens_per_s"] / base_gen, 3) for k, r in rollout.items()}}}  # fmt: skip
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
