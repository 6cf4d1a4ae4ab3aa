"""Verified weight publication (app/rollout/probe.py) against the built-in server over real HTTP.

Covered: the server's ``input_token_logprobs`` (``logprob_start_len``) equal the trainer's float32
log-probabilities; a fleet publishing from disk passes the check version after version; a server left on other
weights under the new label (the base model: an update that loaded the wrong directory, as an adapter that never
loaded does) is caught, published once more, and stops the run naming the server and the version; a fault that
the retry cures does not stop it; a server that serves another model than the run starts from is refused at the
start; a bfloat16 engine's own gap sets the automatic tolerance.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.rollout.base import WeightSource
from app.rollout.embedded import EmbeddedEngine
from app.rollout.fleet import Fleet, PublishHooks, SupervisionConfig
from app.rollout.probe import (
    AUTO_FLOOR,
    PublishCheck,
    PublishCheckConfig,
    PublishCheckError,
    gap,
    probe_ids,
    reference_logprobs,
)
from app.rollout.sglang import SGLangClient, SGLangClientConfig

from .test_local_server import _start


@pytest.fixture
def server_a(model_dirs):
    """A fresh server on model a for each test (a test's publications change the weights it serves)."""
    srv = _start(model_dirs[0], max_batch_size=64, batch_window_ms=5)
    yield srv
    srv.close()


def load(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def nudge(model: torch.nn.Module, seed: int, scale: float = 0.02) -> None:
    """A stand-in for an optimizer step: every weight moves a little."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)


class Recorder:
    def __init__(self) -> None:
        self.held: list[int] = []
        self.failed: list[BaseException] = []

    def hooks(self) -> PublishHooks:
        async def held(version: int) -> None:
            self.held.append(version)

        async def failed(exc: BaseException) -> None:
            self.failed.append(exc)

        return PublishHooks(held=held, failed=failed)


class WrongDirectoryClient(SGLangClient):
    """A real client whose weight updates load ``wrong`` under the new version label, the first ``times`` times
    (the fault class of an adapter that never loaded, or a server restarted from an old directory)."""

    def __init__(self, cfg: SGLangClientConfig, wrong, times: int) -> None:
        super().__init__(cfg)
        self.wrong, self.times = wrong, times

    async def update_weights(self, source: WeightSource, version: int, **kwargs) -> None:
        if self.times > 0:
            self.times -= 1
            source = WeightSource(path=self.wrong)
        await super().update_weights(source, version, **kwargs)


def http_fleet(client: SGLangClient, tmp_path, tokenizer) -> Fleet:
    return Fleet(
        client,
        [],
        SupervisionConfig(),
        health_timeout_s=20.0,
        weights_dir=tmp_path / "weights",
        tokenizer=tokenizer,
        check=PublishCheck(PublishCheckConfig(), probe_ids(tokenizer)),
    )


def test_input_token_logprobs_equal_the_trainers(server_a, model_dirs):
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[0])
    ids = probe_ids(tokenizer)
    reference = reference_logprobs(load(model_dirs[0]), ids)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
    meta = server_a.client.post("/generate", json={**body, "logprob_start_len": 0}).json()["meta_info"]
    triples = meta["input_token_logprobs"]
    assert len(triples) == len(ids) and triples[0] == [None, ids[0], None]
    assert [t[1] for t in triples] == ids
    assert max(abs(t[0] - r) for t, r in zip(triples[1:], reference, strict=True)) < 1e-4
    assert len(meta["output_token_logprobs"]) == 1  # the sampled token's logprob is still there
    later = server_a.client.post("/generate", json={**body, "logprob_start_len": 5}).json()["meta_info"]
    assert [t[1] for t in later["input_token_logprobs"]] == ids[5:]
    assert [t[0] for t in later["input_token_logprobs"]] == [t[0] for t in triples[5:]]
    plain = server_a.client.post("/generate", json=body).json()["meta_info"]
    assert "input_token_logprobs" not in plain
    bad = server_a.client.post("/generate", json={**body, "logprob_start_len": len(ids)})
    assert bad.status_code == 400 and "logprob_start_len" in bad.json()["error"]


def test_a_fleet_publishing_from_disk_passes_the_check_every_version(server_a, model_dirs, tmp_path):
    async def go():
        tokenizer = AutoTokenizer.from_pretrained(model_dirs[0])
        model, recorder = load(model_dirs[0]), Recorder()
        async with SGLangClient(SGLangClientConfig(urls=[server_a.url])) as client:
            fleet = http_fleet(client, tmp_path, tokenizer)
            await fleet.connect(recorder.hooks(), model)
            start = (fleet.check.start_gap, fleet.check.tolerance)
            gaps = []
            for version in (1, 2):
                nudge(model, version)
                await fleet.publish(model, version)
                await fleet.flush()
                gaps.append(fleet.check.last_gap)
            await fleet.close()
        return recorder, start, gaps, fleet.check_retries

    recorder, (start_gap, tolerance), gaps, retries = asyncio.run(go())
    assert start_gap < 1e-4 and tolerance == AUTO_FLOOR  # float32 on both sides
    assert recorder.held == [1, 2] and not recorder.failed and retries == 0
    assert all(g < 1e-4 for g in gaps)


def publish_through_a_fault(server, model_dirs, tmp_path, *, faulty: int, seed: int):
    """Connect a fleet to ``server`` (on model a), move the trainer's weights, publish version 1 through a client
    whose first ``faulty`` updates load model a instead; (recorder, fleet, the flush's error or None)."""

    async def go():
        tokenizer = AutoTokenizer.from_pretrained(model_dirs[0])
        model, recorder = load(model_dirs[0]), Recorder()
        client = WrongDirectoryClient(SGLangClientConfig(urls=[server.url]), model_dirs[0], times=faulty)
        error = None
        async with client:
            fleet = http_fleet(client, tmp_path, tokenizer)
            await fleet.connect(recorder.hooks(), model)
            nudge(model, seed)
            await fleet.publish(model, 1)
            try:
                await fleet.flush()
            except PublishCheckError as exc:
                error = exc
            await fleet.close()
        return recorder, fleet, error

    return asyncio.run(go())


def test_a_server_left_on_the_base_weights_is_caught_and_stops_the_run(server_a, model_dirs, tmp_path):
    recorder, fleet, error = publish_through_a_fault(server_a, model_dirs, tmp_path, faulty=2, seed=7)
    assert error is not None
    message = str(error)
    assert server_a.url in message and "version 1" in message and "tolerance" in message
    assert fleet.check_retries == 1 and recorder.failed == [error]  # published twice, then the loop is told to stop


def test_a_fault_the_second_publish_cures_does_not_stop_the_run(server_a, model_dirs, tmp_path):
    recorder, fleet, error = publish_through_a_fault(server_a, model_dirs, tmp_path, faulty=1, seed=8)
    assert error is None and fleet.check_retries == 1 and not recorder.failed and recorder.held == [1]
    assert fleet.check.last_gap < 1e-4


def test_a_server_of_another_model_is_refused_at_the_start(server_a, model_dirs, tmp_path):
    async def go():
        tokenizer = AutoTokenizer.from_pretrained(model_dirs[1])
        async with SGLangClient(SGLangClientConfig(urls=[server_a.url])) as client:
            fleet = http_fleet(client, tmp_path, tokenizer)
            try:
                await fleet.connect(Recorder().hooks(), load(model_dirs[1]))  # the trainer starts from b
            finally:
                await fleet.close()

    with pytest.raises(PublishCheckError, match="does not serve the weights this run starts from"):
        asyncio.run(go())


def test_a_bfloat16_engine_sets_the_tolerance_from_its_own_gap(model_dirs):
    async def go():
        tokenizer = AutoTokenizer.from_pretrained(model_dirs[0])
        model, recorder = load(model_dirs[0]), Recorder()
        engine = EmbeddedEngine.from_pretrained(model_dirs[0], dtype=torch.bfloat16)
        check = PublishCheck(PublishCheckConfig(), probe_ids(tokenizer))
        fleet = Fleet(engine, [], SupervisionConfig(), health_timeout_s=5.0, check=check)
        await fleet.connect(recorder.hooks(), model)
        nudge(model, 3)
        await fleet.publish(model, 1)
        await fleet.flush()
        await fleet.close()
        return recorder, check

    recorder, check = asyncio.run(go())
    assert check.start_gap > 1e-5  # bf16 rounding (float32 engines agree to ~1e-7)
    assert check.tolerance == pytest.approx(max(AUTO_FLOOR, 2 * check.start_gap))
    assert recorder.held == [1] and not recorder.failed and check.last_gap <= check.tolerance


def test_gap_and_probe_ids():
    assert gap([0.0, -1.0], [0.0, -1.5]) == pytest.approx(0.25)
    assert gap([0.0], [0.0, 1.0]) == float("inf")
    with pytest.raises(ValueError, match="positive"):
        PublishCheckConfig(tolerance=0)


def test_drifting_engine_noise_passes_but_a_reading_nearer_an_older_version_fails():
    """The rule of `PublishCheck.failures` on readings of known gaps: above the tolerance, a reading still nearest
    the published version is the engine's rounding drifting (it passes); one nearer the start's or the previous
    version's reference by more than half the tolerance is stale (it fails); the label must match."""
    from app.rollout.base import ProbeReading

    start, v1, v2 = [0.0] * 4, [0.1] * 4, [0.2] * 4
    check = PublishCheck(PublishCheckConfig(), [1, 2, 3, 4, 5])
    check.start([ProbeReading("s", "0", [0.01] * 4)], start, 0)  # start gap 0.01 -> tolerance 0.02
    assert check.tolerance == pytest.approx(0.02)
    assert check.failures([ProbeReading("s", "1", [0.1] * 4)], v1, 1) == []  # passes, becomes `previous`
    drifted = [ProbeReading("s", "2", [0.2 + 0.03] * 4)]  # 0.03 > tolerance, but nearest v2 (v1 is 0.13 away)
    assert check.failures(drifted, v2, 2) == []
    stale = [ProbeReading("s", "3", [0.2] * 4)]  # v2's weights under label 3: 0.1 from v3, 0 from v2
    [problem] = check.failures(stale, [0.3] * 4, 3)
    assert "nearer version 2's" in problem and "version 3" in problem
    base = [ProbeReading("s", "3", [0.0] * 4)]  # the start weights under label 3
    [problem] = check.failures(base, [0.3] * 4, 3)
    assert "nearer version 0's" in problem
    assert check.failures([ProbeReading("s", "2", [0.3] * 4)], [0.3] * 4, 3) == ["s answered under weight_version '2', not 3"]


def test_the_reference_of_a_bfloat16_engine_is_the_float32_forward_of_the_weights_it_holds(model_dirs):
    """A bf16 engine holds bf16(w), not w: updates below half a bf16 step (norm gains near 1 under RL learning
    rates) never reach it. With ``weight_dtype`` the reference is computed from exactly the weights the engine
    holds (bitwise), so the check compares like with like; outside, the trainer keeps its exact weights."""
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[0])
    ids = probe_ids(tokenizer)
    model = load(model_dirs[0])
    engine = EmbeddedEngine.from_pretrained(model_dirs[0], dtype=torch.bfloat16)
    with torch.no_grad():  # what RL does to a norm gain: a move far below the bf16 step of 2**-7 at 1.0
        for name, param in model.named_parameters():
            param.add_(1e-3 if "norm" in name else 3e-4)
    exact = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine.update_weights_sync(WeightSource(state_dict=dict(model.state_dict())), 1)
    held = dict(engine.model.named_parameters())
    norm = next(name for name in exact if "norm" in name)
    assert torch.equal(held[norm].float(), torch.ones_like(exact[norm]))  # the norm gain never moved there

    from trainer.precision import weights_rounded_to

    with weights_rounded_to(model, "bfloat16"):
        for name, param in model.named_parameters():
            assert param.dtype == torch.float32 and torch.equal(param, held[name].float()), name
    for name, param in model.named_parameters():  # the exact weights are back, bitwise
        assert torch.equal(param, exact[name]), name

    # The rounded reference is the float32 forward of the engine's own weights.
    upcast = load(model_dirs[0])
    upcast.load_state_dict({name: t.float() for name, t in engine.model.state_dict().items()})
    assert reference_logprobs(model, ids, weight_dtype="bfloat16") == reference_logprobs(upcast, ids)
    assert reference_logprobs(model, ids) != reference_logprobs(upcast, ids)


def test_the_engines_weight_dtype_comes_from_the_config():
    from app.config import load_config
    from app.training.setup import engine_weight_dtype

    def dtype(kind: str, *overrides: str) -> str | None:
        return engine_weight_dtype(load_config(None, list(overrides)), kind)

    assert dtype("local") is None and dtype("embedded") is None
    assert dtype("local", "rollout.dtype=bfloat16") == "bfloat16"
    assert dtype("embedded", "rollout.dtype=bfloat16") == "bfloat16"
    launched = ("rollout.engine=sglang", "rollout.sglang.launch.num_servers=1")
    assert dtype("sglang", *launched) is None  # auto: not known (nor for servers given by URL)
    assert dtype("sglang", *launched, "rollout.sglang.launch.dtype=bfloat16") == "bfloat16"
    assert dtype("sglang", *launched, "rollout.sglang.launch.dtype=half") == "float16"
    sent = ("rollout.sglang.weight_sync.method=distributed", "rollout.sglang.weight_sync.dtype=bfloat16")
    assert dtype("sglang", *launched, *sent) == "bfloat16"
    assert dtype("local", "rollout.sglang.weight_sync.dtype=bfloat16") is None  # the disk method writes float32
    assert dtype("local", "rollout.dtype=bfloat16", "trainer.lora.rank=4") is None
