#!/usr/bin/env bash
# Make a Docker engine reachable for Libra's sandboxes, idempotently.
#
# - If `docker info` already works, the engine is left alone.
# - Otherwise, as root: install docker.io from the configured Debian mirror when dockerd is
#   missing, then start dockerd in the background with settings that work inside CI
#   containers and VMs without a bridge (vfs storage, no iptables, no default bridge; sandboxes
#   run with network "none" anyway), and wait until `docker info` answers.
# - As root it also installs bubblewrap (the no-Docker sandbox) and debootstrap (to build the
#   sandbox images without a registry) when they are missing.
#
# Environment:
#   LIBRA_DOCKERD_LOG             dockerd's log file (default /var/log/libra-dockerd.log)
#   LIBRA_DOCKER_STORAGE_DRIVER   storage driver (default vfs; overlay2 is faster where it works)
#   LIBRA_DOCKER_WAIT_S           how long to wait for the engine (default 60)
set -euo pipefail

log() { echo "ensure-docker: $*" >&2; }

is_root() { [ "$(id -u)" -eq 0 ]; }

apt_updated=0
apt_install() {
    # Install the named Debian packages; `apt-get update` runs at most once per call of the script.
    if [ "$apt_updated" -eq 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
        apt_updated=1
    fi
    log "installing $*"
    NEEDRESTART_SUSPEND=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null
}

ensure_sandbox_tools() {
    local missing=()
    command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
    command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    if [ "${#missing[@]}" -eq 0 ]; then
        return 0
    fi
    if ! is_root; then
        log "missing ${missing[*]}; run as root or: sudo apt-get install -y ${missing[*]}"
        return 0
    fi
    if command -v apt-get >/dev/null 2>&1; then
        apt_install "${missing[@]}"
    else
        log "missing ${missing[*]} and no apt-get here; install them with your package manager"
    fi
}

docker_works() { docker info >/dev/null 2>&1; }

wait_for_docker() {
    local deadline=$((SECONDS + ${LIBRA_DOCKER_WAIT_S:-60}))
    until docker_works; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            return 1
        fi
        sleep 0.5
    done
}

start_dockerd() {
    local log_file="${LIBRA_DOCKERD_LOG:-/var/log/libra-dockerd.log}"
    local driver="${LIBRA_DOCKER_STORAGE_DRIVER:-vfs}"
    mkdir -p "$(dirname "$log_file")"
    log "starting dockerd (storage driver $driver), log in $log_file"
    # setsid + nohup: the engine must outlive this script and the shell of the caller (make).
    setsid nohup dockerd --storage-driver="$driver" --iptables=false --bridge=none \
        >>"$log_file" 2>&1 </dev/null &
    if ! wait_for_docker; then
        log "dockerd did not answer within ${LIBRA_DOCKER_WAIT_S:-60}s; last lines of $log_file:"
        tail -n 20 "$log_file" >&2 || true
        exit 1
    fi
}

main() {
    ensure_sandbox_tools
    if docker_works; then
        return 0
    fi
    if ! is_root; then
        log "no Docker engine is reachable and this is not root: start dockerd yourself," \
            "or run this script as root (Libra's bwrap sandbox works without Docker)"
        exit 1
    fi
    if ! command -v dockerd >/dev/null 2>&1; then
        command -v apt-get >/dev/null 2>&1 || { log "no dockerd and no apt-get"; exit 1; }
        apt_install docker.io
    fi
    # The CLI may come from a separate package (or a static binary); docker.io provides one.
    command -v docker >/dev/null 2>&1 || apt_install docker.io
    # A previous engine may be starting right now (e.g. two test runs); give it a moment first.
    if pgrep -x dockerd >/dev/null 2>&1; then
        log "dockerd is running but not answering yet; waiting"
        wait_for_docker && return 0
        log "the running dockerd never answered; see its log"
        exit 1
    fi
    start_dockerd
    log "Docker engine ready"
}

main "$@"
