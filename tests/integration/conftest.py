from pathlib import Path

import pytest
import torch

from app.config import load_config
from app.training.bootstrap import bootstrap
from trainer.model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer, save_model

REPO = Path(__file__).resolve().parents[2]
TINY = TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)

# One-operation arithmetic: a space small enough that a short warm start gets a fair share right, so RL
# steps in the tests see groups with mixed rewards (non-zero advantages) and really move the weights.
TINY_DATA = ["data.arithmetic.max_ops=1", "data.num_train=200", "data.num_eval=24", "eval.num_prompts=24"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two tiny models of one architecture (`TINY`) with different weights: (dir_a, dir_b)."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(TINY, tokenizer)
    root = tmp_path_factory.mktemp("local_server")
    save_model(model, tokenizer, root / "a")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    save_model(model, tokenizer, root / "b")
    return root / "a", root / "b"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 built in code and briefly warm-started (a real HF directory, no downloads)."""
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [*TINY_DATA, "model.sft.steps=150", "model.sft.lr=3e-3"])
    out = tmp_path_factory.mktemp("models") / "tiny"
    return bootstrap(cfg.model, cfg.data, out, show_progress=False)


# The arithmetic task with tool transcripts: a ```python block printing the expression, its output, the answer.
TOOL_DATA = ["data.arithmetic.max_ops=1", "data.arithmetic.solutions=tool", "data.num_train=200", "data.num_eval=24",
             "eval.num_prompts=24"]  # fmt: skip
TOOL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
"""Small, and a shape real SGLang's CPU attention serves (head_dim 16), so its tests share the model."""


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 warm-started on the arithmetic task's tool transcripts (the tools' outputs masked): it writes
    ```python blocks and reads the output blocks an episode appends."""
    shape = [f"model.tiny.{k}={v}" for k, v in TOOL_SHAPE.items()]
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [*TOOL_DATA, *shape, "model.sft.steps=250", "model.sft.lr=1e-2"])
    return bootstrap(cfg.model, cfg.data, tmp_path_factory.mktemp("models") / "tool", show_progress=False)
