from pathlib import Path

import pytest

from app.config import load_config
from app.training.bootstrap import bootstrap

REPO = Path(__file__).resolve().parents[2]

# One-operation arithmetic: a space small enough that a short warm start gets a fair share right, so RL
# steps in the tests see groups with mixed rewards (non-zero advantages) and really move the weights.
TINY_DATA = ["data.arithmetic.max_ops=1", "data.num_train=200", "data.num_eval=24", "eval.num_prompts=24"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 built in code and briefly warm-started (a real HF directory, no downloads)."""
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [*TINY_DATA, "model.sft.steps=150", "model.sft.lr=3e-3"])
    out = tmp_path_factory.mktemp("models") / "tiny"
    return bootstrap(cfg.model, cfg.data, out, show_progress=False)
