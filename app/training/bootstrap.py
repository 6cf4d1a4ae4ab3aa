"""Build the tiny offline model and warm-start it, so RL starts from a non-zero accuracy without downloads.

`bootstrap` builds a byte-level tokenizer and a tiny Qwen2 in code (trainer/model.py), fine-tunes it with
`trustbatch sft`'s loop on `data.train` (prompt → completion + EOS, loss on the completion only) and saves a
normal Hugging Face directory that transformers, the rollout engines and SGLang load like any other model.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch

from app.config import ModelConfig
from app.data import DataConfig, load_split
from app.data.prepare import ModelText
from app.data.sft import tokenize_examples
from app.training.sft_loop import FitSettings, fit
from tools.formats import FencedFormat
from trainer.model import build_tiny_model, build_tiny_tokenizer, save_model

log = logging.getLogger("trustbatch")

MODEL_REFERENCES = ("models:/", "runs:/")
"""model.path prefixes that name a model in the MLflow store (a registered version, or a run's artifact)."""


def bootstrap(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    out: Path,
    *,
    show_progress: bool = True,
    draws: Literal["epochs", "replacement"] = "epochs",
) -> Path:
    """Build, warm-start and save the tiny model at `out`; returns `out`.

    The warm start is `trustbatch sft`'s own loop (app/training/sft_loop.py `fit`) on the rows of data.train, each
    prompt followed by its completion (builtin:arithmetic: the answer) and EOS, the loss on the completion only;
    AdamW at model.sft.lr with a cosine decay to 10%. Its batches come from seeded epochs over the rows
    (``draws="epochs"``, what `trustbatch sft` does); ``draws="replacement"`` draws each example independently
    instead, as the warm start did before it ran `fit` (bench/warm_start.py compares the two)."""
    if draws not in ("epochs", "replacement"):
        raise ValueError(f"draws={draws!r} is not one of 'epochs', 'replacement'")
    torch.manual_seed(model_cfg.tiny.seed)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(model_cfg.tiny, tokenizer)
    rows = load_split(data_cfg, "train", "sft")
    text = ModelText(tokenizer, model_cfg.tiny.max_position_embeddings, "model.tiny (model.bootstrap=true)")
    # Tool transcripts (data.arithmetic.solutions=tool): the tool's output blocks are context, not targets.
    tool = any(s.source == "builtin:arithmetic" for s in data_cfg.sources("train")) and data_cfg.arithmetic.solutions == "tool"
    transcripts = dict(transcripts=FencedFormat(), tool_tasks=frozenset({"math"})) if tool else {}
    examples = tokenize_examples(rows, text, on_long="drop", source=data_cfg.describe("train"), **transcripts).examples
    sft = model_cfg.sft
    if draws == "replacement" and examples:  # steps x batch_size independent draws: `fit` then takes one epoch
        rng = random.Random(model_cfg.tiny.seed)
        examples = [examples[rng.randrange(len(examples))] for _ in range(sft.steps * sft.batch_size)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, sft.steps) / max(sft.steps, 1)))
    )
    metrics: dict[str, float] = {}
    if sft.steps:
        settings = FitSettings(
            steps=sft.steps, batch_size=sft.batch_size, micro_batch_size=sft.batch_size, max_grad_norm=1.0,
            seed=model_cfg.tiny.seed, label="bootstrap SFT", show_progress=show_progress,
        )  # fmt: skip
        metrics = fit(model, optimizer, scheduler, tokenizer.pad_token_id, examples, [], settings)
    model.eval()
    save_model(model, tokenizer, out)
    log.info(
        "bootstrapped tiny model (%d parameters, SFT loss %.3f) at %s",
        sum(p.numel() for p in model.parameters()),
        metrics.get("sft/loss", float("nan")),
        out,
    )
    return out


def ensure_model(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    *,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
    tracking_uri: str | None = None,
) -> Path:
    """The model directory to train: `model.path` itself, bootstrapped first when asked and missing, or the
    local copy of a model reference (``models:/NAME@ALIAS``, ``models:/NAME/VERSION``, ``runs:/ID/PATH``: e.g.
    what `trustbatch sft` registered), fetched from the MLflow store at ``tracking_uri`` into the cache."""
    if model_cfg.path.startswith(MODEL_REFERENCES):
        from app.models import resolve_model

        assert tracking_uri is not None, "a model reference needs the MLflow store"
        if is_main:  # downloads into the cache once; the other ranks then find it there
            path = resolve_model(model_cfg.path, tracking_uri=tracking_uri)
        barrier()
        if not is_main:
            path = resolve_model(model_cfg.path, tracking_uri=tracking_uri)
        log.info("model.path %s is %s", model_cfg.path, path)
        return path
    path = Path(model_cfg.path)
    if path.exists() or not model_cfg.bootstrap:
        return path
    if is_main:
        log.info("model.path %s does not exist and model.bootstrap=true: building the tiny model there", path)
        bootstrap(model_cfg, data_cfg, path)
    barrier()
    return path
