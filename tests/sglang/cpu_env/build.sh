#!/usr/bin/env bash
# Build .venv-sglang at the repo root: real SGLang 0.5.23 serving on CPU, for tests/sglang/ and
# bench/rollout_engines.py. Never the project's own .venv (SGLang pins its own transformers).
#
#   bash tests/sglang/cpu_env/build.sh        (or: make sglang-env)
#
# Recipe: a venv; torch==2.13.0 first (the local CPU build); sglang==0.5.23
# with --no-deps (its declared requirements pin torch==2.14.1 with CUDA and CUDA kernels); the packages it
# imports on the CPU path (requirements.txt) pinned by constraints.txt (torch==2.13.0 among them, so pip fails
# rather than replace it); then shims/ (stand-ins for sgl_kernel and torchvision) on the venv's sys.path via a
# .pth file; then an import check of SGLang's HTTP server module.
#
# Idempotent (tests/venv_lib.sh): a stamp in the venv holds a hash of this folder; when it matches and the import check passes,
# nothing is installed. Otherwise the steps run again on the existing venv (pip skips what is satisfied).
# Environment: PYTHON (default python3, >= 3.11), SGLANG_VENV (default <repo>/.venv-sglang).
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
VENV=${SGLANG_VENV:-$ROOT/.venv-sglang}
PYTHON=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
NAME=sglang-env
REBUILD="bash tests/sglang/cpu_env/build.sh"
# pip_install writes to a log (printed on failure): with --no-deps sglang it always lists sglang's CUDA
# requirements as "not installed", which is expected here.
# shellcheck source=../../venv_lib.sh
source "$ROOT/tests/venv_lib.sh"
venv_begin

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
for module in ("sglang.srt.entrypoints.http_server", "sglang.srt.models.qwen2", "sglang.launch_server",
               "sglang_router.launch_router"):
    importlib.import_module(module)
print(f"imports ok: torch {torch.__version__}, sglang {sglang.__version__}")
EOF
}

venv_up_to_date && exit 0
venv_create_with_torch

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

venv_finish
