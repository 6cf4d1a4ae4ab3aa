"""Config loading: every shipped config loads, base.yaml is the resolved defaults, each bad value has its error."""

from pathlib import Path

import pytest

from app.config import Config, ConfigError, flatten, load_config, to_yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_base_yaml_equals_print_config_output():
    assert (CONFIGS / "base.yaml").read_text() == to_yaml(load_config(None)), (
        "configs/base.yaml is stale: regenerate it with `trustbatch print-config > configs/base.yaml`"
    )


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
        (["run.steps=0"], ["run.steps", "0"]),
        (["eval.num_prompts=0"], ["eval.num_prompts"]),
        # cross-field: a micro-batch larger than the step's samples
        (["trainer.micro_batch_size=100000"], ["trainer.micro_batch_size", "rollout.prompts_per_step"]),
        (["rollout.max_new_tokens=4096"], ["rollout.max_new_tokens", "model.tiny.max_position_embeddings"]),
        (["notanoverride"], ["key=value"]),
        (["rollout.max_lag=-1"], ["rollout.max_lag", "-1"]),
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
        (["rollout.sglang.weight_sync.method=distributed"], ["rollout.engine=sglang", "weight_sync.method=disk"]),
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
