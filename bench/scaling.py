"""How the quickstart scales on this machine: one against two rollout servers, one against two trainer ranks.

Layouts, each `trustbatch train configs/quickstart.yaml` for the same steps as a user would start it:
- `1 rank, 1 server`: one process and its built-in rollout server (the quickstart as shipped);
- `1 rank, 2 servers`: one process, two built-in rollout servers given by URL (`rollout.engine=sglang`,
  `rollout.sglang.urls`; the built-in server speaks SGLang's HTTP API), started here before the run and stopped
  after it; the client spreads each step's requests over both, every version goes to both from disk;
- `2 ranks, 1 server each`: `torchrun --nproc_per_node=2`, FSDP2 over gloo, each rank with its own built-in
  server and half of each step's prompts.

Every layout runs `--repeats` times, in rotation (A B C A B C ...), so a drift of the machine touches all alike.
Reported per layout: samples/s over the steps (mean ± SE over repeats), the mean step time split into waiting
for rollouts and training, and the busy fractions of rollout and trainer (what `trustbatch train` prints).
The numbers are for this 2-core machine, where a second server or rank takes the core the first one's
partner was using; the model in bench/README.md ("How it scales") says what they mean elsewhere.

    .venv/bin/python bench/scaling.py [--steps 100] [--repeats 2] [--out bench/results] [key=value ...]

About 40 s a run (100 steps; evaluation cut to 8 prompts, no checkpoints), 6 runs by default.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from statistics import mean

from training_runs import REPO, machine, mean_se

CONFIG = REPO / "configs" / "quickstart.yaml"
MODEL = REPO / "runs" / "models" / "tiny-arithmetic"  # the quickstart's model.path (bootstrapped by the first run)
LAYOUTS = ("1 rank, 1 server", "1 rank, 2 servers", "2 ranks, 1 server each")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_servers(n: int, log_dir: Path) -> tuple[list[subprocess.Popen], list[str]]:
    """n built-in rollout servers of the quickstart model, healthy; their processes and URLs."""
    procs, urls = [], []
    for i in range(n):
        port = free_port()
        log = open(log_dir / f"server-{i}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "app.cli", "rollout-server", "--model", str(MODEL), "--port", str(port)],
            cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 120
    for url, proc in zip(urls, procs, strict=True):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"rollout server {url} exited with {proc.returncode}; see {log_dir}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout server {url} did not answer /health within 120 s; see {log_dir}")
            time.sleep(0.5)
    return procs, urls


def run_layout(layout: str, run_dir: Path, steps: int, extra: list[str]) -> dict:
    overrides = [f"run.dir={run_dir}", f"run.steps={steps}", "eval.num_prompts=8", "eval.samples_per_prompt=1",
                 "eval.greedy=false", "eval.every=0", "checkpoint.every=0", *extra]  # fmt: skip
    launcher = [sys.executable, "-m", "app.cli"]
    servers: list[subprocess.Popen] = []
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    if layout == "1 rank, 2 servers":
        log_dir = run_dir.with_name(run_dir.name + "-servers")
        log_dir.mkdir(parents=True, exist_ok=True)
        servers, urls = start_servers(2, log_dir)
        overrides += ["rollout.engine=sglang", f"rollout.sglang.urls=[{','.join(urls)}]"]
    elif layout == "2 ranks, 1 server each":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
                    "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "app.cli"]  # fmt: skip
    log = run_dir.with_suffix(".log")
    try:
        with open(log, "w") as out:
            code = subprocess.call([*launcher, "train", str(CONFIG), *overrides], cwd=REPO, env=ENV, stdout=out,
                                   stderr=subprocess.STDOUT)  # fmt: skip
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(30)
    if code != 0:
        raise RuntimeError(f"{layout}: exited with {code}; end of {log}:\n{log.read_text()[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {
        "samples_per_s": summary["samples_per_s"],
        "rollout_utilisation": summary["rollout_utilisation"],
        "train_utilisation": summary["train_utilisation"],
        "step_s": mean(r["timing/step"] for r in rows),
        "wait_rollout_s": mean(r["timing/wait_rollout"] for r in rows),
        "train_s": mean(r["timing/train"] for r in rows),
        "sync_s": mean(r["timing/weight_save"] + r["timing/weight_sync"] for r in rows),
        "world_size": summary["world_size"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    out = args.out / "scaling"
    results: dict[str, list[dict]] = {layout: [] for layout in args.layouts}
    if not (MODEL / "config.json").is_file():  # the URL servers need the model before the first run builds it
        subprocess.check_call([sys.executable, "-m", "app.cli", "train", str(CONFIG), "run.steps=1",
                               f"run.dir={out / 'bootstrap'}", "eval.num_prompts=8", "eval.samples_per_prompt=1",
                               "eval.greedy=false", "checkpoint.every=0"], cwd=REPO, env=ENV)  # fmt: skip
    for repeat in range(args.repeats):
        for i, layout in enumerate(args.layouts):
            got = run_layout(layout, out / f"r{repeat}-{i}", args.steps, args.overrides)
            results[layout].append(got)
            print(f"repeat {repeat} {layout}: {got['samples_per_s']:.0f} samples/s, step {got['step_s']:.3f} s "
                  f"(wait rollout {got['wait_rollout_s']:.3f}, train {got['train_s']:.3f}), rollout busy "
                  f"{got['rollout_utilisation']:.0%}, train busy {got['train_utilisation']:.0%}", flush=True)

    base = mean(r["samples_per_s"] for r in results[args.layouts[0]])
    lines = [f"machine: {machine()}, {args.steps} steps, {args.repeats} repeats in rotation", "",
             "| layout | samples/s (mean ± SE) | vs first | step s | waiting for rollouts s | training s | "
             "publish s | rollout busy | train busy |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for layout, runs in results.items():
        sps, se = mean_se([r["samples_per_s"] for r in runs])
        avg = {k: mean(r[k] for r in runs) for k in runs[0]}
        lines.append(f"| {layout} | {sps:.0f} ± {se:.0f} | {sps / base:.2f}x | {avg['step_s']:.3f} | "
                     f"{avg['wait_rollout_s']:.3f} | {avg['train_s']:.3f} | {avg['sync_s']:.3f} | "
                     f"{avg['rollout_utilisation']:.0%} | {avg['train_utilisation']:.0%} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps({"machine": machine(), "steps": args.steps, "results": results},
                                                 indent=1))  # fmt: skip
    (out / "scaling.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
