"""Checkpoints: Hugging Face weights for serving, plus the full trainer state for resuming.

Two kinds of directory, both written atomically — into a hidden temporary sibling, renamed into place once
complete, with a ``COMPLETE`` marker written last — so a crash (even SIGKILL) never leaves a partial directory
under a final name, and a directory without the marker is never loaded:

- ``save_hf_checkpoint(model, tokenizer, dir)``: ``model.safetensors`` + ``config.json`` + tokenizer files,
  loadable by ``transformers.AutoModelForCausalLM.from_pretrained`` and by SGLang.
- ``save_checkpoint(dir, ...)``: a training checkpoint, ``step-<N>/`` under a run's ``checkpoints/``::

      model/          the HF weights above (what serving, evaluation and the model registry use)
      trainer/        model + optimizer state through torch.distributed.checkpoint (sharded under FSDP2,
                      each rank writes its own shard; reloads under any world size)
      state.json      step, policy version, data cursor, scheduler state, and whatever the caller adds
                      (the MLflow run id, evaluation results)
      rng.pt          RNG states of every rank
      config.yaml     the run's resolved config
      COMPLETE

``load_checkpoint`` restores the model, the optimizer, the schedule and this rank's RNG states, and returns the
``state.json`` dict. ``checkpoint_problem`` tells, without loading any tensor, why a directory marked complete
cannot be resumed from (a damaged ``state.json``, a missing or truncated file of ``trainer/``, ``model/`` or
``rng.pt``). ``list_checkpoints`` lists the complete ones, oldest first; ``prune_checkpoints`` keeps the last K
plus any the caller names (the best). Every function that touches a sharded model is a collective: all ranks
call it, in the same order.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.distributed import barrier, full_state_dict
from trainer.lora import lora_of, merged_state_dict, save_adapter

COMPLETE_MARKER = "COMPLETE"


@dataclass
class CheckpointConfig:
    """When training checkpoints are written and how many are kept (``checkpoint.*``)."""

    every: int = 100
    """Write a checkpoint every N optimizer steps (and always after the last one); 0 = only after the last.
    Align it with eval.every so each checkpoint carries its held-out accuracy (needed for the `best` alias)."""
    keep_last: int = 2
    """Keep the newest K checkpoints on disk (plus the best evaluated one); older ones are deleted. Versions
    registered in MLflow keep their own copy of the weights."""
    on_stop: bool = False
    """On Ctrl-C or SIGTERM, finish the step in progress and checkpoint it before stopping (up to one step).
    Off: stop within seconds; `resume=` continues from the last complete checkpoint."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0 (0 = only after the last step), got {self.every}")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1 (resuming needs one), got {self.keep_last}")
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _tmp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _publish(tmp: Path, path: Path) -> None:
    """Mark ``tmp`` complete and move it to ``path`` (replacing an older directory of that name)."""
    (tmp / COMPLETE_MARKER).write_text("ok\n")
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


def _write_hf(model, tokenizer, state_dict: dict[str, torch.Tensor], out: Path) -> None:
    lora = lora_of(model)
    if lora is not None:  # a plain HF model: the adapters merged into the base weights (trainer/lora.py)
        state_dict = merged_state_dict(state_dict, lora.scaling)
    if getattr(model.config, "tie_word_embeddings", False):
        # Tied output weights are the embedding itself; save_pretrained given a state dict would write both.
        state_dict.pop("lm_head.weight", None)
    with _no_hf_progress_bars():  # transformers 5 draws a "Writing model shards" bar per save, every step
        model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _no_hf_progress_bars():
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def save_hf_checkpoint(model, tokenizer, path: Path, *, is_main: bool = True) -> Path:
    """Gather the full weights (every rank must call this under FSDP) and write them on rank 0."""
    state_dict = full_state_dict(model)
    if not is_main:
        return path
    path = Path(path)
    tmp = _tmp_sibling(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_hf(model, tokenizer, state_dict, tmp)
    _publish(tmp, path)
    return path


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _dcp_state(model, optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def save_checkpoint(
    path: Path,
    *,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    scheduler,
    state: dict[str, Any],
    config_yaml: str = "",
    rank: int = 0,
    world_size: int = 1,
) -> Path:
    """Write a complete training checkpoint at ``path`` (a collective under FSDP; rank 0 publishes it).

    ``state`` must be JSON-serialisable; the scheduler and RNG states are added here. ``config_yaml`` (the
    run's resolved config) is kept beside them as ``config.yaml``.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp = _tmp_sibling(path)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    weights = full_state_dict(model)  # collective: every rank gathers
    dcp.save(_dcp_state(model, optimizer), checkpoint_id=str(tmp / "trainer"))
    rngs = _gather_rng_states(rank, world_size)
    if rank == 0:
        _write_hf(model, tokenizer, weights, tmp / "model")
        lora = lora_of(model)
        if lora is not None:  # the adapter alone too, as a PEFT directory
            save_adapter(weights, lora, getattr(model.config, "_name_or_path", ""), tmp / "adapter")
        (tmp / "model" / COMPLETE_MARKER).write_text("ok\n")
        torch.save(rngs, tmp / "rng.pt")
        if config_yaml:
            (tmp / "config.yaml").write_text(config_yaml)
        full = {**state, "scheduler": scheduler.state_dict(), "world_size": world_size}
        (tmp / "state.json").write_text(json.dumps(full, indent=2, default=_json_default) + "\n")
        _publish(tmp, path)
    barrier()
    return path


def _gather_rng_states(rank: int, world_size: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    mine = rng_state()
    if world_size == 1 or not dist.is_initialized():
        return [mine]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, mine)
    return out


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"checkpoint state holds a {type(value).__name__}, which JSON cannot store")


def load_checkpoint(path: Path, *, model, optimizer: torch.optim.Optimizer, scheduler, rank: int = 0) -> dict:
    """Restore model, optimizer, schedule and this rank's RNG states from ``path``; returns ``state.json``.

    Raises ValueError for a directory that is not a complete checkpoint. A checkpoint written by another
    world size restores the weights and optimizer (DCP reshards); RNG states then come from rank 0's.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    if not is_complete(path) or not (path / "state.json").is_file():
        raise ValueError(
            f"{path} is not a complete trustbatch checkpoint (no {COMPLETE_MARKER} marker or state.json); "
            "a run killed while writing leaves only a hidden .tmp directory, which is never loaded"
        )
    _init_optimizer_state(optimizer)
    target = _dcp_state(model, optimizer)
    dcp.load(target, checkpoint_id=str(path / "trainer"))
    set_state_dict(
        model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"]
    )
    state = json.loads((path / "state.json").read_text())
    scheduler.load_state_dict(state["scheduler"])
    rngs = torch.load(path / "rng.pt", weights_only=False)
    set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])
    return state


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from, or None when it looks whole.

    Cheap: reads ``state.json`` and the DCP metadata of ``trainer/`` (a small pickle), then checks that every
    file the metadata names exists and is as long as the metadata says; no tensor is read. Damage inside a
    tensor file of the right length is found only by ``load_checkpoint``.
    """
    path = Path(path)
    if not is_complete(path):
        return f"no {COMPLETE_MARKER} marker (it was never finished)"
    try:
        state = json.loads((path / "state.json").read_text())
    except FileNotFoundError:
        return "state.json is missing"
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"state.json is not valid JSON ({exc})"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "scheduler" not in state:
        return "state.json lacks the step number or the scheduler state"
    if not (path / "rng.pt").is_file():
        return "rng.pt is missing"
    model = path / "model"
    if not (model / "config.json").is_file() or not any(model.glob("*.safetensors")):
        return "model/ lacks config.json or its *.safetensors weights"
    trainer = path / "trainer"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(trainer)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a missing file, a truncated pickle: all mean unusable
        return f"trainer/.metadata cannot be read ({type(exc).__name__}: {exc})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = trainer / name
        if not file.is_file():
            return f"trainer/{name} is missing"
        if file.stat().st_size < size:
            return f"trainer/{name} is truncated ({file.stat().st_size} of {size} bytes)"
    return None


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (zeros) so DCP has something of the right shape to load into."""
    if optimizer.state:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()  # AdamW with lr 0 creates exp_avg/exp_avg_sq/step; the values are overwritten by the load
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete ``step-N`` checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def prune_checkpoints(root: Path, *, keep_last: int, keep: tuple[Path, ...] = ()) -> list[Path]:
    """Delete complete checkpoints under ``root`` except the newest ``keep_last`` and those in ``keep``;
    also removes leftover ``.tmp`` directories of interrupted writes. Returns what was deleted."""
    root = Path(root)
    found = list_checkpoints(root)
    protected = {p.resolve() for _, p in found[-keep_last:]} if keep_last > 0 else set()
    protected |= {Path(p).resolve() for p in keep}
    removed = []
    for _, child in found:
        if child.resolve() not in protected:
            shutil.rmtree(child)
            removed.append(child)
    for tmp in root.glob(".step-*.tmp") if root.is_dir() else ():
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed

