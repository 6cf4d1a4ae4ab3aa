"""Follow the training signal through one RL step on a real model: which way does each penalised token move?

Issue 40: after 64 steps of math RL, SmolLM2 wrote additions ten too high ("28 + 60 = 98") three times as
often, although the reward marks every one of them wrong. This script takes one step exactly as a run's first
step is taken (the run's config, its first ticket's prompts and seed, its engine dtype, `train_step` with the
run's objective and trainer settings) and reports, for each completion:
- its reward and advantage, the ESS, the weight ρ and the behaviour-KL coefficient on its tokens;
- the change of its sequence logprob after the optimizer step, and of each arithmetic statement's result
  digits, read in float32 and in bf16 (autocast);
and, over the batch, the mean change of the penalised (A < 0) and the rewarded (A > 0) completions' logprobs.

    .venv/bin/python bench/signal_trace.py configs/smollm2-math.yaml model.path=<SFT model dir>
    .venv/bin/python bench/signal_trace.py configs/smollm2-math.yaml model.path=... --variants \\
        trainer.compute_dtype=float32 objective.name=ppo_clip objective.name=reinforce

Each variant is the same batch (sampled once, by the config's engine dtype) trained from the same weights with
one override changed; rows in the output say which.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.config import load_config  # noqa: E402
from app.data.prepare import ModelText  # noqa: E402
from app.data.sources import load_split  # noqa: E402
from app.models import resolve_model  # noqa: E402
from app.rollout.base import SamplingParams  # noqa: E402
from app.rollout.embedded import EmbeddedEngine  # noqa: E402
from app.scoring import rewards_with_sandbox, score_texts  # noqa: E402
from app.training.batching import build_train_batch  # noqa: E402
from app.training.sampler import PromptSampler  # noqa: E402
from app.training.setup import run_prompts  # noqa: E402
from bench.arithmetic_errors import error_class, statements  # noqa: E402
from rewards.runner import RewardRunner  # noqa: E402
from trainer.advantages import group_advantages, informative_groups  # noqa: E402
from trainer.distributed import LocalReducer  # noqa: E402
from trainer.logprobs import token_logprobs  # noqa: E402
from trainer.model import load_model  # noqa: E402
from trainer.objective import ess_from_sums, ess_partial_sums, importance_ratio, valid_token_mask  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402
from trainer.precision import compute  # noqa: E402
from trainer.step import train_step  # noqa: E402


def sequence_logprobs(model, batch, dtype: str) -> torch.Tensor:
    """[B, L] logprob of every token under `model`, its forward in `dtype` (float32, or bf16 autocast)."""
    with torch.no_grad(), compute(model, dtype):
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=batch.temperature,
                                     loss_mask=batch.loss_mask)
    return logprobs


def digit_positions(tokenizer, output_ids: list[int]) -> list[dict]:
    """Each arithmetic statement of a completion with the token columns (within the output) of its result."""
    pieces = [tokenizer.decode(output_ids[: k + 1], skip_special_tokens=True) for k in range(len(output_ids))]
    text = pieces[-1] if pieces else ""
    found, start = [], 0
    for a, op, b, c in statements(text):
        needle = f"= {c}"
        at = text.find(needle, start)
        if at < 0:
            continue
        begin, end = at + 2, at + 2 + len(str(c))
        start = end
        spans = [(len(pieces[k - 1]) if k else 0, len(piece)) for k, piece in enumerate(pieces)]
        tokens = [k for k, (lo, hi) in enumerate(spans) if lo < end and hi > begin]
        found.append({"statement": f"{a} {op} {b} = {c}", "class": error_class(a, op, b, c), "tokens": tokens})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--variants", nargs="*", default=[], help="one override each, trained on the same batch")
    parser.add_argument("--ticket", type=int, default=1, help="which ticket's prompts and seed (a run's step)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)

    cfg = load_config(args.config, args.overrides)
    ref = cfg.model.path
    model_dir = resolve_model(ref, tracking_uri=cfg.tracking_uri) if ":/" in ref else Path(ref)
    model, tokenizer = load_model(str(model_dir))
    model.eval()
    text = ModelText.from_model(model, tokenizer, str(model_dir))
    rows = load_split(cfg.data, "train")
    sets = run_prompts(cfg, text, rows, rows[:1])
    r = cfg.rollout
    sampler = PromptSampler(len(sets.train.rows), cfg.run.seed, cursor=(args.ticket - 1) * r.prompts_per_step)
    chosen = sampler.take(r.prompts_per_step)
    engine = EmbeddedEngine(copy.deepcopy(model).to(getattr(torch, r.dtype)), eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                            n=r.group_size, stop_token_ids=text.stop_token_ids,
                            seed=cfg.run.seed * 100_003 + args.ticket * 64)
    completions = engine.generate_sync([sets.train.ids[i] for i in chosen], params)
    del engine
    texts = [text.decode(c.output_ids) for c in completions]
    batch_rows = [sets.train.rows[i] for i in chosen for _ in range(r.group_size)]
    with RewardRunner(rewards_with_sandbox(cfg.rewards, cfg.sandbox)) as runner:
        scores, _ = score_texts(runner, batch_rows, texts)

    rewards = torch.tensor([s.reward for s in scores], dtype=torch.float32).view(-1, r.group_size)
    advantages, _ = group_advantages(rewards, scale_by_std=cfg.advantage.scale_by_std)
    keep = list(range(rewards.shape[0]))
    if cfg.advantage.drop_zero_variance_groups:
        keep = informative_groups(rewards).nonzero().flatten().tolist() or [0]
    kept = [g * r.group_size + k for g in keep for k in range(r.group_size)]
    batch = build_train_batch([completions[i] for i in kept], advantages[keep].flatten().tolist(),
                              pad_id=tokenizer.pad_token_id, temperature=r.temperature)
    print(f"ticket {args.ticket}: {len(completions)} completions, reward mean {rewards.mean():.3f}, "
          f"{len(keep)} informative groups of {rewards.shape[0]} -> {len(kept)} rows trained")

    results = {"variants": {}}
    variants = [("config", [])] + [(v, [v]) for v in args.variants]
    for label, extra in variants:
        vcfg = load_config(args.config, [*args.overrides, *extra])
        trained = copy.deepcopy(model)
        trained.train(False)
        optimizer, scheduler = build_optimizer(trained, vcfg.optim, vcfg.run.steps)
        before = {d: sequence_logprobs(trained, batch, d) for d in ("float32", "bfloat16")}
        vbatch = batch
        # The batch's behaviour logprobs are the engine's (the config's rollout.dtype); ESS, rho and KL from them.
        valid = valid_token_mask(vbatch.loss_mask, vbatch.old_logprobs)
        current = before[vcfg.trainer.compute_dtype]
        ratio = importance_ratio(current, vbatch.old_logprobs, valid, vcfg.objective.max_log_ratio)
        ess = ess_from_sums(ess_partial_sums(ratio, valid))
        metrics = train_step(trained, optimizer, vbatch, vcfg.objective, LocalReducer(), vcfg.trainer,
                             scheduler=scheduler)
        after = {d: sequence_logprobs(trained, batch, d) for d in ("float32", "bfloat16")}
        rows_out, summary = [], {"penalised": [], "rewarded": []}
        for row, index in enumerate(kept):
            mask = valid[row]
            adv = float(batch.advantages[row][mask][0]) if mask.any() else 0.0
            change = {d: float((after[d][row] - before[d][row])[mask].sum()) for d in before}
            stats = []
            for s in digit_positions(tokenizer, completions[index].output_ids):
                cols = [len(completions[index].prompt_ids) + t for t in s["tokens"]]
                stats.append({**s, "delta_logprob": {
                    d: [round(float(after[d][row, c] - before[d][row, c]), 6) for c in cols] for d in before}})
            rho = torch.clamp(ratio[row][mask], max=ess)
            rows_out.append({
                "completion": index, "reward": scores[index].reward, "advantage": adv, "text": texts[index],
                "rho_min": float(rho.min()) if mask.any() else None, "ratio_max": float(ratio[row][mask].max()),
                "delta_seq_logprob": change, "statements": stats,
            })
            if adv < 0:
                summary["penalised"].append(change)
            elif adv > 0:
                summary["rewarded"].append(change)
        means = {
            side: {d: sum(c[d] for c in changes) / max(len(changes), 1) for d in ("float32", "bfloat16")}
            for side, changes in summary.items()
        }
        moved = {
            side: {d: sum(c[d] < 0 if side == "penalised" else c[d] > 0 for c in changes) for d in ("float32", "bfloat16")}
            for side, changes in summary.items()
        }
        print(f"\n[{label}] ESS {ess:.4f}, loss {metrics['loss/total'] if 'loss/total' in metrics else float('nan'):.4g}, "
              f"grad norm {metrics['train/grad_norm']:.3g}, lr {metrics['train/lr']:.3g}")
        for side in ("penalised", "rewarded"):
            n = len(summary[side])
            print(f"  {side:>9} ({n:3d}): mean Δ seq logprob float32 {means[side]['float32']:+.4f}, "
                  f"bf16 {means[side]['bfloat16']:+.4f}; moved the right way {moved[side]['float32']}/{n} "
                  f"(float32), {moved[side]['bfloat16']}/{n} (bf16)")
        for item in rows_out:
            wrong = [s for s in item["statements"] if s["class"] in ("+10", "-10")]
            for s in wrong:
                print(f"  off by ten, reward {item['reward']:.0f}, A {item['advantage']:+.3f}: {s['statement']!r} "
                      f"Δ logprob of its result tokens {s['delta_logprob']}; Δ seq {item['delta_seq_logprob']}")
        results["variants"][label] = {"ess": ess, "metrics": metrics, "mean_change": means, "moved": moved,
                                      "rows": rows_out}
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
