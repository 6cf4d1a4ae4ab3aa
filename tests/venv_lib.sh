# Sourced by the builders of the side virtualenvs that must never touch the project's own .venv:
# tests/sglang/cpu_env/build.sh (real SGLang on CPU) and bench/trl_env/build.sh (TRL for bench/vs_trl.py).
# It holds what both do the same way: logging, the failure report (the step, the end of pip's log, how to
# re-run), the stamp that makes a build idempotent, creating the venv and installing the local CPU torch first.
#
# The caller sets NAME (the log tag), HERE (its folder: its *.py, *.txt and *.sh files are hashed into the
# stamp, with this file), VENV, PYTHON, TORCH_VERSION and REBUILD (the command that re-runs it), defines
# check_imports, then calls: venv_begin; venv_up_to_date && exit 0; venv_create_with_torch; <its own pip
# steps, through pip_install>; venv_finish.

LIB_FILE=${BASH_SOURCE[0]}

log() { echo "[$NAME +$(( $(date +%s) - START ))s] $*"; }

fail() {
    if [ -s "${PIPLOG:-}" ]; then
        echo "[$NAME] last lines of $PIPLOG:" >&2
        grep -v "WARNING: Location" "$PIPLOG" | tail -n 40 >&2
    fi
    echo "[$NAME] FAILED at step '$STEP' after $(( $(date +%s) - START )) s: $*" >&2
    echo "[$NAME] fix the cause above and re-run: $REBUILD" >&2
    echo "[$NAME] (to start from scratch: rm -rf $VENV)" >&2
    exit 1
}

# pip's output goes to a log, printed by fail().
pip_install() { "$PY" -m pip install --disable-pip-version-check "$@" >>"$PIPLOG" 2>&1; }

venv_begin() {
    START=$(date +%s)
    STEP="start"
    trap 'fail "command exited with status $?: $BASH_COMMAND"' ERR
    export OMP_NUM_THREADS=1
    PY=$VENV/bin/python
    PIPLOG=""
    STAMP=$VENV/.trustbatch-$NAME
    HASH=$( { (cd "$HERE" && find . -type f \( -name '*.py' -o -name '*.txt' -o -name '*.sh' \) \
        -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum); sha256sum < "$LIB_FILE"; } \
        | sha256sum | cut -c1-16)
}

# True when the stamp matches this recipe and the import check passes: nothing to install.
venv_up_to_date() {
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ] && [ -x "$PY" ]; then
        STEP="check of the existing environment"
        if check_imports; then
            log "$VENV is up to date (stamp $HASH); nothing to do"
            return 0
        fi
        log "the import check failed on an up-to-date stamp: reinstalling"
    fi
    return 1
}

# The venv (kept if it exists: pip skips what is satisfied), then torch==$TORCH_VERSION, the local CPU build,
# before anything that could pull a multi-GB CUDA build.
venv_create_with_torch() {
    STEP="create the venv"
    command -v "$PYTHON" >/dev/null || fail "no '$PYTHON' on PATH; set PYTHON=/path/to/python3.11"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || fail "$PYTHON is older than 3.11"
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
}

venv_finish() {
    STEP="import check"
    log "import check"
    PIPLOG=""
    check_imports
    echo "$HASH" > "$STAMP"
    log "done: $VENV ($(du -sh "$VENV" | cut -f1)) in $(( $(date +%s) - START )) s"
}
