"""2-process gloo FSDP2 (torchrun) against 1 process with LocalReducer: same loss, ESS, grad norm and weights.

This pins the DP-scaling convention of trainer/step.py: the gradient is that of the global token-sum loss / N
whatever the world size, the row split between ranks and the micro-batching (padding micro-batches included).
Measured on the 2-core CPU box (torch 2.13 CPU, float32), 2 steps per scenario:
- metrics (loss terms, ESS, ratio mean/max, pre-clip grad norm): max relative difference 4.9e-7;
- weights after plain SGD (lr 0.1, no clipping; the weight change is the gradient): max absolute difference
  7.5e-9 on changes up to 3.5e-2, i.e. the gradients agree to about 2e-7 relative;
- weights after AdamW (lr 1e-2): max absolute difference 7.7e-6 on changes up to 2e-2. Adam divides by
  sqrt(v), so float32 rounding on near-zero gradients is amplified; this is not a gradient mismatch (a wrong
  dp_scale would change every SGD update by a factor of 2).
The tolerances below sit about 10x above these measurements.
"""

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration import dist_worker
from trainer.distributed import LocalReducer

WORKER = Path(dist_worker.__file__).resolve()
REPO = WORKER.parents[2]
METRIC_RTOL = 1e-5
WEIGHT_ATOL = {"adamw": 1e-4, "sgd": 1e-7}
COMPARED = ("loss/total", "loss/policy", "loss/kl_behaviour", "loss/ess", "loss/ratio/max", "train/grad_norm")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(WORKER), str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (
        f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def references():
    """The same scenarios in this process: LocalReducer, no sharding, all rows."""
    return {
        name: dist_worker.run_scenario(name, LocalReducer(), rank=0, world_size=1, shard=None)
        for name in dist_worker.SCENARIOS
    }


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(dist_worker.SCENARIOS))
def test_two_ranks_match_one_process(two_process_results, references, scenario):
    reference = references[scenario]
    weight_atol = WEIGHT_ATOL[dist_worker.SCENARIOS[scenario][3]]
    for rank, results in enumerate(two_process_results):
        got = results[scenario]
        for step, (dist_m, ref_m) in enumerate(zip(got["metrics"], reference["metrics"], strict=True)):
            assert dist_m["train/skipped"] == 0.0
            assert dist_m["train/num_tokens"] == ref_m["train/num_tokens"]
            for key in COMPARED:
                assert _rel(dist_m[key], ref_m[key]) < METRIC_RTOL, (rank, step, key, dist_m[key], ref_m[key])
            for key in ref_m:  # every SUM/MAX metric agrees, not just the compared ones
                if key.startswith(("loss/", "train/grad_norm/")):
                    close = math.isclose(dist_m[key], ref_m[key], rel_tol=1e-4, abs_tol=1e-6)
                    assert close, (key, rank, step)
        assert got["state"].keys() == reference["state"].keys()
        for key, ref_w in reference["state"].items():
            torch.testing.assert_close(got["state"][key], ref_w, atol=weight_atol, rtol=0, msg=key)
        if "merged" in reference:  # LoRA: what a publication sends, merged under the base model's names
            assert got["merged"].keys() == initial_keys() and reference["merged"].keys() == initial_keys()
            for key, ref_w in reference["merged"].items():
                torch.testing.assert_close(got["merged"][key], ref_w, atol=weight_atol, rtol=0, msg=key)
    # The weights really moved, so the agreement is not trivial.
    initial = dist_worker.build_model(seed=0).state_dict()
    final = reference.get("merged", reference["state"])
    moved = max((final[k] - v).abs().max().item() for k, v in initial.items())
    assert moved > 1e-3


def initial_keys():
    return dist_worker.build_model(seed=0).state_dict().keys()


@pytest.mark.slow
def test_per_term_gradient_norms_agree_across_ranks(two_process_results, references):
    reference = references["sequence_diagnosed"]["metrics"]
    for results in two_process_results:
        for dist_m, ref_m in zip(results["sequence_diagnosed"]["metrics"], reference, strict=True):
            for key in ("train/grad_norm/policy", "train/grad_norm/behaviour_kl"):
                assert ref_m[key] > 0 and _rel(dist_m[key], ref_m[key]) < METRIC_RTOL, (key, dist_m[key], ref_m[key])


@pytest.mark.slow
def test_the_bf16_rounded_reference_is_the_one_process_one_and_leaves_the_shards_exact(two_process_results, references):
    """The publication check's reference for a bf16 engine (`weights_rounded_to` under FSDP2: each rank rounds
    its own shard, the forward all-gathers the rounded values) equals the unsharded model's, and every shard is
    back to its exact value afterwards."""
    from app.rollout.joint import reference_logprobs

    assert references["micro_batch"]["restored"]
    for results in two_process_results:
        got = results["micro_batch"]
        assert got["restored"]
        # Against an unsharded model holding the same final weights (the ranks' weights equal the one-process
        # run's only to rounding, and bf16 rounding can tip either way on such differences).
        model = dist_worker.build_model(seed=0)
        model.load_state_dict(got["state"])
        expected = reference_logprobs(model, dist_worker.PROBE_IDS, weight_dtype="bfloat16")
        assert expected != reference_logprobs(model, dist_worker.PROBE_IDS)  # the rounding changed something
        torch.testing.assert_close(torch.tensor(got["bf16_reference"]), torch.tensor(expected), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_uneven_split_runs_padding_micro_batches(two_process_results):
    # 5 vs 2 rows at micro_batch_size 2: both ranks ran max(3, 1) = 3 micro-batches.
    for results in two_process_results:
        assert results["step_uneven"]["metrics"][0]["train/micro_batches"] == 3.0


@pytest.mark.slow
def test_process_group_reducer_sums_and_maxes(two_process_results):
    for results in two_process_results:
        assert results["reducer"] == {"sum": [3.0, 1.0], "max": [3, 1]}


@pytest.mark.slow
def test_bf16_mixed_precision_step_is_finite_and_close(two_process_results, references):
    reference = references["micro_batch"]
    for results in two_process_results:
        bf16 = results["bf16"]
        assert bf16["train/skipped"] == 0.0 and math.isfinite(bf16["train/grad_norm"])
        assert abs(bf16["loss/total"] - reference["metrics"][0]["loss/total"]) < 2e-2
