#!/usr/bin/env bash
# Build .venv-trl at the repo root: Hugging Face TRL 1.16.0 (GRPOTrainer) on CPU, for bench/vs_trl.py.
# Never the project's own .venv: TRL is a benchmark opponent, not a dependency of trustbatch.
#
#   bash bench/trl_env/build.sh
#
# Recipe: a venv; torch==2.13.0 first (the local CPU build); then requirements.txt (trl, transformers,
# accelerate, datasets, math-verify, omegaconf) with the constraint torch==2.13.0 on that pip call, so pip fails
# rather than replace the CPU build with a multi-GB CUDA one; then an import check of GRPOTrainer and of
# trustbatch's math verifier (rewards/, imported from the repo root as bench/trl_worker.py does).
#
# Idempotent (tests/venv_lib.sh): a stamp in the venv holds a hash of this folder; when it matches and the import check passes,
# nothing is installed. Otherwise the steps run again on the existing venv (pip skips what is satisfied).
# Environment: PYTHON (default python3, >= 3.11), TRL_VENV (default <repo>/.venv-trl).
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${TRL_VENV:-$ROOT/.venv-trl}
PYTHON=${PYTHON:-python3}
TRL_VERSION=1.16.0
TORCH_VERSION=2.13.0
NAME=trl-env
REBUILD="bash bench/trl_env/build.sh"
# shellcheck source=../../tests/venv_lib.sh
source "$ROOT/tests/venv_lib.sh"
venv_begin

# What bench/trl_worker.py imports; fails with the missing module's name.
check_imports() {
    "$PY" -W ignore - <<PYEOF
import sys
import torch
if torch.__version__.split("+")[0] != "$TORCH_VERSION":
    sys.exit(f"torch {torch.__version__} in $VENV, expected $TORCH_VERSION (the local CPU build): rm -rf $VENV and rebuild")
import trl
if trl.__version__ != "$TRL_VERSION":
    sys.exit(f"trl {trl.__version__} in $VENV, expected $TRL_VERSION")
from trl import GRPOConfig, GRPOTrainer  # noqa: F401
sys.path.insert(0, "$ROOT")  # the repo's rewards package, as the worker imports it
from rewards import VerifierInput, build_verifier
verify = build_verifier("math", numeric_answer=True)
assert verify(VerifierInput("2+7=", "9", "9", {})).reward == 1.0
import transformers
print(f"imports ok: torch {torch.__version__}, trl {trl.__version__}, transformers {transformers.__version__}")
PYEOF
}

venv_up_to_date && exit 0
venv_create_with_torch

STEP="install trl==$TRL_VERSION and the rest (requirements.txt, torch==$TORCH_VERSION kept)"
log "pip install -r requirements.txt -c <(torch==$TORCH_VERSION)"
pip_install -r "$HERE/requirements.txt" -c <(echo "torch==$TORCH_VERSION")

venv_finish
