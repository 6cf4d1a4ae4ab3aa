#!/usr/bin/env bash
# Build .venv-sglang at the repo root: real SGLang 0.5.23 serving on CPU, for tests/sglang/ and
# bench/rollout_engines.py. Never the project's own .venv (SGLang pins its own transformers).
#
#   bash tests/sglang/cpu_env/build.sh        (or: make sglang-env)
#
# Recipe (shared/reference/sglang-cpu.md): a venv; torch==2.13.0 first (the local CPU build); sglang==0.5.23
# with --no-deps (its declared requirements pin torch==2.14.1 with CUDA and CUDA kernels); the packages it
# imports on the CPU path (requirements.txt) pinned by constraints.txt (torch==2.13.0 among them, so pip fails
# rather than replace it); then shims/ (stand-ins for sgl_kernel and torchvision) on the venv's sys.path via a
# .pth file; then an import check of SGLang's HTTP server module.
#
# Idempotent: a stamp in the venv holds a hash of this folder; when it matches and the import check passes,
# nothing is installed. Otherwise the steps run again on the existing venv (pip skips what is satisfied).
# Environment: PYTHON (default python3, >= 3.10), SGLANG_VENV (default <repo>/.venv-sglang).
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
VENV=${SGLANG_VENV:-$ROOT/.venv-sglang}
PYTHON=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
START=$(date +%s)
STEP="start"

log() { echo "[sglang-env +$(( $(date +%s) - START ))s] $*"; }
fail() {
    if [ -s "${PIPLOG:-}" ]; then
        echo "[sglang-env] last lines of $PIPLOG:" >&2
        grep -v "WARNING: Location" "$PIPLOG" | tail -n 40 >&2
    fi
    echo "[sglang-env] FAILED at step '$STEP' after $(( $(date +%s) - START )) s: $*" >&2
    echo "[sglang-env] fix the cause above and re-run: bash tests/sglang/cpu_env/build.sh" >&2
    echo "[sglang-env] (to start from scratch: rm -rf $VENV)" >&2
    exit 1
}
trap 'fail "command exited with status $?: $BASH_COMMAND"' ERR

export OMP_NUM_THREADS=1
PY=$VENV/bin/python
PIPLOG=""
# pip's output goes to a log (printed on failure): with --no-deps sglang it always lists sglang's CUDA
# requirements as "not installed", which is expected here.
pip_install() { "$PY" -m pip install --disable-pip-version-check "$@" >>"$PIPLOG" 2>&1; }
STAMP=$VENV/.trustbatch-sglang-env
HASH=$(cd "$HERE" && find . -type f \( -name '*.py' -o -name '*.txt' -o -name '*.sh' \) -not -path '*/__pycache__/*' \
    | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)

# What must import for the server to start; fails with the missing module's name.
check_imports() {
    "$PY" -W ignore - <<EOF
import importlib, sys
import torch
if torch.__version__.split("+")[0] != "$TORCH_VERSION":
    sys.exit(f"torch {torch.__version__} in $VENV, expected $TORCH_VERSION (the local CPU build): rm -rf $VENV and rebuild")
if torch.cuda.is_available():
    print("note: CUDA is visible; this environment still serves on CPU (the shims replace the CUDA kernels)")
import sgl_kernel, torchvision
assert getattr(sgl_kernel, "STANDIN", False) and getattr(torchvision, "STANDIN", False), "shims not first on sys.path"
import sglang
if sglang.__version__ != "$SGLANG_VERSION":
    sys.exit(f"sglang {sglang.__version__} in $VENV, expected $SGLANG_VERSION")
for module in ("sglang.srt.entrypoints.http_server", "sglang.srt.models.qwen2", "sglang.launch_server"):
    importlib.import_module(module)
print(f"imports ok: torch {torch.__version__}, sglang {sglang.__version__}")
EOF
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

STEP="install sglang==$SGLANG_VERSION --no-deps"
log "pip install --no-deps sglang==$SGLANG_VERSION"
pip_install --no-deps "sglang==$SGLANG_VERSION"

STEP="install the packages SGLang imports (requirements.txt, constraints.txt)"
log "pip install -r requirements.txt -c constraints.txt"
pip_install -r "$HERE/requirements.txt" -c "$HERE/constraints.txt"

STEP="put the shims on sys.path"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# A .pth line is appended to sys.path at start-up; no installed sgl_kernel/torchvision may shadow the shims.
for shadow in sgl_kernel torchvision; do
    [ ! -e "$SITE/$shadow" ] || fail "a real '$shadow' is installed in $SITE (pulled by a dependency?): remove it"
done
echo "$HERE/shims" > "$SITE/trustbatch_sglang_shims.pth"

STEP="import check"
log "import check"
PIPLOG=""
check_imports

echo "$HASH" > "$STAMP"
log "done: $VENV ($(du -sh "$VENV" | cut -f1)) in $(( $(date +%s) - START )) s"
