"""Two nodes on one machine: two `torchrun --nnodes=2` launches meet at a c10d rendezvous on 127.0.0.1.

Each "node" is one torchrun with one trainer rank, which starts its own built-in rollout server and sends it
every policy version from disk (the run directory stands in for the shared filesystem) or over a gloo group of
the rank and its server (the distributed sync). A few synchronous steps of `trustbatch train` give exactly the
update of one node with two processes, with either sync: the same two ranks do the same arithmetic, only the
rendezvous differs (the one-node run uses disk; gloo and disk publish the same weights bitwise, test_loop.py). With real SGLang servers: tests/sglang/test_multinode_sglang.py. Also here: nodes started with different configs stop with one message
naming the node and the keys, and a rendezvous that never completes ends after torchrun's join timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO
from .test_loop import small_overrides

pytestmark = pytest.mark.slow
TIMEOUT_S = 300  # a hang fails the test here instead of stalling CI
STEPS = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_args(tmp_path: Path, model_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    overrides = small_overrides(tmp_path, model_dir, f"run.steps={STEPS}", "rollout.max_lag=0", "checkpoint.every=0",
                                "eval.every=0", "eval.num_prompts=8", "eval.greedy=false",
                                f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", *extra)  # fmt: skip
    return ["train", str(REPO / "configs" / "quickstart.yaml"), *overrides, f"run.dir={run_dir}"]


def torchrun(*flags_and_command: str) -> list[str]:
    """Plain torchrun: its flags, then the trustbatch command (train ...) as `-m app.cli`."""
    at = flags_and_command.index("train")
    return [sys.executable, "-m", "torch.distributed.run", *flags_and_command[:at], "-m", "app.cli",
            *flags_and_command[at:]]  # fmt: skip


def launch(*flags_and_command: str) -> list[str]:
    """`trustbatch launch`: the same flags and command (app/launch.py)."""
    return [sys.executable, "-m", "app.cli", "launch", *flags_and_command]


def torchrun_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def two_nodes(node_args: list[list[str]], join_timeout_s: int = 60) -> list[subprocess.CompletedProcess]:
    """One `trustbatch launch` per node (the trustbatch command of each), started together; their results in
    node order."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            launch("--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}", "--rdzv_backend=c10d",
                      f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes",
                      f"--rdzv_conf=join_timeout={join_timeout_s}", *args),  # fmt: skip
            env=torchrun_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node, args in enumerate(node_args)
    ]
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{STEPS:06d}" / "model" / "model.safetensors")


def _losses(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss/total", "loss/ess", "train/grad_norm", "train/num_tokens", "reward/mean")
    return [{k: row[k] for k in keys} for row in rows if "loss/total" in row]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, tiny_model_dir):
    """The run as 1 node x 2 ranks (disk sync): its run directory. The two-node runs of either sync are compared
    with it: gloo and disk publish the same weights bitwise (tests/integration/test_loop.py)."""
    tmp = tmp_path_factory.mktemp("one-node")
    one = tmp / "one-node"
    single = subprocess.run(
        torchrun("--nnodes=1", "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
                  *train_args(tmp, tiny_model_dir, one, "rollout.sglang.weight_sync.method=disk")),  # fmt: skip
        env=torchrun_env(), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert single.returncode == 0, f"one node failed ({single.returncode}):\n{single.stdout[-3000:]}{single.stderr[-6000:]}"
    return one


@pytest.fixture(scope="module", params=["disk", "distributed"])
def two_layouts(request, tmp_path_factory, tiny_model_dir, one_node):
    """The same run as 2 nodes x 1 rank with one weight sync, and as 1 node x 2 ranks: their run directories."""
    tmp = tmp_path_factory.mktemp(f"multinode-{request.param}")
    two = tmp / "two-nodes"
    sync = f"rollout.sglang.weight_sync.method={request.param}"
    results = two_nodes([train_args(tmp, tiny_model_dir, two, sync)] * 2)
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node} failed ({result.returncode}):\n{result.stdout[-6000:]}"
    return two, one_node, results, request.param


def test_two_nodes_train_exactly_like_one_node_with_two_processes(two_layouts, tiny_model_dir):
    two, one, results, method = two_layouts
    # The sync asked for was used: from disk, each version is a directory the servers load; a broadcast writes none.
    assert any((two / "weights").glob("v*")) == (method == "disk")
    # Both nodes took part: each rank started its own server and checked it against its own weights.
    assert {f"rollout-server-rank{r}.log" for r in (0, 1)} <= {p.name for p in two.iterdir()}
    text = "\n".join(r.stdout for r in results)
    assert "rank 0: started the CPU rollout server" in text and "rank 1: started the CPU rollout server" in text
    assert json.loads((two / "summary.json").read_text())["steps"] == STEPS

    losses = _losses(two)
    assert len(losses) == STEPS and losses == _losses(one)
    assert all(row["loss/ess"] > 0.999 for row in losses)  # synchronous: every sample from the current weights
    got, want = _weights(two), _weights(one)
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
    start = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(got[name], start[name]) for name in start)  # the steps moved the weights


def test_nodes_started_with_different_configs_stop_with_one_message_naming_the_node_and_keys(
    tmp_path, tiny_model_dir
):
    run_dir = tmp_path / "run"
    results = two_nodes([
        train_args(tmp_path, tiny_model_dir, run_dir),
        train_args(tmp_path, tiny_model_dir, run_dir, "optim.lr=2e-3"),
    ])  # fmt: skip
    for node, result in enumerate(results):
        assert result.returncode != 0, f"node {node} ran with a config unlike rank 0's:\n{result.stdout[-3000:]}"
        # Ranks are numbered by arrival at the rendezvous, so the odd one out is rank 1 or rank 0.
        assert "the ranks resolved different configs" in result.stdout, result.stdout[-3000:]
        assert "optim.lr=0.002 (rank 0: 0.001)" in result.stdout or "optim.lr=0.001 (rank 0: 0.002)" in result.stdout
        assert "same config file and overrides" in result.stdout
    assert not run_dir.exists()  # stopped before rank 0 created the run directory


@pytest.mark.parametrize("runner", [launch, torchrun], ids=["trustbatch-launch", "torchrun"])
def test_a_rendezvous_that_never_completes_ends_after_the_join_timeout(tmp_path, tiny_model_dir, runner):
    """One node of two gives up after --rdzv_conf=join_timeout (docs/cluster.md sets it) and never starts
    trustbatch; without the flag it would wait 600 s. `trustbatch launch` ends with one message naming the node
    and the fix; plain torchrun with its traceback."""
    port = _free_port()
    lonely = subprocess.run(
        runner("--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
               "--rdzv_id=lonely", "--rdzv_conf=join_timeout=5",
               *train_args(tmp_path, tiny_model_dir, tmp_path / "run")),  # fmt: skip
        env=torchrun_env(), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert lonely.returncode != 0 and "RendezvousTimeoutError" in lonely.stderr, lonely.stderr[-3000:]
    assert not (tmp_path / "run").exists()
    if runner is launch:
        assert lonely.returncode == 2
        [message] = [line for line in lonely.stderr.splitlines() if line.startswith("error: ")]
        assert f"never met the other nodes at rendezvous '127.0.0.1:{port}'" in message
        assert "node " in message and "--nnodes=2" in message and "id 'lonely'" in message
        assert "Fix: start the same command on every one of the 2 node(s) within the join timeout (5 s" in lonely.stderr
        assert f"check that 127.0.0.1:{port} is reachable" in lonely.stderr
        assert "Traceback" not in lonely.stderr
