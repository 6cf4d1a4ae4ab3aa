"""The root config: one dataclass per component, each defined beside its code, composed here.

``load_config(path, overrides)`` is the only way a config is built:
``OmegaConf.merge(structured(Config), load(path), from_dotlist(overrides))`` then ``to_object``, which runs
every ``__post_init__``. Unknown keys, wrong types, bad choices and cross-field violations all surface as one
``ConfigError`` naming the dotted key, the bad value and the fix, before any work starts.
Only ``app/`` sees this root object; components receive their own section.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from app.data import DataConfig
from app.engines import ENGINE_DTYPES
from app.evaluation.config import EvalConfig
from app.rollout.fleet import SupervisionConfig
from app.rollout.probe import PublishCheckConfig
from app.rollout.sglang import SGLangClientConfig
from app.sampling import bounded_int, temperature, top_p
from app.tracking import TrackingConfig, check_name, default_tracking_uri, store_problem, writable_dir_problem
from rewards import RewardsConfig
from rewards.registry import PARAMS, check_params
from sandbox import SandboxConfig
from tools import ToolSpec, check_specs
from trainer.advantages import AdvantageConfig
from trainer.checkpoint import CheckpointConfig
from trainer.model import TinyModelConfig
from trainer.objective import ObjectiveConfig
from trainer.optim import OptimConfig
from trainer.sft import SFTConfig
from trainer.step import TrainerConfig


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key, the value and the fix."""


@dataclass
class RunConfig:
    name: str = "run"
    """Run name: the MLflow run name and the default run directory name."""
    dir: str = ""
    """Run directory (config.yaml, summary.json, plots, checkpoints, the default MLflow store).
    Empty: runs/<run.name>."""
    steps: int = 100
    """Optimizer steps of RL training."""
    seed: int = 0
    """Seed of every random choice: prompt order, sampling, model init."""
    threads: int = 1
    """torch threads per process. Two threads per process on two shared cores stall; keep 1 there."""
    time_limit_s: float = 0.0
    """Stop training after the first step that ends past this many seconds of training wall time (evaluations
    excluded), then evaluate and checkpoint as after the last step; 0 = no limit (run.steps decides)."""

    def __post_init__(self) -> None:
        check_name("run.name", self.name)
        if self.steps < 1:
            raise ValueError(f"run.steps must be >= 1, got {self.steps}")
        if self.threads < 1:
            raise ValueError(f"run.threads must be >= 1, got {self.threads}")
        if self.time_limit_s < 0:
            raise ValueError(f"run.time_limit_s must be >= 0 (0 = no limit), got {self.time_limit_s}")

    @property
    def path(self) -> Path:
        return Path(self.dir or f"runs/{self.name}")


@dataclass
class WarmStartConfig:
    """Warm-start supervised fine-tune of a freshly built tiny model (`trustbatch bootstrap`), run by
    `trustbatch sft`'s loop; `trustbatch sft` itself is configured by the top-level ``sft`` section."""

    steps: int = 600
    """Optimizer steps of supervised fine-tuning."""
    batch_size: int = 64
    """Examples per SFT step."""
    lr: float = 3e-4
    """AdamW learning rate of the warm start (cosine decay to 10%). 3e-4 beat 1e-3 and 5e-3 on held-out
    accuracy of the tiny model after 600 steps (23% against 17% and 9% greedy)."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"model.sft.steps must be >= 0, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"model.sft.batch_size must be >= 1, got {self.batch_size}")
        if self.lr <= 0:
            raise ValueError(f"model.sft.lr must be > 0, got {self.lr}")


@dataclass
class ModelConfig:
    path: str = ""
    """A local Hugging Face causal-LM directory, a model in the MLflow store (models:/NAME@ALIAS,
    models:/NAME/VERSION, runs:/RUN_ID/PATH: e.g. what `trustbatch sft` registered, fetched into the cache), or a
    hub id where a hub is reachable. Required to train."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype for training and rollouts."""
    bootstrap: bool = False
    """If `path` does not exist: build the tiny model + tokenizer (model.tiny), warm-start it with a
    supervised fine-tune on data.train (model.sft) and save it at `path` before training."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Architecture of the tiny offline model that `bootstrap` builds."""
    sft: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Warm-start fine-tune used by `bootstrap`."""

    def __post_init__(self) -> None:
        if self.path.startswith("~"):  # expanded once here, so every reader of model.path sees the same path
            self.path = str(Path(self.path).expanduser())


@dataclass
class RolloutConfig:
    engine: Literal["embedded", "local", "sglang"] = "local"
    """Rollout engine. local: the built-in CPU rollout server (`trustbatch rollout-server`, one per rank,
    started and supervised by the run) behind SGLang's HTTP API. sglang: SGLang servers at
    rollout.sglang.urls. embedded: in-process CPU sampling, synchronous only (max_lag=0). local and sglang
    share one HTTP client."""
    max_lag: int | str = 1
    """Largest policy lag trained on: a step trained with weights of version v uses samples generated by
    version v - max_lag or newer. 0 = synchronous (generate, train, push weights, repeat); >= 1 = generation
    runs up to max_lag steps ahead of training, overlapping it. The ESS objective absorbs the lag. `auto`:
    the run chooses the bound from the measured ESS, between 0 and rollout.max_auto_lag, keeping it where
    the ESS stays above rollout.min_ess (app/training/lag.py); the bound in force is logged every step
    (rollout/max_lag) and recorded in every checkpoint."""
    min_ess: float = 0.9
    """max_lag=auto: the ESS floor. A step whose ESS falls below it lowers the bound by one; 4 steps in a
    row at or above it raise the bound by one."""
    max_auto_lag: int = 8
    """max_lag=auto: the largest bound it may choose."""
    exact_lag: bool = False
    """Benchmarks: every step trains on samples generated exactly max_lag versions earlier (fewer at the
    start), deterministically, instead of at most max_lag."""
    sglang: SGLangClientConfig = field(default_factory=SGLangClientConfig)
    """The HTTP client of the local and sglang engines (URLs, time limits, retries, concurrency)."""
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    """Watchdog and restarts of the rollout servers the run starts (rollout.engine=local)."""
    publish_check: PublishCheckConfig = field(default_factory=PublishCheckConfig)
    """After every published version, each engine scores a fixed probe text and must agree with the trainer
    (app/rollout/probe.py): an engine whose label moved but whose weights did not stops the run."""
    prompts_per_step: int = 32
    """Prompts sampled per optimizer step (split across data-parallel ranks)."""
    group_size: int = 8
    """Completions per prompt; advantages are relative to the group."""
    temperature: float = 1.0
    """Sampling temperature. Trainer logprobs are computed at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; behaviour logprobs ignore the truncation, so keep 1.0 for RL."""
    max_new_tokens: int = 16
    """Longest completion in tokens."""
    max_batch_size: int = 256
    """Sequences the engine decodes together."""
    dtype: str = "float32"
    """Compute dtype of the built-in engines (embedded and local): float32, or bfloat16, which holds the
    served weights in bf16 (each published version is cast on load) and samples from float32 log-softmaxes
    of bf16 logits. Faster where the hardware has bf16 (CPUs with avx512_bf16, GPUs); the trainer then
    learns from an engine that differs from it in precision, which the ESS measures (bench/README.md, bf16).
    A launched SGLang server takes rollout.sglang.launch.dtype instead."""
    skip_decided: int = 0
    """Online prompt filter: a prompt whose latest group was all right or all wrong (no advantage, so
    advantage.drop_zero_variance_groups would throw the group away) is passed over its next this-many draws
    instead of generated again; 0 = off. Pays when the run cycles through data.train more than once; the draws
    passed over are logged (rollout/skipped_prompts) and reported at the end. A resumed run starts a fresh
    record."""
    max_turns: int = 4
    """Tools (the `tools` section): model turns of one answer; a tool call on the last turn ends it (status
    max_turns). docs/tools.md."""
    max_total_tokens: int | None = None
    """Tools: tokens after the prompt of one answer, the model's and the tools' together (each request is clamped
    to what is left); None: max_turns x max_new_tokens. max_new_tokens caps each request."""
    max_tool_output_tokens: int = 128
    """Tools: a tool's output is cut to this many tokens, keeping its head and tail around a marker."""
    tool_format: Literal["fenced", "hermes"] = "fenced"
    """Tools: how calls are written. fenced: ```python blocks, answered by ```output blocks in the same turn
    (any model); hermes: <tool_call>{json}</tool_call> and tool messages of the model's chat template."""
    tool_timeout_s: float = 30.0
    """Tools: a call still running after this many seconds is abandoned and the model told so."""
    tool_concurrency: int = 8
    """Tools: calls running at once (the rest wait); other trajectories keep generating meanwhile."""
    drop_void_turns: bool = False
    """Tools: leave out of training the answers with a void turn (one that ends with neither a tool call nor a
    final answer), SimpleTIR's filter; they still count in their group's advantages. Off: ESS handles them."""

    @property
    def total_tokens(self) -> int:
        """The token budget of one tool-using answer (max_total_tokens, or max_turns x max_new_tokens)."""
        return self.max_total_tokens if self.max_total_tokens is not None else self.max_turns * self.max_new_tokens

    @property
    def auto_lag(self) -> bool:
        """rollout.max_lag=auto: the bound is chosen at run time."""
        return self.max_lag == "auto"

    @property
    def lag_limit(self) -> int:
        """The hard bound on the lag trained on: max_lag, or max_auto_lag under auto."""
        return self.max_auto_lag if self.max_lag == "auto" else int(self.max_lag)

    def __post_init__(self) -> None:
        bounded_int(self.max_turns, "rollout.max_turns", 1)
        if self.max_total_tokens is not None:
            bounded_int(self.max_total_tokens, "rollout.max_total_tokens", 1)
        bounded_int(self.max_tool_output_tokens, "rollout.max_tool_output_tokens", 16)
        bounded_int(self.tool_concurrency, "rollout.tool_concurrency", 1)
        if not (math.isfinite(self.tool_timeout_s) and self.tool_timeout_s > 0):
            raise ValueError(f"rollout.tool_timeout_s={self.tool_timeout_s} must be a number of seconds > 0")
        if not isinstance(self.skip_decided, int) or self.skip_decided < 0:
            raise ValueError(f"rollout.skip_decided={self.skip_decided!r} must be an integer >= 0 (0 = off)")
        if self.prompts_per_step < 1:
            raise ValueError(f"rollout.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.group_size < 2:
            raise ValueError(
                f"rollout.group_size must be >= 2 for group-relative advantages, got {self.group_size}"
            )
        # The engine's own checks (app/sampling.py); RL sampling also refuses greedy (0).
        if self.temperature == 0:
            raise ValueError(
                "rollout.temperature must be > 0 for RL sampling (greedy accuracy is measured by eval.greedy)"
            )
        temperature(self.temperature, "rollout.temperature", greedy=False)
        top_p(self.top_p, "rollout.top_p")
        bounded_int(self.max_new_tokens, "rollout.max_new_tokens", 1)
        if self.max_batch_size < 1:
            raise ValueError(f"rollout.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"rollout.dtype={self.dtype!r} must be one of {list(ENGINE_DTYPES)}")
        if isinstance(self.max_lag, bool) or (isinstance(self.max_lag, str) and self.max_lag != "auto"):
            raise ValueError(
                f"rollout.max_lag={self.max_lag!r} must be an integer >= 0 (0 = synchronous) or auto"
            )
        if isinstance(self.max_lag, int) and self.max_lag < 0:
            raise ValueError(f"rollout.max_lag must be >= 0 (0 = synchronous) or auto, got {self.max_lag}")
        if not (math.isfinite(self.min_ess) and 0 < self.min_ess <= 1):
            raise ValueError(f"rollout.min_ess={self.min_ess} must be in (0, 1] (e.g. 0.9)")
        if isinstance(self.max_auto_lag, bool) or not isinstance(self.max_auto_lag, int) or self.max_auto_lag < 1:
            raise ValueError(f"rollout.max_auto_lag={self.max_auto_lag!r} must be an integer >= 1 (e.g. 8)")
        if self.auto_lag and self.exact_lag:
            raise ValueError(
                "rollout.exact_lag=true forces one lag, and rollout.max_lag=auto chooses it: set a number for "
                "rollout.max_lag, or rollout.exact_lag=false"
            )
        if self.engine == "embedded" and self.max_lag != 0:
            raise ValueError(
                f"rollout.engine=embedded samples inside the trainer process and cannot run ahead of it: "
                f"rollout.max_lag={self.max_lag} needs rollout.engine=local (or sglang); or set rollout.max_lag=0"
            )
        launching = self.sglang.launch.num_servers > 0
        given = bool(self.sglang.urls or self.sglang.router)
        if self.engine == "sglang" and not given and not launching:
            raise ValueError(
                "rollout.engine=sglang needs rollout.sglang.urls (e.g. [http://127.0.0.1:30000]), a "
                "rollout.sglang.router, or servers to start (rollout.sglang.launch.num_servers=1 with "
                "launch.python=<the SGLang env's python>); or use rollout.engine=local to start the built-in CPU server"
            )
        if given and launching:
            which = f"rollout.sglang.urls={list(self.sglang.urls)}" if self.sglang.urls else "rollout.sglang.router"
            raise ValueError(
                f"{which} and rollout.sglang.launch.num_servers={self.sglang.launch.num_servers} are both set: "
                "give running servers, or servers to start"
            )
        if launching and self.engine != "sglang":
            raise ValueError(
                f"rollout.sglang.launch.num_servers={self.sglang.launch.num_servers} starts SGLang servers, but "
                f"rollout.engine={self.engine}: set rollout.engine=sglang"
            )
        if self.sglang.weight_sync.method == "distributed" and self.engine == "embedded":
            raise ValueError(
                "rollout.sglang.weight_sync.method=distributed sends weights to rollout servers (rollout.engine="
                "local or sglang); rollout.engine=embedded shares the trainer's memory: set weight_sync.method=disk"
            )
        if (
            self.sglang.weight_sync.method == "distributed"
            and self.engine == "local"
            and self.sglang.weight_sync.backend == "nccl"
        ):
            raise ValueError(
                "rollout.sglang.weight_sync.backend=nccl: the built-in CPU server (rollout.engine=local) receives "
                "weights over gloo only: set weight_sync.backend=gloo (or auto)"
            )
        if self.sglang.lora_adapters:
            if self.engine != "sglang":
                raise ValueError(
                    f"rollout.sglang.lora_adapters=true loads adapters into SGLang servers, but rollout.engine="
                    f"{self.engine} takes merged weights: set rollout.engine=sglang, or lora_adapters=false"
                )
            if self.sglang.weight_sync.method != "disk":
                raise ValueError(
                    "rollout.sglang.lora_adapters=true: adapters travel as PEFT directories on disk, so "
                    "rollout.sglang.weight_sync.method must be disk"
                )
            if launching and self.sglang.launch.cpu:
                raise ValueError(
                    "rollout.sglang.lora_adapters=true with rollout.sglang.launch.cpu=true: SGLang's --enable-lora "
                    "does not run on its CPU backend (sglang #31894); CPU servers take merged weights "
                    "(lora_adapters=false)"
                )
        if self.engine != "sglang" and self.sglang.router:
            raise ValueError(
                f"rollout.sglang.router={self.sglang.router!r} is set but rollout.engine={self.engine} does not "
                "use it: set rollout.engine=sglang, or clear rollout.sglang.router"
            )
        if self.engine != "sglang" and self.sglang.urls:
            raise ValueError(
                f"rollout.sglang.urls={list(self.sglang.urls)} is set but rollout.engine={self.engine} does not "
                "use them: set rollout.engine=sglang, or clear rollout.sglang.urls"
            )


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Where code verifiers run model-written programs (applied to every code verifier without its own)."""
    tools: list[ToolSpec] = field(default_factory=list)
    """Tools the model may call mid-answer, each for the rows of its tasks (docs/tools.md); empty: none. They run
    in the `sandbox` section's sandbox."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    """`trustbatch sft` (supervised fine-tuning; ignored by `train`)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    resume: str = ""
    """Continue an interrupted run: its run directory or its MLflow run id. Training restarts from its last
    complete checkpoint (weights, optimizer, schedule, RNG, data position, policy version) and logs into the
    same MLflow run. Empty: a new run."""

    @property
    def tracking_uri(self) -> str:
        """The MLflow store: tracking.uri, else $MLFLOW_TRACKING_URI, else a SQLite file beside the run directory
        (runs/mlflow.db for runs/<name>), shared by its sibling runs."""
        return self.tracking.uri or default_tracking_uri(self.run.path.parent)

    def __post_init__(self) -> None:
        # Cross-section rules: each names both keys and the fix. The context of a tiny model (built in code, or
        # bootstrapped at model.path) is known here; a pretrained model's is checked against every prompt at
        # start-up (data.on_long_prompt).
        tiny = not self.model.path or self.model.bootstrap
        if tiny and self.model.tiny.max_position_embeddings <= self.rollout.max_new_tokens:
            raise ValueError(
                f"rollout.max_new_tokens={self.rollout.max_new_tokens} leaves no room for the prompt in "
                f"model.tiny.max_position_embeddings={self.model.tiny.max_position_embeddings}: "
                "lower rollout.max_new_tokens or raise model.tiny.max_position_embeddings"
            )
        if (
            self.data.eval.startswith("builtin:")
            and self.eval.num_prompts is not None
            and self.eval.num_prompts > self.data.num_eval
        ):
            raise ValueError(
                f"eval.num_prompts={self.eval.num_prompts} is more than the data.num_eval={self.data.num_eval} "
                "held-out prompts generated for the built-in task: raise data.num_eval or lower eval.num_prompts"
            )
        _check_verifier_params(self.rewards)
        try:
            check_specs(list(self.tools))
        except ValueError as exc:
            raise ValueError(f"{exc} (the `tools` section; docs/tools.md)") from None
        if self.tools and self.rollout.max_turns < 2:
            raise ValueError(
                f"tools are set but rollout.max_turns={self.rollout.max_turns}: the model could call a tool and never "
                "read its result; set rollout.max_turns >= 2 (e.g. 4)"
            )
        if self.rollout.sglang.lora_adapters and self.trainer.lora.rank == 0:
            raise ValueError(
                "rollout.sglang.lora_adapters=true publishes LoRA adapters, but trainer.lora.rank=0 trains every "
                "weight: set trainer.lora.rank (e.g. 8), or lora_adapters=false"
            )
        samples = self.rollout.prompts_per_step * self.rollout.group_size
        if self.trainer.micro_batch_size > samples:
            raise ValueError(
                f"trainer.micro_batch_size={self.trainer.micro_batch_size} is larger than the "
                f"{samples} samples of a step (rollout.prompts_per_step x rollout.group_size): "
                "lower trainer.micro_batch_size"
            )


def _check_verifier_params(rewards: RewardsConfig) -> None:
    for i, spec in enumerate(rewards.verifiers):
        try:
            check_params(spec.name, dict(spec.params))
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"rewards.verifiers[{i}].params={dict(spec.params)!r} is not valid for the {spec.name!r} "
                f"verifier: {exc}. Fix or remove the parameter (see {PARAMS[spec.name].__name__} in rewards/)"
            ) from None


def check_trainable(config: Config) -> None:
    """Rules that only matter when training starts (print-config shows any config): the model directory, and
    that the run directory and the MLflow store can be written. Quick and bounded: nothing is loaded."""
    try:
        _check_trainable(config)
    except OSError as exc:  # e.g. a path under a directory this user cannot search: stat itself fails
        raise ConfigError(
            f"cannot check the paths of this config ({exc}): make model.path, run.dir and tracking.uri point "
            "at places this user can read and write"
        ) from None


def _check_trainable(config: Config) -> None:
    path = config.model.path
    if not path:
        raise ConfigError(
            "config key `model.path` is empty: set it to a local Hugging Face model directory "
            "(or model.bootstrap=true with a path to build the tiny offline model there)"
        )
    if path.startswith(("models:/", "runs:/")):  # a model in the MLflow store: looked up when the run starts
        local = None
    else:
        local = Path(path)
    if local is not None and local.exists() and not (local / "config.json").is_file():
        what = "a directory without config.json" if local.is_dir() else "a file"
        raise ConfigError(
            f"model.path={path!r} is {what}, not a Hugging Face model directory: point it at a directory "
            "written by save_pretrained (config.json + *.safetensors + tokenizer files), or at a path that does "
            "not exist yet with model.bootstrap=true to build the tiny offline model there"
        )
    if local is not None and not local.exists() and not config.model.bootstrap and _looks_like_local_path(path):
        raise ConfigError(
            f"model.path={path!r} does not exist: point it at a Hugging Face model directory, or set "
            "model.bootstrap=true to build the tiny offline model there"
        )
    if local is not None and not local.exists() and config.model.bootstrap:
        problem = writable_dir_problem(local)
        if problem:
            raise ConfigError(
                f"model.path={path!r} does not exist and model.bootstrap=true would build the tiny model there, "
                f"but it cannot be created ({problem}); set model.path to a writable location"
            )
    problem = writable_dir_problem(config.run.path)
    if problem:
        key = "run.dir" if config.run.dir else "run.name"
        value = config.run.dir or config.run.name
        raise ConfigError(
            f"{key}={value!r}: the run directory {config.run.path} cannot be created or written ({problem}); "
            "set run.dir to a writable directory (e.g. run.dir=runs/my-run)"
        )
    uri = config.tracking_uri
    problem = store_problem(uri)
    if problem:
        if config.tracking.uri:
            where = f"tracking.uri={uri!r}"
        elif os.environ.get("MLFLOW_TRACKING_URI"):
            where = f"tracking.uri is empty, so $MLFLOW_TRACKING_URI={uri!r} is used"
        else:
            where = f"tracking.uri is empty, so the default store {uri!r} is used"
        raise ConfigError(
            f"{where}: {problem}; set tracking.uri to sqlite:///<a writable directory>/mlflow.db or to "
            "http(s)://host:port of an MLflow server (empty: a SQLite file beside the run directory)"
        )


def _looks_like_local_path(path: str) -> bool:
    """Not a hub id ("name" or "org/name"): absolute, dotted, home-relative or deeper."""
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or (os.sep != "/" and os.sep in path)


def _format_omegaconf_error(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or "<root>"
    # omegaconf appends "full_key: ... object_type=..." lines meant for developers; keep the sentence.
    msg = (getattr(exc, "msg", None) or str(exc)).split("\n    full_key")[0].strip()
    return f"config key `{key}`: {msg}"


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Compose defaults, the YAML file at `path` (optional) and `key=value` overrides into a `Config`.

    Raises ConfigError (a ValueError) with one message per problem; nothing else is started.
    """
    layers = [OmegaConf.structured(Config)]
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist (see configs/ for examples)")
        try:
            loaded = OmegaConf.load(path)
        except Exception as exc:  # yaml errors come in many types
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(
                f"config file {path} holds a YAML {type(loaded).__name__.replace('Config', '').lower()}, not a "
                "mapping of sections: write `section: {key: value}` at the top level, e.g. `run: {steps: 10}` "
                "(see configs/quickstart.yaml)"
            )
        layers.append(loaded)
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not of the form key=value (e.g. optim.lr=3e-5)")
    for override in overrides:
        try:
            OmegaConf.from_dotlist([override])
        except Exception as exc:  # yaml ParserError / ScannerError, omegaconf grammar errors
            key, _, value = override.partition("=")
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"override {override!r}: the value of `{key}` is not valid YAML ({reason}): close its brackets "
                f"and quotes, e.g. 'rewards.verifiers=[{{name: math, tasks: [math]}}]', or quote a plain string"
            ) from None
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = _merge(layers, path, overrides)
        _reject_non_finite(OmegaConf.to_container(merged, resolve=True, throw_on_missing=False))
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        cause = exc.__cause__
        if isinstance(cause, ValueError) and not isinstance(cause, OmegaConfBaseException):
            # A __post_init__ check: its message already names the key, the value and the fix.
            raise ConfigError(str(cause)) from None
        raise ConfigError(_format_omegaconf_error(exc)) from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    assert isinstance(config, Config)
    return config


def _merge(layers: list, path: Path | None, overrides: list[str] | tuple[str, ...]):
    """OmegaConf.merge, with its TypeError for a list element set on its own turned into one ConfigError."""
    try:
        return OmegaConf.merge(*layers)
    except TypeError as exc:
        culprit = None  # the file itself, unless an override is found to be the one
        if _merges(*layers[:-1]):
            base = OmegaConf.merge(*layers[:-1])
            culprit = next((o for o in overrides if not _merges(base, OmegaConf.from_dotlist([o]))), None)
        where = f"override {culprit!r}" if culprit else f"config file {path}"
        raise ConfigError(
            f"{where}: a list is set element by element or where a section is expected ({exc}); set the whole "
            "list instead, e.g. rewards.verifiers=[{name: math, weight: 0.5}] or rollout.sglang.urls=[http://a:1]"
        ) from None


def _merges(*layers) -> bool:
    try:
        OmegaConf.merge(*layers)
    except TypeError:
        return False
    return True


def _reject_non_finite(node: Any, key: str = "") -> None:
    """NaN and infinity in any float of the config (typed fields and free-form params alike) stop the load:
    every comparison with NaN is false, so range checks would let it through to the first rollout."""
    if isinstance(node, dict):
        for k, v in node.items():
            _reject_non_finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _reject_non_finite(v, f"{key}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        default = OmegaConf.select(OmegaConf.structured(Config), key, default=None)
        example = f"e.g. {key}={default!r}" if isinstance(default, (int, float)) else "give a number"
        raise ConfigError(
            f"{key}={node!r} must be a finite number (NaN and infinity are not allowed): {example}"
        )


def to_yaml(config: Config) -> str:
    """The resolved config as YAML (what `trustbatch print-config` prints and the run directory keeps)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def flatten(config: Config) -> dict[str, object]:
    """Dotted-key view of the resolved config, for MLflow params."""
    out: dict[str, object] = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, list):
            if not node or all(not isinstance(v, (dict, list)) for v in node):
                out[prefix] = node
            else:
                for i, v in enumerate(node):
                    walk(f"{prefix}.{i}", v)  # omegaconf dotlist syntax; MLflow forbids brackets
        else:
            out[prefix] = node

    walk("", OmegaConf.to_container(OmegaConf.structured(config)))
    return out
