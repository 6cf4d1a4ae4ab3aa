"""Config loading: every shipped config loads, base.yaml is the resolved defaults, each bad value has its error."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from app.config import Config, ConfigError, check_trainable, flatten, load_config, to_yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_configs_built_in_data_exists(path):
    """The built-in tasks a shipped config names can give the rows it asks for (configs/quickstart-tools.yaml asked
    for 20,000 arithmetic problems of at most two operations, of which 9,300 exist, and stopped at start-up)."""
    from app.data.sources import load_source

    cfg = load_config(path)
    for split in ("train", "eval"):
        for i, spec in enumerate(cfg.data.sources(split)):
            if spec.kind == "builtin":
                assert load_source(cfg.data, spec, split, "rl", f"data.{split}[{i}]")


def test_base_yaml_equals_print_config_output():
    assert (CONFIGS / "base.yaml").read_text() == to_yaml(load_config(None)), (
        "configs/base.yaml is stale: regenerate it with `trustbatch print-config > configs/base.yaml`"
    )


@pytest.mark.parametrize(
    ("env", "cache"),
    [
        ({"TRUSTBATCH_CACHE_DIR": "tb", "XDG_CACHE_HOME": "xdg"}, "tb"),
        ({"XDG_CACHE_HOME": "xdg"}, "xdg/trustbatch"),
        ({}, "home/.cache/trustbatch"),
    ],
)
def test_smollm2_reasoning_config_loads_without_the_model(monkeypatch, tmp_path, env, cache):
    from app.models import default_cache_dir

    monkeypatch.delenv("TRUSTBATCH_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name, value in env.items():
        monkeypatch.setenv(name, str(tmp_path / value))
    cfg = load_config(CONFIGS / "smollm2-reasoning.yaml")
    # The directory `make smollm2` writes: the cache the model commands use (app/models.py), however it is set.
    model = tmp_path / cache / "models" / "SmolLM2-135M-Instruct"
    assert cfg.model.path == str(model) == str(default_cache_dir() / "models" / "SmolLM2-135M-Instruct")
    assert not cfg.model.bootstrap
    assert cfg.data.train == cfg.data.eval == "builtin:word_problems"
    assert cfg.rollout.engine == "local" and cfg.rollout.max_new_tokens == 128
    assert cfg.rollout.prompts_per_step * cfg.rollout.group_size <= 64  # sized for CPU
    assert cfg.objective.name == "ess" and 1e-6 <= cfg.optim.lr <= 2e-5
    assert 0 < cfg.run.time_limit_s <= 1800  # the documented learning run: at most 30 minutes of RL
    # correctness is math's (the first verifier decides); format is a small shaping term beside it
    assert [(v.name, v.tasks) for v in cfg.rewards.verifiers] == [("math", ["math"]), ("format", ["math"])]
    assert cfg.rewards.verifiers[1].weight < cfg.rewards.verifiers[0].weight
    assert 100 <= cfg.eval.num_prompts <= cfg.data.num_eval and cfg.eval.samples_per_prompt <= 4
    assert 0 < cfg.checkpoint.every < cfg.run.steps
    # Training names the missing model directory and the fix; print-config and loading never need it.
    with pytest.raises(ConfigError, match=r"model\.path=.*SmolLM2-135M-Instruct' does not exist"):
        check_trainable(cfg)


def test_qwen_gsm8k_gpu_config_loads_and_names_its_missing_data(monkeypatch, tmp_path):
    monkeypatch.delenv("TRUSTBATCH_QWEN_DIR", raising=False)
    monkeypatch.setenv("GSM8K_DIR", str(tmp_path / "gsm8k"))
    cfg = load_config(CONFIGS / "qwen2.5-0.5b-gsm8k.yaml")
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.model.dtype == "bfloat16"
    assert cfg.data.format == "gsm8k" and cfg.data.train == str(tmp_path / "gsm8k" / "train.jsonl")
    assert cfg.rollout.engine == "sglang" and cfg.rollout.sglang.launch.num_servers == 1
    assert cfg.rollout.sglang.weight_sync.method == "disk"  # one GPU for trainer and server
    assert cfg.rollout.max_new_tokens == 512  # beyond the tiny model's context, which a hub model does not have
    from app.data import DatasetError, load_split

    with pytest.raises(DatasetError, match=r"gsm8k/train\.jsonl: no such file"):
        load_split(cfg.data, "train")


def test_overrides_take_precedence_over_the_file():
    cfg = load_config(
        CONFIGS / "quickstart.yaml", ["optim.lr=1e-4", "run.steps=3", "objective.name=ppo_clip"]
    )
    assert cfg.optim.lr == pytest.approx(1e-4)
    assert cfg.run.steps == 3
    assert cfg.objective.name == "ppo_clip"


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "quickstart.yaml", ["rollout.group_size=4"])
    path = tmp_path / "again.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_flatten_gives_dotted_keys():
    flat = flatten(load_config(None))
    assert flat["optim.lr"] == load_config(None).optim.lr
    assert "objective.name" in flat and "rollout.group_size" in flat


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["optim.lrr=1"], ["optim.lrr", "Did you mean", "lr"]),  # unknown key, omegaconf's suggestion
        (["nosuchsection.x=1"], ["nosuchsection"]),
        (["run.steps=many"], ["run.steps", "many"]),  # wrong type
        (["model.dtype=float8"], ["model.dtype", "float8", "float32"]),  # bad choice lists the choices
        (["objective.name=grpo"], ["objective.name", "grpo", "ess"]),  # bad choice checked in __post_init__
        (["rollout.group_size=1"], ["rollout.group_size", "1", ">= 2"]),
        (["rollout.temperature=0"], ["rollout.temperature"]),
        (["rollout.temperature=1e-320"], ["rollout.temperature", "at least 1e-06"]),
        (["run.steps=0"], ["run.steps", "0"]),
        (["eval.num_prompts=0"], ["eval.num_prompts"]),
        # cross-field: a micro-batch larger than the step's samples
        (["trainer.micro_batch_size=100000"], ["trainer.micro_batch_size", "rollout.prompts_per_step"]),
        (["rollout.max_new_tokens=4096"], ["rollout.max_new_tokens", "model.tiny.max_position_embeddings"]),
        (["notanoverride"], ["key=value"]),
        (["rollout.max_lag=-1"], ["rollout.max_lag", "-1"]),
        (["rollout.max_lag=fast"], ["rollout.max_lag='fast'", "or auto"]),
        (["rollout.max_lag=auto", "rollout.exact_lag=true"], ["rollout.exact_lag=true", "rollout.max_lag=auto"]),
        (["rollout.max_lag=auto", "rollout.min_ess=0"], ["rollout.min_ess=0", "(0, 1]"]),
        (["rollout.max_lag=auto", "rollout.min_ess=1.5"], ["rollout.min_ess=1.5"]),
        (["rollout.max_auto_lag=0"], ["rollout.max_auto_lag=0", ">= 1"]),
        (["rollout.engine=embedded", "rollout.max_lag=auto"], ["rollout.engine=embedded", "rollout.max_lag=auto"]),
        (["rollout.engine=embedded"], ["rollout.engine=embedded", "rollout.max_lag=1", "rollout.engine=local"]),
        (["rollout.supervision.hang_timeout_s=0"], ["rollout.supervision.hang_timeout_s"]),
        (["checkpoint.keep_last=0"], ["checkpoint.keep_last", "0"]),
        (["checkpoint.every=-1"], ["checkpoint.every"]),
        (["run.time_limit_s=-5"], ["run.time_limit_s"]),
        (["rollout.engine=sglang"], ["rollout.sglang.urls", "launch.num_servers"]),
        (["rollout.sglang.launch.num_servers=1"], ["rollout.engine=sglang"]),
        (
            ["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1]", "rollout.sglang.launch.num_servers=1"],
            ["both set"],
        ),
        (
            ["rollout.engine=embedded", "rollout.max_lag=0", "rollout.sglang.weight_sync.method=distributed"],
            ["rollout.engine=embedded", "weight_sync.method=disk"],
        ),
        (
            ["rollout.sglang.weight_sync.method=distributed", "rollout.sglang.weight_sync.backend=nccl"],
            ["weight_sync.backend=nccl", "built-in CPU server", "gloo"],
        ),
        (["rollout.engine=sglang", "rollout.sglang.router=a:1"], ["rollout.sglang.router", "http://"]),
        (
            ["rollout.engine=sglang", "rollout.sglang.router=http://r:1", "rollout.sglang.urls=[http://a:1]"],
            ["router and rollout.sglang.urls are both set"],
        ),
        (
            ["rollout.engine=sglang", "rollout.sglang.router=http://r:1", "rollout.sglang.launch.num_servers=1"],
            ["rollout.sglang.router and rollout.sglang.launch.num_servers=1 are both set"],
        ),
        (["rollout.sglang.router=http://r:1"], ["rollout.engine=local does not use it"]),
        # issue 11: each of these used to load, then fail late (or never)
        (["rollout.temperature=nan"], ["rollout.temperature=nan", "finite", "rollout.temperature=1.0"]),
        (["rollout.temperature=inf"], ["rollout.temperature=inf", "finite"]),
        (["rollout.top_p=-inf"], ["rollout.top_p=-inf", "finite"]),
        (["rewards.verifiers=[{name: math, timeout_s: .inf}]"], ["rewards.verifiers[0].timeout_s=inf", "finite"]),
        (
            ["rewards.verifiers=[{name: math, params: {timeout_s: .nan}}]"],
            ["rewards.verifiers[0].params.timeout_s=nan", "finite"],
        ),
        (
            ["rewards.verifiers=[{name: math, params: {bogus: 1}}]"],
            ["rewards.verifiers[0].params", "bogus", "valid parameters", "extraction"],
        ),
        (
            ["rewards.verifiers=[{name: code, tasks: [code], params: {mode: most}}]"],
            ["rewards.verifiers[0].params", "most", "'fraction' or 'all'"],
        ),
        (["rewards.verifiers=[{name: format, params: {pattern: '('}}]"], ["rewards.verifiers[0].params", "regex"]),
        (["run.name=a/b"], ["run.name='a/b'", "letters, digits", "run.name=a-b"]),
        (["run.name=../../../x"], ["run.name='../../../x'", "run.name=x"]),
        (["run.name=.."], ["run.name='..'"]),
        (["tracking.registered_model=team:model"], ["tracking.registered_model='team:model'"]),
        (["rewards.verifiers=[{name: math"], ["rewards.verifiers=[{name: math", "not valid YAML", "brackets"]),
        (["data.on_long_prompt=truncate"], ["data.on_long_prompt", "truncate", "drop"]),
        # Per-version LoRA adapters: SGLang servers on GPUs, adapters on disk, a LoRA run.
        (["rollout.sglang.lora_adapters=true", "trainer.lora.rank=8"],
         ["rollout.sglang.lora_adapters=true", "rollout.engine=local takes merged weights"]),
        (["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1]", "rollout.sglang.lora_adapters=true",
          "rollout.sglang.weight_sync.method=distributed", "trainer.lora.rank=8"], ["weight_sync.method must be disk"]),
        (["rollout.engine=sglang", "rollout.sglang.launch.num_servers=1", "rollout.sglang.launch.cpu=true",
          "rollout.sglang.lora_adapters=true", "trainer.lora.rank=8"], ["launch.cpu=true", "sglang #31894"]),
        (["rollout.engine=sglang", "rollout.sglang.urls=[http://a:1]", "rollout.sglang.lora_adapters=true"],
         ["trainer.lora.rank=0 trains every weight", "set trainer.lora.rank"]),
    ],
)
def test_bad_values_name_the_key_the_value_and_the_fix(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "quickstart.yaml", overrides)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"
    assert "Traceback" not in message and "\n    full_key" not in message


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def _float_keys(node, key=""):
    """Dotted keys of every float in the default config (typed fields of every section)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _float_keys(v, f"{key}.{k}" if key else k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _float_keys(v, f"{key}[{i}]")
    elif isinstance(node, float):
        yield key


FLOAT_KEYS = sorted(_float_keys(OmegaConf.to_container(OmegaConf.structured(Config))))


def test_the_float_walk_sees_every_section():
    sections = {key.split(".")[0] for key in FLOAT_KEYS}
    assert {"run", "model", "rollout", "rewards", "optim", "objective", "trainer"} <= sections
    assert len(FLOAT_KEYS) > 20


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_field_rejects_nan(key, tmp_path):
    """An override where the key can take one (a list element cannot), else the same value in the YAML file."""
    if "[" in key:
        tree = OmegaConf.to_container(OmegaConf.structured(Config))
        OmegaConf.update(node := OmegaConf.create(tree), key, float("nan"))
        path = tmp_path / "nan.yaml"
        path.write_text(OmegaConf.to_yaml(node))
        args = (path, [])
    else:
        args = (None, [f"{key}=nan"])
    with pytest.raises(ConfigError) as info:
        load_config(*args)
    message = str(info.value)
    assert message.startswith(f"{key}=nan must be a finite number"), message


@pytest.mark.parametrize("value", ["inf", "-inf", ".inf", "-.Inf", ".NaN"])
def test_infinity_is_rejected_in_any_spelling(value):
    with pytest.raises(ConfigError, match=r"^rollout\.sglang\.timeout_s=(-?inf|nan) must be a finite number"):
        load_config(None, [f"rollout.sglang.timeout_s={value}"])


def test_a_list_element_set_on_its_own_is_one_clear_error():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rewards.verifiers[0].weight=0.5"])
    assert "override 'rewards.verifiers[0].weight=0.5'" in str(info.value) and "whole" in str(info.value)


def test_non_finite_values_in_the_yaml_file_are_rejected_too(tmp_path):
    path = tmp_path / "nan.yaml"
    path.write_text("rollout:\n  temperature: .nan\n")
    with pytest.raises(ConfigError, match=r"rollout\.temperature=nan must be a finite number"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "kind"), [("- a\n- b\n", "list"), ("- run: {steps: 3}\n", "list")], ids=["list", "list-of-maps"]
)
def test_a_yaml_file_that_is_not_a_mapping_is_one_clear_error(tmp_path, text, kind):
    path = tmp_path / "list.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path} holds a YAML {kind}, not a mapping of sections" in str(info.value)


@pytest.mark.parametrize("name", ["run", "quickstart", "exp-1.lr_3e-5", "A" * 100])
def test_safe_run_names_load(name):
    assert load_config(None, [f"run.name={name}"]).run.path == Path("runs") / name


def test_verifier_params_that_are_valid_load():
    cfg = load_config(None, ["rewards.verifiers=[{name: math, params: {timeout_s: 2, extraction: [boxed]}}]"])
    assert cfg.rewards.verifiers[0].params == {"timeout_s": 2, "extraction": ["boxed"]}


# ---------------------------------------------------------------------------------------------- start-up checks


def trainable(tmp_path, *overrides):
    return load_config(
        CONFIGS / "quickstart.yaml",
        [f"run.dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", *overrides],
    )


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["model.path=/etc"], ["model.path='/etc'", "without config.json", "save_pretrained"]),
        (["model.path=/etc/hostname"], ["model.path='/etc/hostname'", "is a file"]),
        (["model.path=/nonexistent/model", "model.bootstrap=false"], ["model.path='/nonexistent/model'", "does not exist"]),
        (["model.path=/proc/model"], ["model.path='/proc/model'", "model.bootstrap=true", "cannot be created"]),
        (["run.dir=/proc/x"], ["run.dir='/proc/x'", "cannot be created or written", "/proc"]),
        (["run.dir=/etc/hostname/run"], ["run.dir='/etc/hostname/run'", "is a file"]),
        (["tracking.uri=bogus://x"], ["tracking.uri='bogus://x'", "'bogus'", "sqlite:///", "http"]),
        (["tracking.uri=sqlite:////proc/mlflow.db"], ["tracking.uri='sqlite:////proc/mlflow.db'", "/proc", "sqlite:///"]),
        (["tracking.uri=sqlite://"], ["tracking.uri='sqlite://'", "three slashes"]),
        (["tracking.uri=file:///proc/mlruns"], ["tracking.uri='file:///proc/mlruns'", "/proc"]),
    ],
)
def test_start_up_checks_name_the_key_the_value_and_the_fix(tmp_path, overrides, fragments):
    cfg = trainable(tmp_path, *overrides)
    with pytest.raises(ConfigError) as info:
        check_trainable(cfg)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"
    assert not (tmp_path / "run").exists()


def test_an_unusable_mlflow_tracking_uri_from_the_environment_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////proc/mlflow.db")
    with pytest.raises(ConfigError, match=r"tracking.uri is empty, so \$MLFLOW_TRACKING_URI='sqlite:////proc/"):
        check_trainable(trainable(tmp_path))


@pytest.mark.parametrize(
    "uri",
    [
        "''",  # empty: the default store beside the run directory
        "http://127.0.0.1:5000",
        "https://mlflow.example.com",
        "postgresql+psycopg2://user@host/db",
        "databricks",
        "sqlite:///{tmp}/new/dir/mlflow.db",  # a directory that does not exist yet but can be created
    ],
)
def test_usable_tracking_uris_pass_the_start_up_check(tmp_path, uri):
    check_trainable(trainable(tmp_path, f"tracking.uri={uri.format(tmp=tmp_path)}"))


def test_sandbox_section_reaches_code_verifiers_without_their_own():
    from app.scoring import rewards_with_sandbox

    cfg = load_config(None, [
        "rewards.verifiers=[{name: code, tasks: [code]}, {name: code, label: code2, tasks: [code2], params: {sandbox: {}}},"
        " {name: math, tasks: [math]}]",
        "sandbox.backend=bwrap",
    ])
    specs = rewards_with_sandbox(cfg.rewards, cfg.sandbox).verifiers
    assert specs[0].params["sandbox"]["backend"] == "bwrap"
    assert specs[1].params["sandbox"] == {}  # its own setting wins
    assert "sandbox" not in specs[2].params


def test_unsandboxed_code_needs_explicit_consent():
    with pytest.raises(ConfigError, match="allow_unsandboxed"):
        load_config(None, ["sandbox.backend=none"])


def test_max_lag_auto_loads_with_its_floor_and_limit():
    cfg = load_config(CONFIGS / "quickstart.yaml", ["rollout.max_lag=auto", "rollout.min_ess=0.95"])
    assert cfg.rollout.max_lag == "auto" and cfg.rollout.auto_lag
    assert (cfg.rollout.min_ess, cfg.rollout.lag_limit) == (0.95, 8)
    fixed = load_config(CONFIGS / "quickstart.yaml", ["rollout.max_lag=3"])
    assert fixed.rollout.max_lag == 3 and not fixed.rollout.auto_lag and fixed.rollout.lag_limit == 3
