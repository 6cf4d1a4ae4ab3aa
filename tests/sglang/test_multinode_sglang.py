"""Two nodes on one machine with real SGLang (CPU): each node's trainer rank launches its own SGLang server and
broadcasts every policy version to it over gloo (`weight_sync.method=distributed`), nothing through the files,
cast to bfloat16 on the way (`weight_sync.dtype`) into float32 servers. (This is also the loop's test of the bf16
broadcast: tests/sglang/test_loop_sglang.py runs one process with disk sync.)

tests/integration/test_multinode.py shows that two nodes give exactly one node's update (built-in servers, disk
sync); this shows the distributed sync across two torchrun launches: each rank hosts its own weight-update
group (`weight_sync.master_port=0`), and each rank's publication check verifies every version on its own server
(a stale server stops the run, so a run that finishes had every version on both).
"""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import tiny_model_dir  # noqa: F401 - the bootstrapped tiny model fixture
from tests.integration.test_multinode import STEPS, train_args, two_nodes
from tests.sglang.conftest import SGLANG_PYTHON, sglang_env_missing

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_two_nodes_each_broadcast_every_version_to_their_own_sglang_server(tmp_path, tiny_model_dir):  # noqa: F811
    if sglang_env_missing():
        pytest.fail(f"CI must run the real-SGLang tests: {sglang_env_missing()}")
    run_dir = tmp_path / "run"
    args = train_args(
        tmp_path, tiny_model_dir, run_dir,
        "rollout.max_lag=1",
        "rollout.engine=sglang",
        "rollout.sglang.launch.num_servers=1",
        f"rollout.sglang.launch.python={SGLANG_PYTHON}",
        "rollout.sglang.launch.cpu=true",
        "rollout.sglang.launch.dtype=float32",
        "rollout.sglang.launch.startup_timeout_s=300",
        "rollout.sglang.weight_sync.method=distributed",
        "rollout.sglang.weight_sync.backend=gloo",
        "rollout.sglang.weight_sync.dtype=bfloat16",
    )  # fmt: skip
    results = two_nodes([args, args])
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node} failed ({result.returncode}):\n{result.stdout[-6000:]}"
    assert {"sglang-0.log", "sglang-1.log"} <= {p.name for p in run_dir.iterdir()}  # one server per rank
    assert not (run_dir / "weights").exists()  # every version went over gloo
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss/total" in row]
    assert len(steps) == STEPS
    # Rank 0's server held each version: the publication check calibrated on the start weights sent the same way
    # (cast), so the cast's rounding is not taken for stale weights.
    assert all(row["weights/probe_gap"] < 0.1 for row in steps)
    lags = [row["rollout/policy_lag/max"] for row in steps]
    assert lags[0] == 0 and max(lags) == 1, lags
    # Engine and trainer agree on the behaviour policy: on a step trained on samples of the current weights (lag
    # 0; step 1 always is) the ratios are ~1 (bf16 rounding of the weights included), so ESS is ~1.
    assert all(row["loss/ess"] > 0.999 for row, lag in zip(steps, lags, strict=True) if lag == 0)
    text = "\n".join(r.stdout for r in results)
    assert "rank 1: SGLang at http://" in text and "rank 0: SGLang at http://" in text
