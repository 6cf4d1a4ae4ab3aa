"""The ``rollout.sglang`` config section: how trustbatch reaches SGLang servers (`SGLangClientConfig`) and how
new policy weights reach them (`WeightSyncConfig`). app/rollout/sglang.py re-exports both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from app.rollout.sglang_server import SGLangLaunchConfig


@dataclass
class WeightSyncConfig:
    """How new policy weights reach the SGLang servers (config section ``rollout.sglang.weight_sync``)."""

    method: Literal["disk", "distributed"] = "disk"
    """disk: save a checkpoint and POST /update_weights_from_disk (servers must see the file system).
    distributed: broadcast the tensors over a process group (app/rollout/weight_sync.py)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend of the distributed method: nccl (GPU trainer and servers), gloo (CPU), auto =
    nccl when the trainer process has CUDA, else gloo."""
    master_address: str = "127.0.0.1"
    """Address of the trainer as the servers see it (they connect to the group's store there)."""
    master_port: int = 0
    """Port of the group's store on the trainer; 0 = a free port."""
    bucket_mb: float = 1024.0
    """Largest bucket in MiB: one request and one broadcast each. Above the model's size (in the sent dtype)
    a push is atomic with respect to generation (see the module docstring)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Cast floating-point weights to this dtype before sending (e.g. bfloat16 for bf16 servers: half the
    bytes); None sends them as they are. The servers convert to their own dtype either way. The cast is the
    fleet's gather (`app.rollout.joint.gather_weights`); `DistributedWeightSync.push` sends what it is given."""
    timeout_s: float = 600.0
    """Time limit of forming the group and of each broadcast (also covers waiting for in-flight requests)."""

    def __post_init__(self) -> None:
        key = "rollout.sglang.weight_sync"
        if not self.master_address:
            raise ValueError(
                f"{key}.master_address is empty: give the trainer's address as the servers see it"
            )
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"{key}.master_port={self.master_port} must be 0 (a free port) or in 1..65535")
        if not self.bucket_mb > 0:
            raise ValueError(f"{key}.bucket_mb must be > 0 MiB, got {self.bucket_mb}")
        if not self.timeout_s > 0:
            raise ValueError(f"{key}.timeout_s must be > 0 seconds, got {self.timeout_s}")

    def resolved_backend(self) -> Literal["nccl", "gloo"]:
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        return self.backend


@dataclass
class SGLangClientConfig:
    """How trustbatch reaches SGLang servers (config section ``rollout.sglang``)."""

    urls: list[str] = field(default_factory=list)
    """Base URLs of running SGLang servers, e.g. ``http://127.0.0.1:30000``. Several URLs: requests go
    round-robin over them."""
    router: str = ""
    """Base URL of an sglang-router in front of running SGLang servers (instead of ``urls``): generation goes
    through it, weight updates and checks go to each worker it lists (``GET /workers``), which must be
    reachable from the trainer at the address the router lists. Empty: no router."""
    timeout_s: float = 600.0
    """Time limit of one HTTP request, start to end (a /generate of batch_size prompts, a weight update,
    which SGLang holds until the in-flight requests finish). A server that hangs is detected after this."""
    connect_timeout_s: float = 10.0
    """Time limit of opening a TCP connection to a server."""
    max_concurrency: int = 4
    """Requests in flight per server; SGLang batches concurrent requests together."""
    max_retries: int = 3
    """Retries of a request after a connection error, a timeout or a 5xx (0 = try once). A /generate
    request moves to the next server on each retry."""
    backoff_s: float = 1.0
    """Back-off before retry k: backoff_s * 2**(k-1), times a random factor in [0.5, 1.5), at most 30 s."""
    health_timeout_s: float = 600.0
    """How long `connect` waits for every server to answer GET /health with 200 (model loading and warm-up
    of a large model take minutes)."""
    batch_size: int = 32
    """Prompts per /generate request; each request carries batch_size * n sequences."""
    launch: SGLangLaunchConfig = field(default_factory=SGLangLaunchConfig)
    """Start SGLang servers from the run (rollout.engine=sglang with launch.num_servers > 0) instead of
    connecting to `urls`; the run restarts them if they die or hang."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How each new policy version reaches the servers: from disk, or broadcast over NCCL/gloo."""
    lora_adapters: bool = False
    """A LoRA run (trainer.lora.rank > 0) publishes each version as its PEFT adapter, which the servers load with
    POST /load_lora_adapter and every request names (app/rollout/sglang.py): megabytes a version instead of the
    whole model, with ``max_lag + 1`` versions resident. SGLang on GPUs only: its ``--enable-lora`` does not run on
    the CPU backend (sglang #31894). Servers the run starts get the LoRA flags; servers given by URL must have been
    started with ``--enable-lora --max-lora-rank <r> --lora-target-modules all``. False: every version is the
    merged full weights, for every engine."""

    def __post_init__(self) -> None:
        if self.router and not self.router.startswith(("http://", "https://")):
            raise ValueError(
                f"rollout.sglang.router must be an http:// or https:// URL, got {self.router!r} "
                "(e.g. http://127.0.0.1:30000)"
            )
        if self.router and self.urls:
            raise ValueError(
                "rollout.sglang.router and rollout.sglang.urls are both set: give the router (it lists its "
                "workers) or the servers' URLs, not both"
            )
        for i, url in enumerate(self.urls):
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"rollout.sglang.urls[{i}] must be an http:// or https:// URL, got {url!r} "
                    "(e.g. http://127.0.0.1:30000)"
                )
        for name in ("timeout_s", "connect_timeout_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.sglang.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_concurrency < 1:
            raise ValueError(f"rollout.sglang.max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_retries < 0:
            raise ValueError(
                f"rollout.sglang.max_retries must be >= 0 (0 = no retry), got {self.max_retries}"
            )
        if self.backoff_s < 0:
            raise ValueError(f"rollout.sglang.backoff_s must be >= 0, got {self.backoff_s}")
        if self.batch_size < 1:
            raise ValueError(f"rollout.sglang.batch_size must be >= 1, got {self.batch_size}")
