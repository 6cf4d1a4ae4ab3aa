#!/usr/bin/env bash
# Prepare a fresh Debian machine (run as root) for the sandbox tests: bubblewrap, a system python3 for it,
# a Docker engine and the sandbox image. Idempotent: a second run only checks. Docker is best effort: when the
# engine cannot start, this prints why and exits 0, and the docker tests skip with a reason. bubblewrap is not:
# without a working bwrap there is no sandbox at all, so that fails the job.
#
#   SANDBOX_IMAGE   image tag to build (default trustbatch-sandbox:py3.11, sandbox.docker_image's default)
#   SANDBOX_GVISOR  1 to also install runsc and register it as a Docker runtime named runsc
set -uo pipefail

START=$(date +%s)
IMAGE=${SANDBOX_IMAGE:-trustbatch-sandbox:py3.11}
HERE=$(cd "$(dirname "$0")/.." && pwd)
log() { echo "[setup-sandbox +$(( $(date +%s) - START ))s] $*"; }

need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
[ -x /usr/bin/python3 ] || need+=(python3)
command -v prlimit >/dev/null || need+=(util-linux)
command -v dockerd >/dev/null || need+=(docker.io)
if [ "${SANDBOX_GVISOR:-0}" = 1 ] && ! command -v runsc >/dev/null; then need+=(runsc); fi
if [ ${#need[@]} -gt 0 ]; then
    log "apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
        || log "apt-get install failed for some of: ${need[*]}"
fi

# --- bubblewrap: must work as an unprivileged uid (user namespaces must be allowed) -------------------------
bwrap_ok() {
    setpriv --reuid=65534 --regid=65534 --clear-groups -- \
        bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session --as-pid-1 \
        --ro-bind /usr /usr --symlink usr/lib /lib --symlink usr/lib64 /lib64 --symlink usr/bin /bin \
        --proc /proc --dev /dev --tmpfs /tmp /usr/bin/python3 -c 'print("ok")' 2>&1
}
if ! out=$(bwrap_ok); then
    log "bwrap failed as uid 65534 ($out); allowing unprivileged user namespaces"
    [ -e /proc/sys/kernel/unprivileged_userns_clone ] && sysctl -qw kernel.unprivileged_userns_clone=1
    [ -e /proc/sys/kernel/apparmor_restrict_unprivileged_userns ] && sysctl -qw kernel.apparmor_restrict_unprivileged_userns=0
    [ "$(cat /proc/sys/user/max_user_namespaces 2>/dev/null || echo 1)" = 0 ] && sysctl -qw user.max_user_namespaces=10000
    out=$(bwrap_ok) || { log "FATAL: bubblewrap does not work here: $out"; exit 1; }
fi
log "bwrap OK ($(bwrap --version))"

# --- Docker engine (best effort) ------------------------------------------------------------------------------
docker_ok() { timeout 10 docker info >/dev/null 2>&1; }
if [ "${SANDBOX_GVISOR:-0}" = 1 ] && command -v runsc >/dev/null && ! grep -q runsc /etc/docker/daemon.json 2>/dev/null; then
    mkdir -p /etc/docker
    # --network=none: the sandbox never has a network, and gVisor's netstack then stays out of the picture.
    echo '{"runtimes": {"runsc": {"path": "'"$(command -v runsc)"'", "runtimeArgs": ["--network=none"]}}}' >/etc/docker/daemon.json
    docker_ok && [ -s /var/run/docker.pid ] && { log "restarting dockerd for the runsc runtime"; kill "$(cat /var/run/docker.pid)"; sleep 3; }
fi
if ! command -v docker >/dev/null; then
    log "SKIP docker: no docker CLI after apt-get install docker.io; docker tests will skip"
    exit 0
fi
if ! docker_ok; then
    if ! command -v dockerd >/dev/null; then
        log "SKIP docker: no engine answers and dockerd is not installed; docker tests will skip"
        exit 0
    fi
    log "starting dockerd (log: /var/log/dockerd.log)"
    nohup dockerd >/var/log/dockerd.log 2>&1 &
    for _ in $(seq 1 30); do docker_ok && break; sleep 1; done
fi
if ! docker_ok; then
    log "SKIP docker: dockerd did not answer within 30 s; docker tests will skip. Last log lines:"
    tail -n 15 /var/log/dockerd.log 2>/dev/null
    exit 0
fi
log "docker engine OK ($(docker version --format '{{.Server.Version}}' 2>/dev/null))"

# --- The sandbox image ----------------------------------------------------------------------------------------
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    log "image $IMAGE already present"
elif timeout 20 docker pull -q debian:bookworm-slim >/dev/null 2>&1; then
    log "registry reachable: docker build $IMAGE from sandbox/Dockerfile"
    docker build -q -t "$IMAGE" -f "$HERE/sandbox/Dockerfile" "$HERE/sandbox" >/dev/null \
        || log "docker build failed"
fi
if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
    log "no registry: docker import $IMAGE from a rootfs of this host's /usr/bin/python3"
    /usr/bin/python3 "$HERE/sandbox/image.py" --import "$IMAGE" || log "docker import failed"
fi
if out=$(timeout 60 docker run --rm --network none --read-only --user 65534:65534 "$IMAGE" \
        python3 -c 'import sys; print(sys.version.split()[0])' 2>&1); then
    log "image $IMAGE OK (python $out)"
else
    log "SKIP docker: image $IMAGE does not run ($out); docker tests will skip"
fi
log "done in $(( $(date +%s) - START )) s"
exit 0
