"""LoRA adapters (trainer/lora.py): injected in place, only they train, and what leaves the trainer is merged.

Covered: at the start the adapted model computes exactly what the base does; only the LoRA matrices require
gradients and reach the optimizer; the merged state dict loads into a plain copy of the architecture and gives
the adapted model's log-probabilities; the adapter directory is a PEFT directory whose merge equals ours; bad
settings are refused; and a short `train` run with `trainer.lora.rank=4` publishes merged versions that pass
the weight-publication check, moves the weights, and leaves a plain HF `model/` plus an `adapter/` in each
checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from app.training.loop import run
from trainer.logprobs import token_logprobs
from trainer.lora import LoraConfig, apply_lora, merged_state_dict, save_adapter
from trainer.optim import OptimConfig, build_optimizer

from .test_loop import small_config

IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 64, 12]])


def logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model, IDS, torch.ones_like(IDS))[0]


def adapted(model_dir, rank: int = 4):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return apply_lora(model, LoraConfig(rank=rank, alpha=8.0))


def train_a_little(model) -> None:
    optimizer, _ = build_optimizer(model, OptimConfig(lr=1e-2), total_steps=10)
    for _ in range(3):
        loss = -token_logprobs(model, IDS, torch.ones_like(IDS))[0].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_only_the_adapters_train_and_the_start_is_the_base(tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = adapted(tiny_model_dir)
    assert torch.equal(logprobs(model), logprobs(base))  # lora_B starts at zero
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimizer, _ = build_optimizer(model, OptimConfig(lr=1e-2), total_steps=10)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}
    frozen_before = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    train_a_little(model)
    assert not torch.equal(logprobs(model), logprobs(base))
    assert all(torch.equal(p, frozen_before[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_the_merged_weights_are_the_adapted_model(tiny_model_dir, tmp_path):
    model = adapted(tiny_model_dir)
    train_a_little(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    merged = merged_state_dict(state, model.trustbatch_lora.scaling)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert set(merged) == set(plain.state_dict())  # the base model's own names, nothing more
    plain.load_state_dict(merged)
    assert torch.allclose(logprobs(plain), logprobs(model), atol=1e-5)

    import peft

    save_adapter(state, model.trustbatch_lora, str(tiny_model_dir), tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    assert all(torch.allclose(theirs[k], merged[k], atol=1e-6) for k in merged)


def test_an_adapter_directory_given_as_a_model_is_refused(tiny_model_dir, tmp_path):
    from trainer.model import load_model

    model = adapted(tiny_model_dir)
    save_adapter(model.state_dict(), model.trustbatch_lora, str(tiny_model_dir), tmp_path / "adapter")
    with pytest.raises(FileNotFoundError, match="is a LoRA adapter"):
        load_model(str(tmp_path / "adapter"))


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"rank": -1}, "rank"),
        ({"rank": 2, "alpha": 0}, "alpha"),
        ({"rank": 2, "target_modules": []}, "target_modules"),
    ],
)
def test_bad_settings_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        LoraConfig(**kwargs)


def test_a_target_the_model_lacks_is_refused(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="trainer.lora"):
        apply_lora(model, LoraConfig(rank=2, target_modules=["no_such_proj"]))


@pytest.mark.slow
def test_a_lora_run_publishes_checks_and_checkpoints_merged_weights(tmp_path, tiny_model_dir):
    cfg = small_config(tmp_path, tiny_model_dir, "trainer.lora.rank=4", "optim.lr=1e-2", "eval.every=0",
                       "eval.greedy=false", "eval.num_prompts=8")  # fmt: skip
    summary = run(cfg)
    run_dir = tmp_path / "run"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gaps = [m["weights/probe_gap"] for m in metrics if "weights/probe_gap" in m]
    assert gaps and max(gaps) < 1e-4  # the engine serves the merged weights the trainer computes with
    checkpoint = run_dir / "checkpoints" / f"step-{summary['steps']:06d}"
    final = AutoModelForCausalLM.from_pretrained(checkpoint / "model", dtype=torch.float32)
    assert not any("lora" in k for k in final.state_dict())
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert not torch.equal(logprobs(final), logprobs(start))
    config = json.loads((checkpoint / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
