"""Rollout throughput of EmbeddedEngine against transformers' ``model.generate`` on the same batch.

A random ~1M-parameter Qwen2 (hidden 128, intermediate 512, 4 layers, 4 heads, 2 KV heads, vocab 259), one
torch thread, 32 prompts x 8 samples = 256 sequences of 5-15 prompt tokens, up to 8 new tokens, T = 1.
A random model rarely samples EOS, so a few ids are made stop tokens to get the mixed 2-8 token lengths of RL.

    .venv/bin/python bench/generation.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from app.rollout.base import SamplingParams
from app.rollout.embedded import EmbeddedEngine


def build_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=259,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(config).eval()


def time_it(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = build_model()
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 259) for _ in range(rng.randint(5, 15))] for _ in range(32)]
    stop = tuple(range(2, 40))  # ~15% of the vocabulary: lengths of a few tokens, like short RL answers
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=8, stop_token_ids=stop, seed=0)
    engine = EmbeddedEngine(model, eos_token_id=1, pad_token_id=0)
    print(f"model parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")

    rows = []
    for name, p in [("embedded, stops", params), ("embedded, 8 tokens", SamplingParams(8, 1.0, n=8, seed=0))]:
        seconds = time_it(lambda p=p: engine.generate_sync(prompts, p), args.repeats)
        out = engine.generate_sync(prompts, p)
        new_tokens = sum(len(c.output_ids) for c in out)
        rows.append((name, len(out), new_tokens, seconds))

    # transformers' generate on the same left-padded batch (no per-token logprobs gathered here).
    seqs = [q for q in prompts for _ in range(8)]
    width = max(map(len, seqs))
    ids = torch.tensor([[0] * (width - len(q)) + q for q in seqs])
    mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in seqs])

    def hf_generate():
        with torch.inference_mode():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=8,
                eos_token_id=[1, *stop],
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )

    seconds = time_it(hf_generate, args.repeats)
    out = hf_generate()
    gen = out.sequences[:, width:]
    stopped = torch.isin(gen, torch.tensor([1, *stop]))
    first = torch.where(stopped.any(1), stopped.int().argmax(1) + 1, torch.full((len(seqs),), gen.shape[1]))
    rows.append(("hf generate, stops", len(seqs), int(first.sum()), seconds))

    print(f"{'engine':<22}{'seqs':>6}{'new tok':>9}{'seconds':>9}{'compl/s':>10}{'tok/s':>10}")
    for name, n, tok, s in rows:
        print(f"{name:<22}{n:>6}{tok:>9}{s:>9.4f}{n / s:>10.0f}{tok / s:>10.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [dict(name=r[0], sequences=r[1], new_tokens=r[2], seconds=r[3]) for r in rows], f, indent=1
            )


if __name__ == "__main__":
    main()
