"""The verifier registry, plug-ins by dotted path, and the contract every registered verifier keeps."""

import math

import pytest
from omegaconf import OmegaConf

from rewards import REGISTRY, RewardsConfig, Score, VerifierInput, build_verifier, register
from rewards.runner import RewardRunner

PLUGIN = "tests.fixtures.plugins.my_verifier:make_verifier"


def test_builtins_are_registered_on_import():
    assert {"math", "code", "format", "exact"} <= set(REGISTRY)


def test_unknown_name_lists_the_registered_names():
    with pytest.raises(ValueError) as info:
        build_verifier("maths")
    message = str(info.value)
    assert (
        "'maths'" in message
        and "'math'" in message
        and "'code'" in message
        and "package.module:factory" in message
    )


def test_register_adds_a_factory_and_refuses_a_clash():
    @register("test_constant")
    def constant(value: float = 0.5):
        return lambda sample: Score(value, None, {}, None)

    try:
        assert build_verifier("test_constant", value=0.25)(VerifierInput("", "", None, {})).reward == 0.25
        with pytest.raises(ValueError, match="already registered"):

            @register("test_constant")
            def other():  # pragma: no cover - never built
                return constant()
    finally:
        REGISTRY.pop("test_constant")


def test_dotted_path_plugin_loads_with_params():
    verify = build_verifier(PLUGIN, target=3)
    score = verify(VerifierInput("", "one two three", None, {}))
    assert score == Score(1.0, True, {"words": 3}, None)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("no_such_module_xyz:make", "cannot import module"),
        ("tests.fixtures.plugins.my_verifier:missing", "has no attribute"),
        ("tests.fixtures.plugins.my_verifier:", "not a valid dotted path"),
    ],
)
def test_bad_dotted_paths_fail_clearly(name, match):
    with pytest.raises(ValueError, match=match):
        build_verifier(name)


def test_plugin_from_a_yaml_config_by_dotted_path(tmp_path):
    path = tmp_path / "rewards.yaml"
    path.write_text(
        f"verifiers:\n  - name: '{PLUGIN}'\n    tasks: [length]\n    params: {{target: 2}}\nnum_workers: 0\n"
    )
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RewardsConfig), OmegaConf.load(path)))
    with RewardRunner(cfg) as runner:
        scores, metrics = runner.score([VerifierInput("", "hello world", None, {"task": "length"})])
    assert scores[0].reward == 1.0 and scores[0].breakdown["make_verifier"]["words"] == 2
    assert metrics["reward/make_verifier/mean"] == 1.0


# ---------------------------------------------------------------- the contract, over every registered verifier

GARBAGE = ["", " ", "\x00\x01", "}{" * 50, "\\boxed{", "```python\n", "é" * 200, "9" * 5000]
REFERENCES = {"code": [{"stdin": "", "stdout": "1"}], "math": "1", "exact": "1"}


def _contract_verifier(name):
    params = {"timeout_s": 2.0} if name == "math" else {}
    if name == "code":
        sandbox = pytest.importorskip("sandbox")
        reasons = sandbox.available_backends()
        backend = (
            "bwrap" if reasons.get("bwrap") is None else "docker" if reasons.get("docker") is None else None
        )
        if backend is None:
            pytest.skip(f"no sandbox backend on this machine: {reasons}")
        params = {"backend": backend, "wall_s": 2.0}
    return build_verifier(name, **params)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_contract_every_verifier(name):
    verify = _contract_verifier(name)
    reference = REFERENCES.get(name)
    for text in GARBAGE:
        sample = VerifierInput("prompt", text, reference, {})
        first = verify(sample)
        assert isinstance(first, Score), (name, text)
        assert math.isfinite(first.reward) and 0.0 <= first.reward <= 1.0, (name, text, first)
        assert first.correct in (True, False, None)
        assert isinstance(first.breakdown, dict)
        assert not (first.error or "").startswith("timeout"), (name, text, first)  # garbage is judged, not timed out
        assert verify(sample) == first, (name, text)  # deterministic
    # The right answer earns the top reward.
    right = {"code": "print(1)", "math": "\\boxed{1}", "exact": "1", "format": "\\boxed{1}"}
    if name in right:
        assert verify(VerifierInput("prompt", right[name], reference, {})).reward == 1.0


def test_a_declared_params_dataclass_checks_params_without_building(monkeypatch):
    from dataclasses import dataclass

    from rewards import registry

    @dataclass
    class WordsConfig:
        target: int = 10

    built = []
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    monkeypatch.setattr(registry, "PARAMS", dict(registry.PARAMS))

    @registry.register("words-test", params=WordsConfig)
    def words(**params):
        built.append(params)
        return lambda sample: None

    registry.check_params("words-test", {"target": 3})
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['bogus'\]"):
        registry.check_params("words-test", {"bogus": 1})
    registry.check_params("some.module:factory", {"anything": 1})  # no declared dataclass: checked when built
    assert built == [] and registry.PARAMS["math"].__name__ == "MathVerifierConfig"
