"""Start real SGLang servers (``python -m sglang.launch_server``) as child processes the run owns.

`launch_servers(cfg, model_dir, log_dir)` starts ``cfg.num_servers`` servers of one model, each on its own port
(and its own GPUs), waits until every one answers GET /health, and returns their `SGLangServerProcess` handles;
their URLs go to the SGLang client (app/rollout/sglang.py) like any other SGLang URLs. The interpreter is
``cfg.python``: SGLang pins its own torch and transformers, so it lives in its own environment (on CPU, the one
tests/sglang/cpu_env/build.sh builds; on GPU, any environment with ``pip install sglang``).

Each server is a `ServerProcess` (app/rollout/process.py, shared with the built-in CPU server):
- starts with ``--weight-version <policy version of the weights it loads>``, so that the client maps the label
  to that version (numeric labels map by ``int()``; see SGLangClient's docstring);
- writes stdout and stderr to its own log file (appended across restarts);
- dies with the parent (PR_SET_PDEATHSIG) and gets SIGTERM, then SIGKILL after a grace period, from ``stop()``.
  SGLang's launcher spawns a scheduler and a detokenizer process which exit when it does; the server is started
  in a process group of its own and the whole group is signalled. PR_SET_PDEATHSIG fires when the *thread* that
  started the server ends: call ``start()`` from the main thread (or one that lives as long as the server),
  never from a short-lived worker such as ``asyncio.to_thread``;
- can be restarted on the same port by calling ``start()`` again (e.g. after ``exited()`` reports a crash),
  optionally from newer weights (``start(model_dir=..., weight_version=...)``).

CPU mode (``cpu: true``, tests and benchmarks on CPU-only machines): sets ``SGLANG_USE_CPU_ENGINE=1`` (the
switch that selects SGLang's CPU platform; ``--device cpu`` alone does not) and adds ``--device cpu
--attention-backend torch_native --disable-cuda-graph --max-total-tokens N`` (without a bound the KV cache takes
about 15 GB and 49 s to allocate). GPU ids are then ignored.

Not covered: multi-node servers (``--nnodes``), data parallelism inside one server (``--dp-size``; weight sync
from distributed needs dp_size == 1, so run one server per replica, which is what ``num_servers`` does), and the
router (start ``sglang_router.launch_router`` over the servers yourself; ``rollout.sglang.router``). Which servers start, and when, is chosen
in app/engines.py (`open_engine`); this module only knows how to start them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from app.rollout.process import ServerProcess, ServerStartError, free_port


class SGLangLaunchError(ServerStartError):
    """A server process exited during start-up, or did not become healthy in time (the log tail is attached)."""


@dataclass
class SGLangLaunchConfig:
    """How trustbatch starts its own SGLang servers (config section ``rollout.sglang.launch``)."""

    num_servers: int = 0
    """Servers to start, one model replica each (0 = start none: connect to rollout.sglang.urls instead)."""
    python: str = "python"
    """Interpreter of the environment where SGLang is installed (e.g. .venv-sglang/bin/python); it runs
    `-m sglang.launch_server`."""
    host: str = "127.0.0.1"
    """Address the servers listen on; the client reaches them at http://<host>:<port>."""
    base_port: int = 0
    """Port of server 0; server i listens on base_port + i. 0 = a free port for each."""
    base_gpu_id: int = 0
    """First GPU of a machine's server 0 (--base-gpu-id); its server i starts at base_gpu_id + i * tp_size,
    where i counts the servers of every rank on that machine (LOCAL_RANK * num_servers + j). Ignored when
    gpu_ids is set or cpu is true."""
    gpu_ids: list[int] = field(default_factory=list)
    """Explicit GPUs of each machine: its server i (as above) gets CUDA_VISIBLE_DEVICES =
    gpu_ids[i*tp_size : (i+1)*tp_size]. A multiple of num_servers * tp_size entries: that many for each rank
    on a machine. Empty = use base_gpu_id."""
    tp_size: int = 1
    """Tensor-parallel GPUs per server (--tp-size)."""
    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights + KV cache (--mem-fraction-static); None = SGLang's default. Lower
    it when the trainer shares the GPUs."""
    dtype: str = "auto"
    """Weights and activations dtype (--dtype): auto, float32, bfloat16, float16. SGLang's auto serves a
    float32 checkpoint in half precision."""
    cpu: bool = False
    """Serve on CPU (tests, benchmarks): SGLANG_USE_CPU_ENGINE=1 plus --device cpu --attention-backend
    torch_native --disable-cuda-graph --max-total-tokens (see max_total_tokens)."""
    max_total_tokens: int | None = None
    """KV-cache size in tokens (--max-total-tokens). None = SGLang's default on GPU, 4096 with cpu=true."""
    sleep_on_idle: bool | None = None
    """--sleep-on-idle: the scheduler waits for requests instead of polling for them. An idle SGLang 0.5.23 CPU
    server otherwise holds one core at 100% (measured here), taking it from the trainer and every other
    process on the machine; with the flag, about 1%. None: on with cpu=true, off on GPUs (where the polling
    costs a CPU core, not the GPU, and waking adds latency)."""
    skip_tokenizer_init: bool = True
    """--skip-tokenizer-init: token ids in and out (all trustbatch sends); text requests are then refused.
    `trustbatch serve` turns it off: its clients send text."""
    served_model_name: str = ""
    """--served-model-name: the model name OpenAI clients send; empty: SGLang's default (the model path)."""
    random_seed: int | None = None
    """--random-seed of server i is random_seed + i; None = SGLang picks one."""
    extra_args: list[str] = field(default_factory=list)
    """More `sglang.launch_server` arguments, passed through unchanged (e.g. ["--log-level", "warning"])."""
    startup_timeout_s: float = 600.0
    """How long to wait for every server to answer GET /health with 200 after start (loading + warm-up)."""

    def __post_init__(self) -> None:
        key = "rollout.sglang.launch"
        if self.num_servers < 0:
            raise ValueError(f"{key}.num_servers must be >= 0 (0 = start none), got {self.num_servers}")
        if not self.python:
            raise ValueError(
                f"{key}.python is empty: give the interpreter of the SGLang environment, e.g. "
                ".venv-sglang/bin/python (build it with `make sglang-env`)"
            )
        if not (self.base_port == 0 or 1024 <= self.base_port and self.base_port + self.num_servers <= 65536):
            raise ValueError(
                f"{key}.base_port={self.base_port} must be 0 (free ports) or a port in 1024..65535 with room "
                f"for num_servers={self.num_servers} consecutive ports"
            )
        if self.tp_size < 1:
            raise ValueError(f"{key}.tp_size must be >= 1, got {self.tp_size}")
        if self.base_gpu_id < 0:
            raise ValueError(f"{key}.base_gpu_id must be >= 0, got {self.base_gpu_id}")
        per_rank = self.num_servers * self.tp_size
        if self.gpu_ids and (per_rank == 0 or len(self.gpu_ids) % per_rank):
            raise ValueError(
                f"{key}.gpu_ids={list(self.gpu_ids)} has {len(self.gpu_ids)} entries, not a multiple of "
                f"num_servers x tp_size = {self.num_servers} x {self.tp_size} = {per_rank}: list that many GPUs for "
                f"each trainer rank on a machine, or leave it empty and set {key}.base_gpu_id"
            )
        if any(g < 0 for g in self.gpu_ids) or len(set(self.gpu_ids)) != len(self.gpu_ids):
            raise ValueError(f"{key}.gpu_ids={list(self.gpu_ids)} must be distinct GPU indices >= 0")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"{key}.mem_fraction_static={self.mem_fraction_static} must be in (0, 1), or null for "
                "SGLang's default"
            )
        dtypes = ("auto", "float32", "bfloat16", "float16", "half", "float")
        if self.dtype not in dtypes:
            raise ValueError(f"{key}.dtype={self.dtype!r} is not one of {list(dtypes)}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(
                f"{key}.max_total_tokens={self.max_total_tokens} must be >= 1 (KV-cache tokens), or null"
            )
        if self.random_seed is not None and self.random_seed < 0:
            raise ValueError(f"{key}.random_seed must be >= 0 or null, got {self.random_seed}")
        if not all(isinstance(arg, str) for arg in self.extra_args):
            raise ValueError(f"{key}.extra_args must be a list of strings, got {self.extra_args!r}")
        managed = {"--model-path", "--model", "--port", "--host", "--tp-size", "--tp", "--weight-version",
                   "--base-gpu-id", "--device", "--served-model-name"}  # fmt: skip
        clash = sorted(managed & {arg.split("=", 1)[0] for arg in self.extra_args})
        if clash:
            raise ValueError(
                f"{key}.extra_args sets {clash}, which the launcher sets itself; use the config fields "
                "(host, base_port, tp_size, base_gpu_id / gpu_ids, cpu, served_model_name) instead"
            )
        if self.startup_timeout_s <= 0:
            raise ValueError(f"{key}.startup_timeout_s must be > 0 seconds, got {self.startup_timeout_s}")

    @property
    def kv_tokens(self) -> int | None:
        """The --max-total-tokens actually passed (the CPU default applied)."""
        if self.max_total_tokens is None and self.cpu:
            return 4096
        return self.max_total_tokens


@dataclass(frozen=True)
class LoraServing:
    """The ``--enable-lora`` flags of servers that load per-version adapters (``rollout.sglang.lora_adapters``)."""

    rank: int
    """The largest adapter rank they take (``--max-lora-rank``): trainer.lora.rank."""
    slots: int
    """Adapters resident at once (``--max-loaded-loras``, ``--max-loras-per-batch``): rollout.max_lag + 1 versions,
    and one more for a request that names none (SGLang counts the base model as one)."""
    target_modules: tuple[str, ...] = ("all",)
    """``--lora-target-modules``: ``all`` (every linear layer SGLang can adapt), or trainer.lora.target_modules."""

    def args(self) -> list[str]:
        return ["--enable-lora", "--max-lora-rank", str(self.rank), "--lora-target-modules", *self.target_modules,
                "--max-loras-per-batch", str(self.slots), "--max-loaded-loras", str(self.slots)]  # fmt: skip


class SGLangServerProcess(ServerProcess):
    """One ``python -m sglang.launch_server`` child serving ``model_dir`` (a `ServerProcess`, app/rollout/process.py).

    Args:
        model_dir: Hugging Face model directory (config.json + safetensors) to load at start.
        cfg: the launch settings shared by all servers.
        index: this server's position in the whole run (its name and seed offset).
        log_path: file that receives the server's stdout and stderr (appended).
        weight_version: the policy version of the weights in ``model_dir`` (``--weight-version``).
        port: fixed port; 0 = ``cfg.base_port + node_index``, or a free port when ``cfg.base_port`` is 0.
        node_index: its position on its own machine (its port offset and GPUs); None: ``index`` (one node).
            GPUs and ports are per machine: past one node, server ``index`` of the run is not the
            ``index``-th GPU of the machine it runs on.
        lora: the LoRA flags, for servers that load per-version adapters; None: full weights only.
    """

    start_error = SGLangLaunchError

    def __init__(
        self,
        model_dir: str | Path,
        cfg: SGLangLaunchConfig,
        *,
        index: int = 0,
        node_index: int | None = None,
        log_path: str | Path,
        weight_version: int | str = 0,
        port: int = 0,
        lora: LoraServing | None = None,
    ) -> None:
        self.cfg, self.index, self.lora = cfg, index, lora
        self.node_index = index if node_index is None else node_index
        local = self.node_index
        env: dict[str, str] = {}
        env_defaults = {"TOKENIZERS_PARALLELISM": "false"}
        if cfg.cpu:
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env_defaults["OMP_NUM_THREADS"] = "1"  # one torch thread per process unless told otherwise
        elif cfg.gpu_ids:
            tp = cfg.tp_size
            gpus = cfg.gpu_ids[local * tp : (local + 1) * tp]
            if len(gpus) < tp:
                raise SGLangLaunchError(
                    f"SGLang server {local} of this machine needs entries {local * tp}..{(local + 1) * tp - 1} of "
                    f"rollout.sglang.launch.gpu_ids={list(cfg.gpu_ids)}, which has {len(cfg.gpu_ids)}: list "
                    f"num_servers x tp_size = {cfg.num_servers * tp} GPUs for each trainer rank on a machine "
                    "(torchrun's --nproc_per_node of them)"
                )
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        port = port or (cfg.base_port + local if cfg.base_port else free_port())
        super().__init__(
            self._argv,
            model_dir=model_dir,
            port=port,
            log_path=log_path,
            weight_version=weight_version,
            url_host=_url_host(cfg.host),
            env=env,
            env_defaults=env_defaults,
            own_group=True,
            name=f"SGLang server (index {index}) at",
            startup_timeout_s=cfg.startup_timeout_s,
            startup_timeout_key="rollout.sglang.launch.startup_timeout_s",
            stop_timeout_s=15.0,
        )

    def _argv(self, model_dir: Path, weight_version: str) -> list[str]:
        """The argv of ``sglang.launch_server`` for this server."""
        cfg = self.cfg
        args = [cfg.python, "-m", "sglang.launch_server", "--model-path", str(model_dir),
                "--host", cfg.host, "--port", str(self.port), "--tp-size", str(cfg.tp_size),
                "--weight-version", weight_version, "--dtype", cfg.dtype]  # fmt: skip
        if cfg.cpu:
            args += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
        if cfg.sleep_on_idle or (cfg.sleep_on_idle is None and cfg.cpu):
            args.append("--sleep-on-idle")
        elif not cfg.gpu_ids:
            args += ["--base-gpu-id", str(cfg.base_gpu_id + self.node_index * cfg.tp_size)]
        if cfg.kv_tokens is not None:
            args += ["--max-total-tokens", str(cfg.kv_tokens)]
        if cfg.mem_fraction_static is not None:
            args += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
        if cfg.skip_tokenizer_init:
            args.append("--skip-tokenizer-init")
        if cfg.served_model_name:
            args += ["--served-model-name", cfg.served_model_name]
        if cfg.random_seed is not None:
            args += ["--random-seed", str(cfg.random_seed + self.index)]
        if self.lora is not None:
            args += self.lora.args()
        return args + list(cfg.extra_args)

    def not_found_message(self, command: list[str], err: OSError) -> str:
        return (
            f"rollout.sglang.launch.python={self.cfg.python!r} was not found ({err}); point it at the "
            "interpreter of the SGLang environment, e.g. .venv-sglang/bin/python (`make sglang-env`)"
        )


def launch_servers(
    cfg: SGLangLaunchConfig,
    model_dir: str | Path,
    log_dir: str | Path,
    *,
    weight_version: int | str = 0,
    first_index: int = 0,
    first_node_index: int | None = None,
    lora: LoraServing | None = None,
) -> list[SGLangServerProcess]:
    """Start ``cfg.num_servers`` SGLang servers of ``model_dir`` and wait until all are healthy.

    Logs go to ``log_dir/sglang-<i>.log``; ``first_index`` offsets i (names, seeds), e.g. by
    ``rank * num_servers`` when every trainer rank launches its own servers, and ``first_node_index`` offsets
    their place on this machine (ports, GPUs), e.g. by ``local_rank * num_servers``; None: ``first_index``. The servers start together (loading overlaps); on any failure every
    server started here is stopped and SGLangLaunchError names the failing one, with its log tail.
    """
    if cfg.num_servers < 1:
        raise ValueError(
            "rollout.sglang.launch.num_servers is 0: nothing to launch (set it to the number of SGLang servers "
            "to start, or give rollout.sglang.urls of running ones)"
        )
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory {str(model_dir)!r} has no config.json: SGLang needs a Hugging Face directory "
            "(config.json + *.safetensors), e.g. one written by trainer.model.save_model"
        )
    servers = [
        SGLangServerProcess(
            model_dir, cfg, index=first_index + i, node_index=(first_index if first_node_index is None else
            first_node_index) + i, log_path=Path(log_dir) / f"sglang-{first_index + i}.log",
            weight_version=weight_version, lora=lora,
        )  # fmt: skip
        for i in range(cfg.num_servers)
    ]
    try:
        for server in servers:
            server.start()
        deadline = time.monotonic() + cfg.startup_timeout_s
        for server in servers:
            server.wait_ready(max(deadline - time.monotonic(), 0.01))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
