"""Starting the built-in server: a model directory -> engine + tokenizer -> app -> uvicorn, and ``serve``.

Two commands start it (app/cli.py): ``trustbatch rollout-server --model DIR`` serves SGLang's native API
(app/serving/native.py) for a training run's rollouts (app/rollout/process.py starts it as a child process, the
rollout side speaks to it only over HTTP); ``trustbatch serve REF`` serves a model reference behind the OpenAI
API (app/serving/openai.py, the native routes included).

``serve`` resolves the reference (``models:/NAME@ALIAS``, ``models:/NAME/VERSION``, ``runs:/RUN_ID/PATH`` or a
directory; app/models.py) to a local Hugging Face directory, then starts one of two engines:
- **SGLang** (``--engine sglang``, or ``auto`` when CUDA is available and SGLang is installed, as in the Docker
  image): this process is replaced by ``python -m sglang.launch_server --model-path DIR --host H --port P
  --served-model-name NAME [--sglang-args ...]``, SGLang's own OpenAI-compatible server. ``--sglang-python``
  picks the interpreter of another environment (SGLang pins its own torch). Tested on CPU against SGLang's CPU
  platform (``.venv-sglang``), not on a GPU.
- **built-in** (otherwise): the OpenAI app on the CPU engine.

The model's name is the reference without its scheme (``models:/quickstart@best`` is served as
``quickstart@best``: SGLang refuses a colon in a served model name) unless ``--served-model-name`` says
otherwise; the built-in engine also accepts the reference as typed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from fastapi import FastAPI

from app.rollout.embedded import EmbeddedEngine
from app.serving.native import create_app
from app.serving.openai import create_openai_app
from app.serving.requests import DEFAULT_MAX_BODY_BYTES

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8000
EngineChoice = Literal["auto", "builtin", "sglang"]


def load(model_dir: Path, *, max_batch_size: int, tokenizer_required: bool = True):
    """(EmbeddedEngine, tokenizer) of an HF model directory; without ``tokenizer_required`` a directory with
    no loadable tokenizer gives None (text input is then refused and output text is empty)."""
    from transformers import AutoTokenizer

    engine = EmbeddedEngine.from_pretrained(model_dir, max_batch_size=max_batch_size)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        if tokenizer_required:
            raise
        logger.warning("%s: no loadable tokenizer; text input is refused and output text is empty", model_dir)
        tokenizer = None
    return engine, tokenizer


def _run(app: FastAPI, host: str, port: int) -> None:
    import uvicorn

    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(app, host=host, port=port, log_level="warning")


def build_app(
    model_dir: Path,
    *,
    model_name: str,
    max_batch_size: int = 256,
    batch_window_ms: float = 5.0,
    aliases: tuple[str, ...] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """Load ``model_dir`` (HF format) into the built-in engine and return the OpenAI-compatible app."""
    engine, tokenizer = load(model_dir, max_batch_size=max_batch_size)
    return create_openai_app(
        engine,
        tokenizer,
        model_name=model_name,
        model_path=str(model_dir),
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        aliases=aliases,
        max_body_bytes=max_body_bytes,
    )


def rollout_server(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    max_batch_size: int = 256,
    batch_window_ms: float = 5.0,
    weight_version: str = "0",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> None:
    """``trustbatch rollout-server``: serve ``model_dir`` behind SGLang's native API until interrupted."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"--model {str(model_dir)!r} is not a directory; give an HF model directory")
    engine, tokenizer = load(model_dir, max_batch_size=max_batch_size, tokenizer_required=False)
    app = create_app(
        engine,
        model_path=str(model_dir),
        weight_version=weight_version,
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        tokenizer=tokenizer,
        max_body_bytes=max_body_bytes,
    )
    _run(app, host, port)


def served_name(ref: str) -> str:
    """The default model name clients send: the reference without its scheme (``models:/q@best`` -> ``q@best``).

    SGLang refuses a served model name with a colon (reserved for ``model:adapter``), so the scheme goes.
    """
    for scheme in ("models:/", "runs:/"):
        if ref.startswith(scheme):
            return ref[len(scheme) :]
    return ref


def choose_engine(
    requested: EngineChoice, *, sglang_python: str | None = None
) -> Literal["builtin", "sglang"]:
    """``auto``: SGLang when CUDA is available and SGLang is installed, else the built-in CPU engine.

    ``sglang_python``: the interpreter of another environment that has SGLang (it pins its own torch); it is
    trusted to have it, and makes ``auto`` choose SGLang when CUDA is available.
    """
    if requested not in ("auto", "builtin", "sglang"):
        raise ValueError(f"--engine {requested!r}: choose auto, builtin or sglang")
    if requested == "builtin":
        return "builtin"
    if sglang_python is not None and not Path(sglang_python).is_file():
        raise ValueError(
            f"--sglang-python {sglang_python!r} does not exist; give the interpreter of an environment with "
            "SGLang installed (e.g. .venv-sglang/bin/python)"
        )
    has_sglang = sglang_python is not None or importlib.util.find_spec("sglang") is not None
    if requested == "sglang":
        if not has_sglang:
            raise ValueError(
                "--engine sglang: SGLang is not installed in this environment; install the GPU extra "
                "(pip install 'trustbatch[gpu]', as the Docker image does), point --sglang-python at an "
                "environment that has it, or use --engine builtin"
            )
        return "sglang"
    import torch

    if torch.cuda.is_available():
        if has_sglang:
            return "sglang"
        logger.warning(
            "CUDA is available but SGLang is not installed: serving with the built-in CPU engine; "
            "install trustbatch[gpu] to serve with SGLang"
        )
    return "builtin"


def sglang_command(
    model_dir: Path,
    *,
    host: str,
    port: int,
    served_model_name: str,
    extra_args: str = "",
    python: str | None = None,
) -> list[str]:
    """The SGLang launch command (SGLang's own OpenAI-compatible server on ``host:port``)."""
    model = ["--model-path", str(model_dir), "--host", host, "--port", str(port)]
    return [python or sys.executable, "-m", "sglang.launch_server", *model, "--served-model-name",
            served_model_name, *shlex.split(extra_args)]  # fmt: skip


def serve(
    ref: str,
    *,
    tracking_uri: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    engine: EngineChoice = "auto",
    served_model_name: str | None = None,
    max_batch_size: int = 256,
    batch_window_ms: float = 5.0,
    sglang_args: str = "",
    sglang_python: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    announce: Callable[[str], None] = print,
) -> None:
    """``trustbatch serve``: resolve ``ref`` and serve it until interrupted (SGLang replaces this process).

    Raises ModelRefError / ValueError for a reference or an option that cannot work, before anything starts.
    """
    from app.models import fetch, lookup

    if not 1 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port; give one in 1-65535")
    if max_batch_size < 1:
        raise ValueError(f"--max-batch-size {max_batch_size} must be >= 1")
    if batch_window_ms < 0:
        raise ValueError(f"--batch-window-ms {batch_window_ms} must be >= 0")
    if max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes {max_body_bytes} must be >= 1")
    kind = choose_engine(engine, sglang_python=sglang_python)
    source = lookup(ref, tracking_uri=tracking_uri)
    model_dir = fetch(source, tracking_uri=tracking_uri)
    name = served_model_name or served_name(ref)
    announce(f"model: {source.label} -> {model_dir}")
    if kind == "sglang":
        if ":" in name:
            raise ValueError(
                f"the served model name {name!r} has a colon, which SGLang refuses (it means model:adapter); "
                "pass --served-model-name NAME"
            )
        command = sglang_command(
            model_dir,
            host=host,
            port=port,
            served_model_name=name,
            extra_args=sglang_args,
            python=sglang_python,
        )
        announce(f"engine: SGLang ({shlex.join(command)})")
        sys.stdout.flush()
        os.execv(command[0], command)  # SGLang's server takes over this process (signals, exit code)
    app = build_app(
        model_dir,
        model_name=name,
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        aliases=(ref,),  # the reference as typed is accepted too
        max_body_bytes=max_body_bytes,
    )
    announce(f"engine: built-in CPU server; OpenAI API at http://{host}:{port}/v1 as model {name!r}")
    _run(app, host, port)
