"""`trustbatch launch`: torchrun for a trustbatch command, with one message when the nodes never meet.

    trustbatch launch --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 \\
        --rdzv_id=my-run --rdzv_conf=join_timeout=300 train configs/quickstart.yaml run.dir=/shared/runs/my-run

Everything before the trustbatch command (`train`, `sft`, ...) is torchrun's own (``torch.distributed.run``, the
same flags and defaults); the command runs as ``python -m app.cli <command> ...`` in every process. The one thing
added: when the rendezvous fails (the other nodes never came within ``join_timeout``, or the endpoint cannot be
reached) torchrun raises a ``RendezvousError`` with a long traceback that names neither this node nor the fix.
Here it ends with one message that names both, and exit code 2. Everything else (a failed rank, a signal) is
torchrun's as it is.
"""

from __future__ import annotations

import socket
import sys

FIX = (
    "start the same command on every one of the {nnodes} node(s) within the join timeout ({timeout}; "
    "--rdzv_conf=join_timeout=S, torchrun's default 600 s), with the same --rdzv_endpoint, --rdzv_id and "
    "--nnodes; check that {endpoint} is reachable from this host (the head node's port open to every node: "
    "docs/cluster.md, 'Ports')"
)


def rendezvous_message(args, exc: BaseException) -> str:
    """The one message for a rendezvous that failed on this node."""
    conf = dict(item.split("=", 1) for item in (args.rdzv_conf or "").split(",") if "=" in item)
    timeout = f"{conf['join_timeout']} s" if "join_timeout" in conf else "600 s, torchrun's default"
    fix = FIX.format(nnodes=args.nnodes, timeout=timeout, endpoint=args.rdzv_endpoint or "the rendezvous endpoint")
    return (
        f"node {socket.gethostname()} (--node_rank={args.node_rank}) never met the other nodes at rendezvous "
        f"{args.rdzv_endpoint!r} (backend {args.rdzv_backend}, id {args.rdzv_id!r}, --nnodes={args.nnodes}): "
        f"{type(exc).__name__}{': ' + str(exc).strip() if str(exc).strip() else ''}.\nFix: {fix}."
    )


def main(argv: list[str]) -> int:
    """Run ``torchrun <argv>`` with the trustbatch command in ``argv`` as ``-m app.cli``; returns the exit code."""
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    args = parse_args(argv)
    if args.module or args.no_python:
        print("error: trustbatch launch runs a trustbatch command (train, sft, ...); drop -m / --no-python",
              file=sys.stderr)  # fmt: skip
        return 2
    # torchrun took the trustbatch command for its script: run it as `python -m app.cli <command> <args>`.
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script, args.module = "app.cli", True
    try:
        run(args)
    except RendezvousError as exc:
        print(f"error: {rendezvous_message(args, exc)}", file=sys.stderr)
        return 2
    return 0
