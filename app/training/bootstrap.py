"""Build the tiny offline model and warm-start it, so RL starts from a non-zero accuracy without downloads.

`bootstrap` builds a byte-level tokenizer and a tiny Qwen2 in code (trainer/model.py), fine-tunes it with
supervised next-token loss on `data.train` (prompt → answer + EOS, loss on the answer only) and saves a
normal Hugging Face directory that transformers, the rollout engines and SGLang load like any other model.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from app.config import ModelConfig
from app.data import DataConfig, load_split
from trainer.model import build_tiny_model, build_tiny_tokenizer, encode_prompt, save_model
from trainer.sft import sft_step

log = logging.getLogger("trustbatch")


def bootstrap(model_cfg: ModelConfig, data_cfg: DataConfig, out: Path, *, show_progress: bool = True) -> Path:
    """Build, warm-start and save the tiny model at `out`; returns `out`."""
    torch.manual_seed(model_cfg.tiny.seed)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(model_cfg.tiny, tokenizer)
    rows = [r for r in load_split(data_cfg, "train") if r.answer is not None]
    if not rows:
        raise ValueError(f"data.train={data_cfg.train!r} has no rows with an answer to fine-tune on")
    examples = []
    for r in rows:
        prompt = encode_prompt(tokenizer, r.prompt, r.messages)
        answer = tokenizer(r.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((prompt, answer))

    sft = model_cfg.sft
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, sft.steps) / max(sft.steps, 1)))
    )
    rng = random.Random(model_cfg.tiny.seed)
    model.train()
    bar = tqdm(range(sft.steps), desc="bootstrap SFT", disable=not show_progress, dynamic_ncols=True)
    loss = float("nan")
    for _ in bar:
        chosen = [examples[rng.randrange(len(examples))] for _ in range(sft.batch_size)]
        length = max(len(p) + len(a) for p, a in chosen)
        input_ids = torch.full((len(chosen), length), tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        loss_mask = torch.zeros_like(input_ids, dtype=torch.bool)
        for i, (p, a) in enumerate(chosen):
            input_ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            attention_mask[i, : len(p) + len(a)] = 1
            loss_mask[i, len(p) : len(p) + len(a)] = True
        loss = sft_step(model, optimizer, input_ids, attention_mask, loss_mask, scheduler=scheduler)
        bar.set_postfix(loss=f"{loss:.3f}")
    bar.close()
    model.eval()
    save_model(model, tokenizer, out)
    log.info(
        "bootstrapped tiny model (%d parameters, SFT loss %.3f) at %s",
        sum(p.numel() for p in model.parameters()),
        loss,
        out,
    )
    return out


def ensure_model(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    *,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """The model directory to train: `model.path` itself, bootstrapped first when asked and missing."""
    path = Path(model_cfg.path)
    if path.exists() or not model_cfg.bootstrap:
        return path
    if is_main:
        log.info("model.path %s does not exist and model.bootstrap=true: building the tiny model there", path)
        bootstrap(model_cfg, data_cfg, path)
    barrier()
    return path
