"""Starting a server: a model directory -> engine + tokenizer -> app -> uvicorn, and ``serve``.

Two commands start it (app/cli.py): ``trustbatch rollout-server --model DIR`` serves SGLang's native API
(app/serving/native.py) for a training run's rollouts (app/engines.py starts it as a child process for the
``local`` engine; the rollout side speaks to it only over HTTP); ``trustbatch serve REF`` serves a model
reference behind the OpenAI API (app/serving/openai.py, the native routes included).

``serve`` resolves the reference (``models:/NAME@ALIAS``, ``models:/NAME/VERSION``, ``runs:/RUN_ID/PATH`` or a
directory; app/models.py) to a local Hugging Face directory, then opens an engine through app/engines.py
(`open_engine`, the one place engines are chosen and started):
- **sglang** (``--engine sglang``, or ``auto`` when CUDA is available and SGLang can be run, as in the Docker
  image): SGLang's own OpenAI-compatible server, ``python -m sglang.launch_server`` with ``--served-model-name``,
  as a child process of this one (on CPU with SGLang's CPU platform when CUDA is absent). ``serve`` announces it
  once it answers /health, writes its output to a log file, and stops it on Ctrl-C or SIGTERM; if it exits,
  ``serve`` exits with its log tail. ``--sglang-python`` picks the interpreter of another environment (SGLang
  pins its own torch); ``--sglang-args`` are passed through (``--tp N`` sets the tensor-parallel size).
- **embedded** (``builtin`` is its older name): the OpenAI app on the built-in CPU engine, in this process.

The model's name is the reference without its scheme (``models:/quickstart@best`` is served as
``quickstart@best``: SGLang refuses a colon in a served model name) unless ``--served-model-name`` says
otherwise; the built-in engine also accepts the reference as typed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI

from app.engines import EngineOptions, open_engine, resolve_kind
from app.rollout.process import ServerProcess
from app.rollout.sglang import SGLangClientConfig
from app.rollout.sglang_server import SGLangLaunchConfig
from app.serving.native import create_app
from app.serving.openai import create_openai_app
from app.serving.requests import DEFAULT_MAX_BODY_BYTES
from app.stopping import Stopped, Stopping

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8000


class ServedEngineExited(RuntimeError):
    """The SGLang server that `serve` started exited on its own (its log tail is in the message)."""


def load(model_dir: Path, *, max_batch_size: int, tokenizer_required: bool = True, dtype: str = "float32"):
    """(EmbeddedEngine, tokenizer) of an HF model directory, computing in ``dtype`` (float32 or bfloat16);
    without ``tokenizer_required`` a directory with no loadable tokenizer gives None (text input is then
    refused and output text is empty)."""
    from transformers import AutoTokenizer

    options = EngineOptions(max_batch_size=max_batch_size, dtype=dtype)
    with open_engine("embedded", model_dir, options) as opened:
        engine = opened.engine  # in process: nothing to stop
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        if tokenizer_required:
            raise
        logger.warning("%s: no loadable tokenizer; text input is refused and output text is empty", model_dir)
        tokenizer = None
    return engine, tokenizer


GRACE_S = 5.0
"""On Ctrl-C or SIGTERM the server stops taking requests and gives those in flight this long to finish."""


def _run(app: FastAPI, host: str, port: int, command: str = "serve") -> None:
    """uvicorn until a signal: the first says at once that the server is stopping and gives the requests in flight
    GRACE_S seconds; a second stops it at once (uvicorn's force exit)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            first = not self.should_exit
            text = (f"stopping; finishing the requests in flight (at most {GRACE_S:g} s). Press Ctrl-C again to stop "
                    "at once." if first else "again: stopping now")  # fmt: skip
            with contextlib.suppress(OSError):
                os.write(2, f"\ntrustbatch {command}: {signal.Signals(sig).name}: {text}\n".encode())
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACE_S)
    with contextlib.suppress(KeyboardInterrupt):
        Server(config).run()


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
    dtype: str = "float32",
) -> None:
    """``trustbatch rollout-server``: serve ``model_dir`` behind SGLang's native API until interrupted."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"--model {str(model_dir)!r} is not a directory; give an HF model directory")
    engine, tokenizer = load(model_dir, max_batch_size=max_batch_size, tokenizer_required=False, dtype=dtype)
    app = create_app(
        engine,
        model_path=str(model_dir),
        weight_version=weight_version,
        max_batch_size=max_batch_size,
        batch_window_ms=batch_window_ms,
        tokenizer=tokenizer,
        max_body_bytes=max_body_bytes,
    )
    _run(app, host, port, command="rollout-server")


def served_name(ref: str) -> str:
    """The default model name clients send: the reference without its scheme (``models:/q@best`` -> ``q@best``).

    SGLang refuses a served model name with a colon (reserved for ``model:adapter``), so the scheme goes.
    """
    for scheme in ("models:/", "runs:/"):
        if ref.startswith(scheme):
            return ref[len(scheme) :]
    return ref


def sglang_launch(
    *, host: str, port: int, served_model_name: str, extra_args: str = "", python: str | None = None
) -> SGLangLaunchConfig:
    """How `serve` launches SGLang's OpenAI server: one server on ``host:port`` with its own tokenizer (clients
    send text), ``--sglang-args`` passed through, of which ``--tp N`` / ``--tp-size N`` sets the
    tensor-parallel size (the launcher sets that flag itself)."""
    args, tp = shlex.split(extra_args), "1"
    for flag in ("--tp", "--tp-size"):
        for i, arg in enumerate(args):
            if arg == flag and i + 1 < len(args):
                tp = args[i + 1]
                del args[i : i + 2]
                break
            if arg.startswith(flag + "="):
                tp = arg.split("=", 1)[1]
                del args[i]
                break
    if not tp.isdigit() or int(tp) < 1:
        raise ValueError(f"--sglang-args: the tensor-parallel size (--tp) must be a whole number >= 1, got {tp!r}")
    tp_size = int(tp)
    return SGLangLaunchConfig(
        python=python or "python", host=host, base_port=port, tp_size=tp_size, skip_tokenizer_init=False,
        served_model_name=served_model_name, extra_args=args,
    )  # fmt: skip


@contextlib.contextmanager
def _stopped_by_signals():
    """Ctrl-C or SIGTERM, at any point inside, says so and ends the block quietly (what was started is stopped on
    the way out: the SGLang server's process group); a second signal kills it and exits at once."""
    servers: list[ServerProcess] = []

    def first(signum: int) -> None:
        raise Stopped(signum)

    def kill() -> None:
        for server in servers:
            server.kill()

    stopping = Stopping("serve", waiting="stopping the SGLang server (its whole process group)", on_first=first,
                        kill=kill)  # fmt: skip
    try:
        with stopping.installed():
            yield servers
    except Stopped:
        pass


def _run_until_stopped(server: ServerProcess) -> None:
    """Wait while ``server`` runs (a signal ends the wait, see `_stopped_by_signals`); an exit of its own is an
    error."""
    while (code := server.exited()) is None:
        time.sleep(0.5)
    raise ServedEngineExited(
        f"the SGLang server exited with code {code}; log {server.log_path}:\n{server.log_tail()}"
    )


def serve(
    ref: str,
    *,
    tracking_uri: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    engine: str = "auto",
    served_model_name: str | None = None,
    max_batch_size: int = 256,
    batch_window_ms: float = 5.0,
    sglang_args: str = "",
    sglang_python: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    announce: Callable[[str], None] = print,
) -> None:
    """``trustbatch serve``: resolve ``ref`` and serve it until interrupted.

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
    kind = resolve_kind(engine, sglang_python=sglang_python)
    if kind == "local":
        raise ValueError(
            "--engine local is the built-in engine as a rollout server for training and eval; serve runs the "
            "built-in engine in its own process: use --engine embedded (or auto)"
        )
    name = served_model_name or served_name(ref)
    if kind == "sglang" and ":" in name:
        raise ValueError(
            f"the served model name {name!r} has a colon, which SGLang refuses (it means model:adapter); "
            "pass --served-model-name NAME"
        )
    launch = None
    if kind == "sglang":  # checked before the model is fetched: a bad --sglang-args fails at once
        launch = sglang_launch(
            host=host, port=port, served_model_name=name, extra_args=sglang_args, python=sglang_python
        )
    source = lookup(ref, tracking_uri=tracking_uri)
    model_dir = fetch(source, tracking_uri=tracking_uri)
    announce(f"model: {source.label} -> {model_dir}")
    if launch is not None:
        log_dir = Path(tempfile.mkdtemp(prefix="trustbatch-serve-"))
        announce(f"engine: SGLang, starting (log in {log_dir})")
        options = EngineOptions(sglang=SGLangClientConfig(launch=launch), log_dir=log_dir)
        with _stopped_by_signals() as started, open_engine("sglang", model_dir, options) as opened:
            server = opened.servers[0]
            started.append(server)
            announce(f"engine: SGLang ({shlex.join(server.command())})")
            announce(f"OpenAI API at http://{host}:{port}/v1 as model {name!r}")
            _run_until_stopped(server)
        return
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
