"""GPU checks (skipped without CUDA): one train_step and one generation on the device, bf16 and fp32 agree."""

import pytest
import torch

from tests.integration.dist_worker import build_batch, build_model
from trainer.distributed import LocalReducer
from trainer.objective import ObjectiveConfig
from trainer.optim import OptimConfig, build_optimizer
from trainer.step import TrainBatch, TrainerConfig, train_step

pytestmark = pytest.mark.gpu


def _on(batch: TrainBatch, device: str) -> TrainBatch:
    return TrainBatch(*(t.to(device) for t in (batch.input_ids, batch.attention_mask, batch.loss_mask,
                                                batch.old_logprobs, batch.advantages)),
                      temperature=batch.temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_train_step_on_cuda_matches_cpu(dtype):
    cpu_model = build_model(seed=0)
    batch = build_batch(cpu_model, seed=1)
    optimizer, _ = build_optimizer(cpu_model, OptimConfig(lr=1e-3), total_steps=1)
    expected = train_step(cpu_model, optimizer, batch, ObjectiveConfig(), LocalReducer(), TrainerConfig())

    gpu_model = build_model(seed=0).to("cuda", dtype=dtype)
    optimizer, _ = build_optimizer(gpu_model, OptimConfig(lr=1e-3), total_steps=1)
    got = train_step(gpu_model, optimizer, _on(batch, "cuda"), ObjectiveConfig(), LocalReducer(), TrainerConfig())
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    assert got["loss/total"] == pytest.approx(expected["loss/total"], rel=tolerance, abs=tolerance)
    assert got["loss/ess"] == pytest.approx(expected["loss/ess"], rel=tolerance)
    assert got["train/skipped"] == 0.0
