from pathlib import Path

import pytest

from app.bootstrap import bootstrap
from app.config import load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 built in code and briefly warm-started (a real HF directory, no downloads)."""
    cfg = load_config(REPO / "configs" / "quickstart.yaml",
                      ["model.sft.steps=30", "data.num_train=500", "data.num_eval=100", "eval.num_prompts=100"])
    out = tmp_path_factory.mktemp("models") / "tiny"
    return bootstrap(cfg.model, cfg.data, out, show_progress=False)
