"""SGLangLaunchConfig and the server command line, without starting a server (runs without .venv-sglang).

Covered: the config loads as an omegaconf structured config; each bad value fails early naming
``rollout.sglang.launch.<field>``, the value and the fix; the argv and environment a server gets on CPU and on
GPUs (ports, GPU assignment, the CPU switches, --weight-version, pass-through arguments, torchrun's variables
removed). That these commands really start SGLang: tests/sglang/test_launcher.py (marked sglang).
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from app.rollout.sglang_server import SGLangLaunchConfig, SGLangServerProcess


def test_structured_config_round_trip():
    base = OmegaConf.structured(SGLangLaunchConfig)
    overrides = OmegaConf.from_dotlist(["num_servers=2", "cpu=true", "extra_args=[--log-level,warning]"])
    cfg = OmegaConf.to_object(OmegaConf.merge(base, overrides))
    assert isinstance(cfg, SGLangLaunchConfig)
    assert cfg.num_servers == 2 and cfg.cpu and cfg.extra_args == ["--log-level", "warning"]
    assert cfg.kv_tokens == 4096  # the CPU default: SGLang would otherwise reserve ~15 GB


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_servers": -1}, r"rollout\.sglang\.launch\.num_servers must be >= 0"),
        ({"python": ""}, r"rollout\.sglang\.launch\.python is empty.*make sglang-env"),
        ({"base_port": 80}, r"rollout\.sglang\.launch\.base_port=80 must be 0"),
        ({"tp_size": 0}, r"rollout\.sglang\.launch\.tp_size must be >= 1, got 0"),
        (
            {"num_servers": 2, "gpu_ids": [0, 1, 2]},
            r"rollout\.sglang\.launch\.gpu_ids=\[0, 1, 2\] has 3 entries",
        ),
        ({"num_servers": 2, "gpu_ids": [0, 0]}, r"gpu_ids=\[0, 0\] must be distinct"),
        (
            {"mem_fraction_static": 1.5},
            r"rollout\.sglang\.launch\.mem_fraction_static=1\.5 must be in \(0, 1\)",
        ),
        ({"dtype": "fp8"}, r"rollout\.sglang\.launch\.dtype='fp8' is not one of"),
        ({"max_total_tokens": 0}, r"rollout\.sglang\.launch\.max_total_tokens=0 must be >= 1"),
        ({"extra_args": ["--port", "1"]}, r"extra_args sets \['--port'\].*use the config fields"),
        ({"startup_timeout_s": 0}, r"rollout\.sglang\.launch\.startup_timeout_s must be > 0"),
    ],
)
def test_bad_values_name_the_key_the_value_and_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        SGLangLaunchConfig(**overrides)


def test_cpu_command_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = SGLangLaunchConfig(num_servers=2, python="/env/bin/python", cpu=True, base_port=31000, random_seed=7,
                             extra_args=["--log-level", "warning"])  # fmt: skip
    server = SGLangServerProcess(tmp_path, cfg, index=1, log_path=tmp_path / "s.log", weight_version=4)
    argv = server.command()
    assert server.url == "http://127.0.0.1:31001"
    assert argv[:3] == ["/env/bin/python", "-m", "sglang.launch_server"]
    text = " ".join(argv)
    for part in ("--port 31001", "--weight-version 4", "--device cpu", "--attention-backend torch_native",
                 "--disable-cuda-graph", "--max-total-tokens 4096", "--skip-tokenizer-init", "--random-seed 8",
                 "--sleep-on-idle",
                 "--tp-size 1"):  # fmt: skip
        assert part in text
    assert argv[-2:] == ["--log-level", "warning"] and "--base-gpu-id" not in argv
    env = server.environment()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert "RANK" not in env and "TORCHELASTIC_USE_AGENT_STORE" not in env


def test_gpu_assignment(tmp_path):
    by_base = SGLangLaunchConfig(num_servers=2, tp_size=2, base_gpu_id=4, mem_fraction_static=0.5)
    server = SGLangServerProcess(tmp_path, by_base, index=1, log_path=tmp_path / "s.log")
    argv = " ".join(server.command())
    assert "--base-gpu-id 6" in argv and "--tp-size 2" in argv and "--mem-fraction-static 0.5" in argv
    assert "--device" not in argv and "--max-total-tokens" not in argv and "--sleep-on-idle" not in argv
    assert "SGLANG_USE_CPU_ENGINE" not in server.environment()

    by_ids = SGLangLaunchConfig(num_servers=2, tp_size=2, gpu_ids=[3, 1, 0, 2])
    server = SGLangServerProcess(tmp_path, by_ids, index=1, log_path=tmp_path / "s.log")
    assert server.environment()["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert "--base-gpu-id" not in server.command()


def test_past_one_machine_gpus_and_ports_come_from_the_servers_place_on_its_own_machine(tmp_path):
    """Rank 3 of a run with 2 ranks per machine (LOCAL_RANK 1), one server each: its server is number 3 of the
    run (log name, seed) but number 1 of its machine (GPU, port); before, it asked for GPU 3 of a 2-GPU node."""
    from app.rollout.sglang_server import SGLangLaunchError

    by_base = SGLangLaunchConfig(num_servers=1, base_gpu_id=0, base_port=31000, random_seed=7)
    server = SGLangServerProcess(tmp_path, by_base, index=3, node_index=1, log_path=tmp_path / "s.log")
    argv = " ".join(server.command())
    assert "--base-gpu-id 1" in argv and "--port 31001" in argv and "--random-seed 10" in argv
    assert server.url == "http://127.0.0.1:31001"

    by_ids = SGLangLaunchConfig(num_servers=1, gpu_ids=[6, 7])  # two ranks on each machine, one GPU each
    server = SGLangServerProcess(tmp_path, by_ids, index=3, node_index=1, log_path=tmp_path / "s.log")
    assert server.environment()["CUDA_VISIBLE_DEVICES"] == "7"
    with pytest.raises(SGLangLaunchError, match=r"server 2 of this machine needs entries 2\.\.2 of .*gpu_ids=\[6, 7\]"):
        SGLangServerProcess(tmp_path, by_ids, index=2, node_index=2, log_path=tmp_path / "s.log")


def test_free_ports_and_missing_interpreter(tmp_path):
    from app.rollout.sglang_server import SGLangLaunchError

    cfg = SGLangLaunchConfig(num_servers=2, python=str(tmp_path / "no-such-python"), cpu=True)
    a = SGLangServerProcess(tmp_path, cfg, index=0, log_path=tmp_path / "a.log")
    b = SGLangServerProcess(tmp_path, cfg, index=1, log_path=tmp_path / "b.log")
    assert a.port != b.port
    with pytest.raises(
        SGLangLaunchError, match=r"rollout\.sglang\.launch\.python=.*no-such-python.*not found"
    ):
        a.start()
    assert a.exited() is None
