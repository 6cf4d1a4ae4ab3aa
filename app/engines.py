"""Engines: the one place where a generation engine is chosen, started, checked healthy and closed.

`train`, `eval` and `serve` all get their engine from ``open_engine(kind, model_dir, options)``, a context
manager that yields an `OpenEngine` and, on exit, stops every server it started. The kinds have one set of names
everywhere (``rollout.engine``, ``trustbatch eval --engine``, ``trustbatch serve --engine``):

- ``embedded``: the built-in CPU engine inside this process (`EmbeddedEngine`); nothing to start or stop.
- ``local``: the built-in CPU server as a child process (``trustbatch rollout-server``, a free loopback port),
  driven over SGLang's native HTTP API by the one SGLang client.
- ``sglang``: real SGLang. Servers given by URL (``rollout.sglang.urls``), or an sglang-router in front of them
  (``rollout.sglang.router``), are connected to; otherwise ``rollout.sglang.launch`` servers are started here as child processes
  (``python -m sglang.launch_server`` from ``launch.python``, SGLang's own environment). With no URLs and no
  launch settings (eval and serve), one server is launched: on CPU when CUDA is absent.
- ``auto`` (eval, serve): ``sglang`` when CUDA is available and SGLang can be run (installed here, or an
  interpreter given), else ``embedded``. ``builtin`` is the older name of ``embedded`` and still accepted.

Health: a server started here is ready (GET /health answers 200) before ``open_engine`` yields, unless
``options.wait`` is False. Training sets that so its CPU server loads while the trainer builds its model, and
`app.rollout.fleet.Fleet.connect` waits for it (through the client) before the first request. Servers given by
URL are the client's to wait for (``SGLangClient.wait_healthy``).

The HTTP kinds yield an `SGLangClient` over the servers' URLs. It is created outside any event loop and binds
to the loop that first uses it; the user closes it (``await client.close()``, or `Fleet.close`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from app.rollout.base import RolloutEngine
from app.rollout.process import LocalServerProcess, ServerProcess
from app.rollout.sglang import SGLangClient, SGLangClientConfig
from app.rollout.sglang_server import LoraServing, SGLangLaunchConfig, launch_servers

log = logging.getLogger("trustbatch")

EngineKind = Literal["embedded", "local", "sglang"]
ENGINE_KINDS: tuple[str, ...] = ("embedded", "local", "sglang")
CHOICES: tuple[str, ...] = (*ENGINE_KINDS, "auto")
"""What a command line takes: the kinds, and ``auto``."""
ALIASES = {"builtin": "embedded"}
"""Older names still accepted (``trustbatch serve --engine builtin``)."""

LOCAL_HEALTH_TIMEOUT_S = 180.0
"""The built-in CPU server loads in seconds: a client waits at most this long for it, whatever
``rollout.sglang.health_timeout_s`` says for SGLang's minutes of loading."""


ENGINE_DTYPES = ("float32", "bfloat16")
"""Compute dtypes of the built-in engines (rollout.dtype, `trustbatch rollout-server --dtype`)."""


@dataclass
class EngineOptions:
    """How an engine is started; every field has a default, so a command sets only what it takes."""

    max_batch_size: int = 256
    """Sequences the built-in engine (embedded or local) decodes together."""
    dtype: str = "float32"
    """Compute dtype of the built-in engine (embedded or local): one of `ENGINE_DTYPES` (rollout.dtype)."""
    sglang: SGLangClientConfig = field(default_factory=SGLangClientConfig)
    """The ``rollout.sglang`` section: client settings, and the ``urls`` of running servers or the ``launch``
    settings of servers to start."""
    log_dir: Path | None = None
    """Where started servers write their logs; None: a new temporary folder (kept, its path logged)."""
    weight_version: int = 0
    """Policy version of the weights in the model directory (the servers' ``weight_version`` label)."""
    rank: int = 0
    """The trainer rank starting the engine: server logs are named by it, launched SGLang servers of rank r
    are numbered from ``r * launch.num_servers`` (their log names and seeds)."""
    local_rank: int | None = None
    """Its rank on its own machine (torchrun's LOCAL_RANK): launched SGLang servers take their ports and GPUs
    from ``local_rank * launch.num_servers`` on; None: ``rank`` (one machine)."""
    wait: bool = True
    """Block until every server started here answers GET /health (False: the caller waits; see above)."""
    lora: LoraServing | None = None
    """LoRA flags for SGLang servers started here (``rollout.sglang.lora_adapters``); None: full weights."""


@dataclass
class OpenEngine:
    """What `open_engine` yields."""

    kind: EngineKind
    engine: RolloutEngine
    """An `EmbeddedEngine`, or an `SGLangClient` over the servers' URLs."""
    servers: list[ServerProcess]
    """Processes started here; stopped when the context exits (a supervisor may restart them meanwhile)."""
    client: SGLangClientConfig | None = None
    """The client settings with the servers' URLs (HTTP kinds)."""


def resolve_kind(requested: str, *, sglang_python: str | None = None) -> EngineKind:
    """The engine kind a name asks for: a kind, an alias, or ``auto`` (see the module docstring).

    ``sglang_python``: the interpreter of an environment that has SGLang; it must exist, and it is trusted to
    have SGLang (it pins its own torch), so ``auto`` chooses SGLang with it when CUDA is available.
    """
    kind = ALIASES.get(requested, requested)
    if kind not in CHOICES:
        raise ValueError(f"engine {requested!r}: choose one of {', '.join(CHOICES)}")
    if sglang_python is not None and "/" in sglang_python and not Path(sglang_python).is_file():
        raise ValueError(
            f"--sglang-python {sglang_python!r} does not exist; give the interpreter of an environment with "
            "SGLang installed (e.g. .venv-sglang/bin/python)"
        )
    if kind != "auto":
        return kind  # type: ignore[return-value]
    has_sglang = sglang_python is not None or importlib.util.find_spec("sglang") is not None
    import torch

    if torch.cuda.is_available():
        if has_sglang:
            return "sglang"
        log.warning(
            "CUDA is available but SGLang is not installed: using the built-in CPU engine; install "
            "trustbatch[gpu] (or pass --sglang-python) to use SGLang"
        )
    return "embedded"


def launch_settings(launch: SGLangLaunchConfig) -> SGLangLaunchConfig:
    """The launch settings actually used: ``python`` is this interpreter, and with no servers asked for, one
    server, on CPU in float32 when CUDA is absent."""
    if launch.python == "python":
        launch = replace(launch, python=sys.executable)
    if launch.num_servers:
        return launch
    import torch

    cpu = not torch.cuda.is_available()
    return replace(launch, num_servers=1, cpu=cpu, dtype="float32" if cpu else launch.dtype)


@contextlib.contextmanager
def open_engine(kind: str, model_dir: str | Path, options: EngineOptions | None = None) -> Iterator[OpenEngine]:
    """Start the ``kind`` engine on the Hugging Face directory ``model_dir``; stop what was started on exit.

    Raises ValueError for a kind that cannot run here, and the servers' `ServerStartError` (with their log
    tail) for one that does not start.
    """
    options = options or EngineOptions()
    model_dir = Path(model_dir)
    python = options.sglang.launch.python
    resolved = resolve_kind(kind, sglang_python=None if python == "python" else python)
    if options.dtype not in ENGINE_DTYPES:
        raise ValueError(f"engine dtype {options.dtype!r}: choose one of {', '.join(ENGINE_DTYPES)}")
    if resolved == "embedded":
        import torch

        from app.rollout.embedded import EmbeddedEngine

        engine = EmbeddedEngine.from_pretrained(
            model_dir, max_batch_size=options.max_batch_size, policy_version=options.weight_version,
            dtype=getattr(torch, options.dtype),
        )  # fmt: skip
        yield OpenEngine("embedded", engine, [])
        return
    running = bool(options.sglang.urls or options.sglang.router)
    if resolved == "sglang" and not running and not _can_run_sglang(options.sglang.launch):
        raise ValueError(
            "engine sglang: SGLang is not installed in this environment; install the GPU extra (pip install "
            "'trustbatch[gpu]', as the Docker image does), give the interpreter of an environment that has it "
            "(--sglang-python, or rollout.sglang.launch.python), give URLs of running servers "
            "(rollout.sglang.urls), or use another engine"
        )
    servers: list[ServerProcess] = []
    try:
        client_cfg = _start(resolved, model_dir, options, servers)
        yield OpenEngine(
            resolved, SGLangClient(client_cfg, policy_version=options.weight_version), servers, client_cfg
        )
    finally:
        for server in servers:
            server.stop()


def _can_run_sglang(launch: SGLangLaunchConfig) -> bool:
    return launch.python not in ("python", sys.executable) or importlib.util.find_spec("sglang") is not None


def _start(kind: EngineKind, model_dir: Path, options: EngineOptions, servers: list[ServerProcess]):
    """Start the servers of an HTTP kind into ``servers``; returns the client settings with their URLs."""
    client_cfg = options.sglang
    if kind == "sglang" and (client_cfg.urls or client_cfg.router):
        return client_cfg  # running servers
    log_dir = options.log_dir or Path(tempfile.mkdtemp(prefix="trustbatch-engine-"))
    if kind == "local":
        server = LocalServerProcess(
            model_dir,
            max_batch_size=options.max_batch_size,
            dtype=options.dtype,
            log_path=log_dir / f"rollout-server-rank{options.rank}.log",
            weight_version=options.weight_version,
        )
        servers.append(server)
        server.start()
        log.info("rank %d: started the CPU rollout server at %s (log %s)", options.rank, server.url, server.log_path)
        if options.wait:
            server.wait_ready()
        return replace(
            client_cfg, urls=[server.url], health_timeout_s=min(client_cfg.health_timeout_s, LOCAL_HEALTH_TIMEOUT_S),
            weight_sync=replace(client_cfg.weight_sync, backend="gloo"),  # the built-in server's only backend
        )  # fmt: skip
    launch = launch_settings(client_cfg.launch)
    log.info("rank %d: launching %d SGLang server(s) with %s (logs in %s)", options.rank, launch.num_servers,
             launch.python, log_dir)  # fmt: skip
    # Every trainer rank starts its own servers; launch_servers blocks until all are healthy. It must run in a
    # thread that outlives the servers (they die with the thread that started them): the caller's.
    servers += launch_servers(
        launch, model_dir, log_dir, weight_version=options.weight_version,
        first_index=options.rank * launch.num_servers,
        first_node_index=(options.rank if options.local_rank is None else options.local_rank) * launch.num_servers,
        lora=options.lora,
    )  # fmt: skip
    log.info("rank %d: SGLang at %s", options.rank, ", ".join(s.url for s in servers))
    return replace(client_cfg, urls=[s.url for s in servers], launch=launch)
