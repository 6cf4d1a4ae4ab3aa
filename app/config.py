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
from app.errors import ConfigError
from app.evaluation.config import EvalConfig, EvalJob
from app.rollout.config import RolloutConfig
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
    def eval_job(self) -> EvalJob:
        """The sections an evaluation reads (app/evaluation takes these, never the root config)."""
        return EvalJob(self.data, self.eval, self.rollout, self.rewards, self.sandbox, list(self.tools),
                       self.run.seed, self.tracking.experiment)  # fmt: skip

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
            all(spec.kind == "builtin" and not spec.max_rows for spec in self.data.sources("eval"))
            and self.eval.num_prompts is not None
            and self.eval.num_prompts > self.data.num_eval * len(self.data.sources("eval"))
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
