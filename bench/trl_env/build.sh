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
# Idempotent: a stamp in the venv holds a hash of this folder; when it matches and the import check passes,
# nothing is installed. Otherwise the steps run again on the existing venv (pip skips what is satisfied).
# Environment: PYTHON (default python3, >= 3.10), TRL_VENV (default <repo>/.venv-trl).
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${TRL_VENV:-$ROOT/.venv-trl}
PYTHON=${PYTHON:-python3}
TRL_VERSION=1.16.0
TORCH_VERSION=2.13.0
START=$(date +%s)
STEP="start"

log() { echo "[trl-env +$(( $(date +%s) - START ))s] $*"; }
fail() {
    if [ -s "${PIPLOG:-}" ]; then
        echo "[trl-env] last lines of $PIPLOG:" >&2
        tail -n 40 "$PIPLOG" >&2
    fi
    echo "[trl-env] FAILED at step '$STEP' after $(( $(date +%s) - START )) s: $*" >&2
    echo "[trl-env] fix the cause above and re-run: bash bench/trl_env/build.sh" >&2
    echo "[trl-env] (to start from scratch: rm -rf $VENV)" >&2
    exit 1
}
trap 'fail "command exited with status $?: $BASH_COMMAND"' ERR

export OMP_NUM_THREADS=1
PY=$VENV/bin/python
PIPLOG=""
# pip's output goes to a log, printed on failure.
pip_install() { "$PY" -m pip install --disable-pip-version-check "$@" >>"$PIPLOG" 2>&1; }
STAMP=$VENV/.trustbatch-trl-env
HASH=$(cd "$HERE" && find . -type f \( -name '*.txt' -o -name '*.sh' \) | LC_ALL=C sort | xargs sha256sum \
    | sha256sum | cut -c1-16)

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

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ] && [ -x "$PY" ]; then
    STEP="check of the existing environment"
    if check_imports; then
        log "$VENV is up to date (stamp $HASH); nothing to do"
        exit 0
    fi
    log "the import check failed on an up-to-date stamp: reinstalling"
fi

STEP="create the venv"
command -v "$PYTHON" >/dev/null || fail "no '$PYTHON' on PATH; set PYTHON=/path/to/python3.11"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || fail "$PYTHON is older than 3.10"
if [ ! -x "$PY" ]; then
    log "python -m venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
rm -f "$STAMP"
PIPLOG=$VENV/trustbatch-build.log
: > "$PIPLOG"

STEP="install torch==$TORCH_VERSION (CPU)"
log "pip install torch==$TORCH_VERSION"
pip_install "torch==$TORCH_VERSION"
"$PY" -W ignore -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
    || fail "pip did not install torch $TORCH_VERSION"

STEP="install trl==$TRL_VERSION and the rest (requirements.txt, torch==$TORCH_VERSION kept)"
log "pip install -r requirements.txt -c <(torch==$TORCH_VERSION)"
pip_install -r "$HERE/requirements.txt" -c <(echo "torch==$TORCH_VERSION")

STEP="import check"
log "import check"
PIPLOG=""
check_imports

echo "$HASH" > "$STAMP"
log "done: $VENV ($(du -sh "$VENV" | cut -f1)) in $(( $(date +%s) - START )) s"
