# shellcheck shell=bash
# The Docker engine and the local base image, shared by scripts/image-smoke.sh and scripts/fresh-machine.sh.
# Source it after setting script_name; then call use_engine (and make_base_image where a base is needed).
#
# Uses the engine that DOCKER_HOST (or the default socket) points at when one answers, as on CI runners
# with Docker. Otherwise, as root: installs Debian's docker.io and debootstrap when missing, starts a
# private dockerd (its own socket; data root outside the checkout, in $DFLASH_DOCKER_STATE, so the layer
# cache survives between runs) and stops it on exit. Makes the CPU base image ($DFLASH_BASE_IMAGE,
# default local/bookworm-python:base: Debian bookworm with only Python 3.11) with debootstrap when the
# engine lacks it (any other base name is pulled): no registry is needed here.

script_name=${script_name:-dflash}
state=${DFLASH_DOCKER_STATE:-/var/lib/dflash-docker}
run_dir=${DFLASH_DOCKER_RUN:-/run/dflash-docker}
base_image=${DFLASH_BASE_IMAGE:-local/bookworm-python:base}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
engine_pid=

say() {
    printf '%s: %s\n' "$script_name" "$*" >&2
}

die() {
    printf '%s: error: %s\n' "$script_name" "$*" >&2
    exit 1
}

engine_answers() {
    docker info >/dev/null 2>&1
}

# need PACKAGE COMMAND: apt-get install PACKAGE unless COMMAND is already there.
need() {
    command -v "$2" >/dev/null && return
    [[ $(id -u) -eq 0 ]] || die "$2 is missing; install $1 (apt-get install $1) or run as root"
    say "installing $1"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1" >/dev/null
}

# shellcheck disable=SC2329 # the EXIT trap calls it
stop_engine() {
    if [[ -n "$engine_pid" ]]; then
        say "stopping dockerd (pid $engine_pid)"
        kill "$engine_pid" 2>/dev/null || true
        wait "$engine_pid" 2>/dev/null || true
    fi
}

start_engine() {
    export DOCKER_HOST="unix://$run_dir/docker.sock"
    if engine_answers; then
        say "using the running private engine at $DOCKER_HOST"
        return
    fi
    [[ $(id -u) -eq 0 ]] || die "no Docker engine answers and starting one needs root"
    need docker.io dockerd
    mkdir -p "$state/data" "$run_dir"
    say "starting dockerd (data root $state/data, log $state/dockerd.log)"
    # No bridge network where this runs: containers use the host network (compose: network_mode: host).
    dockerd --host "$DOCKER_HOST" --data-root "$state/data" --exec-root "$run_dir/exec" \
        --pidfile "$run_dir/dockerd.pid" --iptables=false --ip6tables=false --bridge=none \
        --storage-driver=overlay2 >>"$state/dockerd.log" 2>&1 &
    engine_pid=$!
    trap stop_engine EXIT
    for _ in $(seq 60); do
        engine_answers && return
        kill -0 "$engine_pid" 2>/dev/null || break
        sleep 1
    done
    tail -20 "$state/dockerd.log" >&2
    die "dockerd did not come up (log above)"
}

make_base_image() {
    docker image inspect "$base_image" >/dev/null 2>&1 && return
    if [[ "$base_image" != local/* ]]; then
        docker pull "$base_image"
        return
    fi
    need debootstrap debootstrap
    local work
    work=$(mktemp -d "$state/rootfs.XXXXXX")
    say "making $base_image with debootstrap from $mirror (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm \
        "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
        {
            tail -20 "$work/debootstrap.log" >&2
            die "debootstrap failed (log above)"
        }
    tar -C "$work/rootfs" -c . | docker import - "$base_image" >/dev/null
    rm -rf "$work"
}

# use_engine: a Docker engine answers DOCKER_HOST when this returns (started here if needed).
use_engine() {
    need docker.io docker
    if engine_answers; then
        say "using the engine at ${DOCKER_HOST:-the default socket}"
    else
        mkdir -p "$state"
        start_engine
    fi
}
