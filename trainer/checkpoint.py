"""Checkpoints in Hugging Face format (safetensors + config + tokenizer), loadable by transformers and SGLang.

Written atomically: into a temporary sibling directory, then renamed into place, with a completion marker,
so a crash never leaves a partial directory under the final name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from trainer.distributed import full_state_dict

COMPLETE_MARKER = "COMPLETE"


def save_hf_checkpoint(model, tokenizer, path: Path, *, is_main: bool = True) -> Path:
    """Gather the full weights (every rank must call this under FSDP) and write them on rank 0."""
    state_dict = full_state_dict(model)
    if not is_main:
        return path
    if getattr(model.config, "tie_word_embeddings", False):
        # Tied output weights are the embedding itself; save_pretrained given a state dict would write both.
        state_dict.pop("lm_head.weight", None)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / COMPLETE_MARKER).write_text("ok\n")
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()
