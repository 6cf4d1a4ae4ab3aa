"""The rewards config section: defaults, YAML loading, and one error per bad value (naming key, value, fix)."""

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from rewards import RewardsConfig, VerifierSpec, check_tasks


def load(yaml_text="", overrides=()):
    merged = OmegaConf.merge(
        OmegaConf.structured(RewardsConfig),
        OmegaConf.create(yaml_text),
        OmegaConf.from_dotlist(list(overrides)),
    )
    return OmegaConf.to_object(merged)


def test_defaults_score_math():
    cfg = load()
    assert [(v.name, v.weight, v.tasks) for v in cfg.verifiers] == [("math", 1.0, ["math"])]
    assert (cfg.error_reward, cfg.num_workers, cfg.timeout_s) == (0.0, 1, 10.0)
    assert cfg.tasks == ["math"]


def test_yaml_with_weights_params_and_a_plugin():
    cfg = load(
        "verifiers:\n"
        "  - {name: math, weight: 1.0, tasks: [math], params: {extraction: [boxed, last_line], timeout_s: 2}}\n"
        "  - {name: format, weight: 0.1, tasks: [math]}\n"
        "  - {name: 'tests.fixtures.plugins.my_verifier:make_verifier', tasks: [length], label: words}\n"
        "num_workers: 2\n"
    )
    assert cfg.verifiers[0].params == {"extraction": ["boxed", "last_line"], "timeout_s": 2}
    assert [v.key for v in cfg.verifiers] == ["math", "format", "words"]
    assert cfg.tasks == ["math", "length"]


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "match"),
    [
        (
            "verifiers: [{name: maths}]",
            [],
            r"rewards\.verifiers\[0\]\.name='maths' is not a registered verifier.*'math'",
        ),
        (
            "verifiers: [{name: math}, {name: math}]",
            [],
            r"rewards\.verifiers\[1\]\.label: 'math' is already used",
        ),
        (
            "verifiers: [{name: math, tasks: []}]",
            [],
            r"rewards\.verifiers\[0\]\.tasks=\[\] must be a non-empty list",
        ),
        (
            "verifiers: [{name: math, weight: .nan}]",
            [],
            r"rewards\.verifiers\[0\]\.weight=nan must be a finite",
        ),
        (
            "verifiers: [{name: math, timeout_s: 0}]",
            [],
            r"rewards\.verifiers\[0\]\.timeout_s=0\.0 must be > 0",
        ),
        ("verifiers: []", [], r"rewards\.verifiers is empty"),
        ("", ["num_workers=-1"], r"rewards\.num_workers=-1 must be >= 0"),
        ("", ["timeout_s=0"], r"rewards\.timeout_s=0\.0 must be > 0"),
        ("", ["kill_grace_s=-1"], r"rewards\.kill_grace_s=-1\.0 must be > 0"),
        ("", ["chunk_size=-2"], r"rewards\.chunk_size=-2 must be >= 0"),
        ("", ["worker_memory_mb=-5"], r"rewards\.worker_memory_mb=-5 must be >= 0"),
        ("", ["error_reward=inf"], r"rewards\.error_reward=inf must be a finite number"),
    ],
)
def test_each_bad_value_has_its_own_error(yaml_text, overrides, match):
    with pytest.raises(ValueError, match=match):
        load(yaml_text, overrides)


def test_missing_name_unknown_key_and_bad_choice_fail_in_omegaconf():
    with pytest.raises(Exception, match=r"missing mandatory value: name"):
        load("verifiers: [{weight: 1.0}]")
    with pytest.raises(Exception, match="timeout_sec"):
        load("timeout_sec: 3")
    with pytest.raises(ValidationError, match="spawn"):
        load("", ["start_method=thread"])


def test_check_tasks_names_the_missing_task_and_the_configured_ones():
    cfg = RewardsConfig(verifiers=[VerifierSpec(name="math", tasks=["math"])])
    check_tasks(cfg, ["math", "math"])
    with pytest.raises(ValueError, match=r"\['code'\] have no verifier.*score tasks \['math'\]"):
        check_tasks(cfg, ["math", "code"])
