#!/usr/bin/env bash
# On a CUDA machine: one venv with real SGLang 0.5.23 (it brings its CUDA torch 2.14.1 and transformers 5.19.0,
# which trustbatch's own ranges accept) plus trustbatch, then the GPU tests: tests/gpu/test_sglang_gpu.py
# (generate + logprobs, update from disk, update over NCCL with 2+ GPUs), tests/gpu/test_cuda_step.py and
# tests/gpu/test_hub_model_gpu.py (configs/qwen2.5-0.5b-gsm8k.yaml: smoke steps, serve, eval; it needs the model
# locally: TRUSTBATCH_QWEN_DIR=<HF dir>, or Qwen/Qwen2.5-0.5B-Instruct in the hub cache; GSM8K_DIR optional).
# Without the CPU shims of tests/sglang/cpu_env: sgl_kernel, flashinfer and NCCL are the real ones.
#
#   bash tests/gpu/run_sglang_gpu.sh [extra pytest args]
#
# Needs: an NVIDIA driver for CUDA 13 (SGLang 0.5.23's kernels), python3 >= 3.10, network access to PyPI.
# Expected time: venv + pip about 3-6 min (several GB of CUDA wheels), tests about 2 min.
# Environment: VENV (default .venv-sglang-gpu), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
VENV=${VENV:-.venv-sglang-gpu}
PYTHON=${PYTHON:-python3}
log() { echo "[sglang-gpu +$(( $(date +%s) - START ))s] $*"; }

command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this script is for a CUDA machine" >&2; exit 1; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader

[ -x "$VENV/bin/python" ] || { log "python -m venv $VENV"; "$PYTHON" -m venv "$VENV"; }
log "pip install sglang==0.5.23 (with its CUDA requirements)"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "sglang==0.5.23"
log "pip install -e .[dev] (keeps SGLang's torch and transformers: they satisfy trustbatch's ranges)"
"$VENV/bin/python" -m pip install -q -e '.[dev]'
"$VENV/bin/python" - <<'PY'
import torch, sglang, transformers
assert torch.cuda.is_available(), "torch in this venv sees no CUDA device"
print(f"torch {torch.__version__} ({torch.cuda.device_count()} GPU), sglang {sglang.__version__}, "
      f"transformers {transformers.__version__}")
PY

log "pytest tests/gpu"
export TRUSTBATCH_SGLANG_PYTHON="$PWD/$VENV/bin/python"
status=0
"$VENV/bin/python" -m pytest -q -rs -s tests/gpu "$@" || status=$?
log "done (pytest exit $status)"
exit $status
