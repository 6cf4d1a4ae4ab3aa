"""Rollout throughput of the built-in CPU server against real SGLang 0.5.23 on CPU, through one client.

Both engines serve the same tiny Qwen2 (trainer.model defaults: hidden 128, intermediate 512, 4 layers, 4/2
heads, byte vocabulary of 259; about 1M parameters, float32) on one torch thread each, and both are driven
by trustbatch's SGLangClient with the same settings (32 prompts per request, 4 requests in flight). Each cell is
``batch`` prompts of 8-15 random tokens, ``n`` samples each, up to ``new`` new tokens at T = 1 (a random model
seldom samples EOS, so nearly every completion has ``new`` tokens). One warm-up call, then the median of
``--repeats`` timed calls. Only the servers run on the machine while a cell is measured (the other is idle).

    .venv/bin/python bench/rollout_engines.py [--repeats 3] [--out bench/results/rollout_engines.json]

Needs .venv-sglang (`make sglang-env`) for the SGLang column; without it only the built-in server is measured.
SGLang runs with --max-total-tokens 131072 (enough KV cache for 128 x 8 sequences of 79 tokens at once; the
tests use SGLang's CPU default of 4096) and --dtype float32 (SGLang's auto would serve this float32 checkpoint in
half precision). Writes the JSON and a PNG beside it (bench/results/ is git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from app.rollout.base import SamplingParams  # noqa: E402
from app.rollout.process import LocalServerProcess  # noqa: E402
from app.rollout.sglang import SGLangClient, SGLangClientConfig  # noqa: E402
from app.rollout.sglang_server import SGLangLaunchConfig, launch_servers  # noqa: E402

SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
CELLS = [(batch, 8, new) for new in (8, 64) for batch in (8, 32, 128)]


def build_model(path: Path) -> None:
    import torch

    from trainer.model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer, save_model

    torch.set_num_threads(1)
    tokenizer = build_tiny_tokenizer()
    save_model(build_tiny_model(TinyModelConfig(max_position_embeddings=512), tokenizer), tokenizer, path)


async def measure(url: str, repeats: int) -> list[dict]:
    cfg = SGLangClientConfig(urls=[url], timeout_s=600, max_retries=0, health_timeout_s=300)
    rows = []
    async with SGLangClient(cfg) as client:
        await client.wait_healthy()
        rng = random.Random(0)
        for batch, n, new in CELLS:
            prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(8, 15))] for _ in range(batch)]
            params = SamplingParams(max_new_tokens=new, temperature=1.0, n=n)
            await client.generate(prompts, params)  # warm-up
            times, tokens = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                completions = await client.generate(prompts, params)
                times.append(time.perf_counter() - start)
                tokens.append(sum(len(c.output_ids) for c in completions))
            seconds = statistics.median(times)
            rows.append({"batch": batch, "n": n, "new": new, "completions": batch * n,
                         "new_tokens": round(statistics.mean(tokens)), "seconds": round(seconds, 4),
                         "completions_per_s": round(batch * n / seconds, 1),
                         "tokens_per_s": round(statistics.mean(tokens) / seconds, 1)})  # fmt: skip
            print(f"  batch {batch:>3} x n {n} x {new:>2} tokens: {rows[-1]['tokens_per_s']:>9.0f} tok/s", flush=True)
    return rows


def run_builtin(model_dir: Path, log_dir: Path, repeats: int) -> list[dict]:
    server = LocalServerProcess(model_dir, max_batch_size=1024, log_path=log_dir / "builtin.log")
    server.start()
    try:
        return asyncio.run(measure(server.url, repeats))
    finally:
        server.stop()


def run_sglang(model_dir: Path, log_dir: Path, repeats: int) -> list[dict]:
    cfg = SGLangLaunchConfig(num_servers=1, python=str(SGLANG_PYTHON), cpu=True, dtype="float32",
                             max_total_tokens=131072, random_seed=0, extra_args=["--log-level", "warning"])  # fmt: skip
    [server] = launch_servers(cfg, model_dir, log_dir)
    try:
        return asyncio.run(measure(server.url, repeats))
    finally:
        server.stop()


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{b}x{n}\n{new} tok" for b, n, new in CELLS]
    width = 0.8 / len(results)
    for k, (engine, rows) in enumerate(results.items()):
        for ax, key in zip(axes, ("tokens_per_s", "completions_per_s"), strict=True):
            xs = [i + (k - (len(results) - 1) / 2) * width for i in range(len(rows))]
            ax.bar(xs, [r[key] for r in rows], width, label=engine)
    for ax, title in zip(axes, ("new tokens / s", "completions / s"), strict=True):
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("prompts x samples, new tokens")
        ax.legend()
    fig.suptitle("Rollout throughput, tiny Qwen2 on CPU (1 thread per server), via SGLangClient")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "rollout_engines.json"))
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    skipped = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, logs = Path(tmp) / "model", out.parent / "rollout_engines_logs"
        build_model(model_dir)
        print("built-in CPU server (trustbatch rollout-server):", flush=True)
        results["built-in"] = run_builtin(model_dir, logs, args.repeats)
        if SGLANG_PYTHON.exists():
            print("SGLang 0.5.23 on CPU:", flush=True)
            results["sglang"] = run_sglang(model_dir, logs, args.repeats)
        else:
            skipped["sglang"] = f"no {SGLANG_PYTHON}: build it with `make sglang-env`"
            print(f"sglang: skipped ({skipped['sglang']})")

    print(f"\n{'batch x n, new':>15} | {'engine':>9} {'compl/s':>9} {'tok/s':>9} {'seconds':>8}")
    for i, (batch, n, new) in enumerate(CELLS):
        for engine, rows in results.items():
            r = rows[i]
            print(f"{f'{batch} x {n}, {new}':>15} | {engine:>9} {r['completions_per_s']:>9.0f} "
                  f"{r['tokens_per_s']:>9.0f} {r['seconds']:>8.3f}")  # fmt: skip
        if len(results) == 2:
            ratio = results["sglang"][i]["tokens_per_s"] / results["built-in"][i]["tokens_per_s"]
            print(f"{'':>15} | {'sglang/built-in tokens/s':>30} = {ratio:.2f}")
    report = {"bench": "rollout_engines", "cells": [dict(zip(("batch", "n", "new"), c, strict=True)) for c in CELLS],
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
              "repeats": args.repeats, "results": results, "skipped": skipped}  # fmt: skip
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
