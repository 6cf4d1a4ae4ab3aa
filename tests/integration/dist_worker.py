"""torchrun worker for tests/integration/test_distributed.py, and the shared builders of the train-step tests.

Run as `python -m torch.distributed.run --nproc_per_node=2 dist_worker.py OUT_DIR`: every rank builds the same
seeded tiny Qwen2 and the same global TrainBatch, shards the model with `shard_model` (gloo, CPU), takes its
rows of the batch and runs the scenarios of `SCENARIOS` (2 train_steps each). Rank r writes
`OUT_DIR/rank{r}.pt` with the per-step metrics and the `full_state_dict` after the steps. The test runs the same
scenarios in one process with `LocalReducer` and no sharding (`run_scenario(..., rank=0, world_size=1)`).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers import Qwen2ForCausalLM  # noqa: E402

from tests.helpers import random_qwen2  # noqa: E402
from trainer.logprobs import token_logprobs  # noqa: E402
from trainer.lora import LoraConfig, apply_lora  # noqa: E402
from trainer.objective import ObjectiveConfig  # noqa: E402
from trainer.optim import OptimConfig, build_optimizer  # noqa: E402
from trainer.step import TrainBatch, TrainerConfig, train_step  # noqa: E402

VOCAB = 64
GLOBAL_ROWS = 7
PROBE_IDS = [(7 * i) % VOCAB for i in range(1, 40)]

# name -> (objective, trainer config, rows of the global batch per rank for world size 2, optimizer).
# "micro_batch": one micro-batch per rank, so the per-micro-batch ESS over both ranks is the whole batch's ESS,
#   as in the one-process reference (which runs one micro-batch of all rows). AdamW + linear schedule.
# "step_uneven": a 5/2 row split with micro_batch_size 2 -> 3 vs 1 micro-batches, so rank 1 runs two padding
#   micro-batches; per-step ESS; an entropy bonus; sampling temperature 0.9 (TEMPERATURE). AdamW.
# "sgd_gradient": as step_uneven but plain SGD without clipping, so the weight change IS the gradient: this
#   pins the DP-scaling convention directly (AdamW's normalisation amplifies rounding on tiny gradients).
# "sequence_diagnosed": as sgd_gradient with per-sequence ESS and the per-term gradient-norm diagnostics.
# "lora": as step_uneven with LoRA adapters injected before sharding (trainer/lora.py); the merged weights that
#   a publication sends (`state_dict_for_sync`) are compared as well.
# "shared_prompts": as sgd_gradient with trainer.share_prompts on a batch whose rows share prompts in pairs (one
#   pair split across the ranks): the packed forward with its 4D block mask under FSDP2, padding micro-batches too.
TEMPERATURE = {"step_uneven": 0.9}
SCENARIOS: dict[str, tuple[ObjectiveConfig, TrainerConfig, tuple[int, int], str]] = {
    "micro_batch": (ObjectiveConfig(name="ess"), TrainerConfig(micro_batch_size=8), (4, 3), "adamw"),
    "step_uneven": (
        ObjectiveConfig(name="ess", entropy_coef=0.01),
        TrainerConfig(micro_batch_size=2, ess_scope="step"),
        (5, 2),
        "adamw",
    ),
    "sgd_gradient": (
        ObjectiveConfig(name="ess"),
        TrainerConfig(micro_batch_size=2, ess_scope="step", max_grad_norm=0.0),
        (5, 2),
        "sgd",
    ),
    "sequence_diagnosed": (
        ObjectiveConfig(name="ess"),
        TrainerConfig(micro_batch_size=2, ess_scope="sequence", max_grad_norm=0.0),
        (5, 2),
        "sgd",
    ),
    "shared_prompts": (
        ObjectiveConfig(name="ess"),
        TrainerConfig(micro_batch_size=2, ess_scope="step", max_grad_norm=0.0, share_prompts=True),
        (5, 2),
        "sgd",
    ),
}
SCENARIOS["lora"] = (ObjectiveConfig(name="ess"), TrainerConfig(micro_batch_size=2, ess_scope="step"), (5, 2), "adamw")
LORA = {"lora": LoraConfig(rank=4, alpha=8.0)}  # "lora": LoRA adapters (trainer/lora.py) on every linear, AdamW
SHARED_PROMPTS = {"shared_prompts": 3}  # build_batch(..., shared_prompts=3) for these scenarios
DIAGNOSE = {"sequence_diagnosed"}  # train_step(..., diagnose=True): the per-term gradient norms as well
OPTIM = OptimConfig(lr=1e-2, schedule="linear", warmup_steps=1, weight_decay=0.01)
SGD_LR = 0.1
STEPS = 2


def build_model(seed: int = 0) -> Qwen2ForCausalLM:
    """A tiny random float32 Qwen2 (vocab 64, hidden 32, 2 layers), identical for the same seed."""
    return random_qwen2(seed, vocab_size=VOCAB, tie_word_embeddings=False)


def build_batch(
    model: torch.nn.Module, seed: int = 0, rows: int = GLOBAL_ROWS, temperature: float = 1.0,
    shared_prompts: int = 0,
) -> TrainBatch:
    """A right-padded off-policy batch: prompts of 3 tokens, responses of 2-9 tokens.

    `shared_prompts` > 0: rows take their prompt in pairs, cycling through that many prompts (2i and 2i + 1
    share one), as the completions of a group do; 0 (default): every row its own random prompt.

    Behaviour logprobs are the model's own (at `temperature`) plus Gaussian noise, so ratios spread around 1
    and ESS < 1; padded positions hold NaN behaviour logprobs (never read). One response token has a NaN
    behaviour logprob and must be dropped.
    """
    gen = torch.Generator().manual_seed(seed)
    prompt, length = 3, 12
    prompts = torch.randint(1, VOCAB, (max(shared_prompts, 1), prompt), generator=torch.Generator().manual_seed(99))
    input_ids = torch.zeros(rows, length, dtype=torch.long)
    attention_mask = torch.zeros(rows, length, dtype=torch.long)
    loss_mask = torch.zeros(rows, length, dtype=torch.bool)
    for i in range(rows):
        n = prompt + int(torch.randint(2, length - prompt + 1, (1,), generator=gen))
        input_ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=gen)
        if shared_prompts:
            input_ids[i, :prompt] = prompts[(i // 2) % shared_prompts]
        attention_mask[i, :n] = 1
        loss_mask[i, prompt:n] = True
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, input_ids, attention_mask, temperature=temperature)
    old = logprobs + 0.3 * torch.randn(rows, length, generator=gen)
    old = torch.where(loss_mask, old, torch.full_like(old, float("nan")))
    old[1, prompt] = float("nan")
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, length).clone()
    advantages = torch.where(loss_mask, advantages, 0.0)
    return TrainBatch(input_ids, attention_mask, loss_mask, old.float(), advantages.float(), temperature=temperature)


def rows_of(batch: TrainBatch, start: int, stop: int) -> TrainBatch:
    return TrainBatch(
        batch.input_ids[start:stop],
        batch.attention_mask[start:stop],
        batch.loss_mask[start:stop],
        batch.old_logprobs[start:stop],
        batch.advantages[start:stop],
        temperature=batch.temperature,
    )


def run_scenario(name: str, reducer, *, rank: int, world_size: int, shard) -> dict:
    """Build the model (sharded by `shard` if given) and run STEPS train_steps; returns metrics + weights."""
    from trainer.distributed import full_state_dict
    from trainer.weights import state_dict_for_sync

    objective, trainer_cfg, split, optimizer_kind = SCENARIOS[name]
    model = build_model(seed=0)
    if name in LORA:
        apply_lora(model, LORA[name])  # lora_A's initial values come from the seeded torch RNG, as on every rank
    batch = build_batch(
        model, seed=1, temperature=TEMPERATURE.get(name, 1.0), shared_prompts=SHARED_PROMPTS.get(name, 0)
    )
    if world_size > 1:
        start = sum(split[:rank])
        batch = rows_of(batch, start, start + split[rank])
        model = shard(model)
    if optimizer_kind == "sgd":
        optimizer, scheduler = torch.optim.SGD(model.parameters(), lr=SGD_LR), None
    else:
        optimizer, scheduler = build_optimizer(model, OPTIM, total_steps=STEPS)
    metrics = [
        train_step(
            model, optimizer, batch, objective, reducer, trainer_cfg, scheduler=scheduler, diagnose=name in DIAGNOSE
        )
        for _ in range(STEPS)
    ]
    result = {"metrics": metrics, "state": full_state_dict(model)}
    if name == "micro_batch":  # the publication check's reference of a bf16 engine: each rank rounds its shard
        from app.rollout.joint import reference_logprobs

        result["bf16_reference"] = reference_logprobs(model, PROBE_IDS, weight_dtype="bfloat16")
        after = full_state_dict(model)
        result["restored"] = all(torch.equal(after[k], v) for k, v in result["state"].items())
    if name in LORA:
        result["merged"] = state_dict_for_sync(model, every_rank=True)
    return result


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    from trainer.distributed import ProcessGroupReducer, destroy_distributed, init_distributed, shard_model

    info = init_distributed()
    assert info.backend == "gloo" and info.world_size == 2, info
    reducer = ProcessGroupReducer()
    results = {
        name: run_scenario(name, reducer, rank=info.rank, world_size=info.world_size, shard=shard_model)
        for name in SCENARIOS
    }
    # The reducer itself: SUM and MAX of rank-dependent values, float64 and int64.
    results["reducer"] = {
        "sum": reducer.sum_(torch.tensor([1.0 + info.rank, 0.5], dtype=torch.float64)).tolist(),
        "max": reducer.max_(torch.tensor([3 - info.rank, info.rank], dtype=torch.int64)).tolist(),
    }
    # bf16 mixed precision through shard_model: one step must stay finite and close to float32.
    objective, trainer_cfg, split, _ = SCENARIOS["micro_batch"]
    model = shard_model(build_model(seed=0), param_dtype="bf16")
    start = sum(split[: info.rank])
    batch = rows_of(build_batch(build_model(seed=0), seed=1), start, start + split[info.rank])
    optimizer, _ = build_optimizer(model, OPTIM, total_steps=1)
    results["bf16"] = train_step(model, optimizer, batch, objective, reducer, trainer_cfg)
    torch.save(results, os.path.join(out_dir, f"rank{info.rank}.pt"))
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
