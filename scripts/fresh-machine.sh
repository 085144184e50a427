#!/usr/bin/env bash
# The README's two commands on a fresh machine, from a clean clone of HEAD:
#   scripts/fresh-machine.sh            in a bare Debian bookworm container that has only Python 3.11
#                                       (no uv, no pip packages, no compiler), as a user who is not root
#   scripts/fresh-machine.sh --host     on this machine, with an empty HOME and only the system's PATH
#                                       (/usr/sbin:/usr/bin:/sbin:/bin): nothing installed by hand is seen
# Runs `./uvw run dflash demo`, then `./uvw run pytest`; exits non-zero when either fails. Logs and the
# timing of each command go to $DFLASH_FRESH_LOGS (default runs/fresh-machine/). uv's download cache is
# kept between runs ($DFLASH_DOCKER_STATE/uv-cache in the container, ~/.cache/uv on the host): packages
# come from uv.lock either way, and the checkout, .tools/, .venv/ and ~/.cache/dflash are new every run.
set -euo pipefail
cd "$(dirname "$0")/.."

script_name=fresh-machine
mode=container
case "${1:-}" in
    --host) mode=host ;;
    "") ;;
    *)
        echo "usage: scripts/fresh-machine.sh [--host]" >&2
        exit 2
        ;;
esac

logs=$(realpath -m "${DFLASH_FRESH_LOGS:-runs/fresh-machine}")
work=$(mktemp -d "${TMPDIR:-/tmp}/dflash-fresh.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$logs" "$work/home"
git clone --quiet "$PWD" "$work/clone"
readme_commands=$(grep -E '^\./uvw run ' README.md | sed 's/ *#.*//')
[[ $(wc -l <<<"$readme_commands") -eq 2 ]] || {
    echo "fresh-machine: error: README.md should hold exactly two ./uvw run commands, found:" >&2
    echo "$readme_commands" >&2
    exit 1
}

# The machine's own CA bundle, where it sets one: how this network reaches PyPI, not a project dependency.
ca=${SSL_CERT_FILE:-}

# run_commands CLONE PREFIX...: each README command in CLONE through PREFIX (which takes a shell command
# line as its last argument), timed and logged; returns the last failure.
run_commands() {
    local clone=$1 status=0 number=0 started
    shift
    while IFS= read -r command; do
        number=$((number + 1))
        started=$SECONDS
        printf 'fresh-machine: %s\n' "$command" >&2
        if "$@" "cd $clone && $command" >"$logs/command-$number.log" 2>&1; then
            printf 'fresh-machine: ok in %d s: %s\n' "$((SECONDS - started))" "$command" >&2
        else
            status=$?
            printf 'fresh-machine: FAILED (exit %d) in %d s: %s; last lines of %s:\n' \
                "$status" "$((SECONDS - started))" "$command" "$logs/command-$number.log" >&2
            tail -n 15 "$logs/command-$number.log" >&2
        fi
        tail -n 1 "$logs/command-$number.log" >&2
    done <<<"$readme_commands"
    return "$status"
}

if [[ "$mode" == host ]]; then
    mkdir -p "$HOME/.cache/uv"
    # An empty home outside /tmp, as a real machine's is: the compile cache refuses kernel dirs under
    # /tmp (cleanups delete them), so a home there fails checks that a fresh machine passes.
    home=$(mktemp -d "$HOME/.cache/dflash-fresh-home.XXXXXX")
    trap 'rm -rf "$work" "$home"' EXIT
    host_env=(env -i "HOME=$home" "PATH=/usr/sbin:/usr/bin:/sbin:/bin" "UV_CACHE_DIR=$HOME/.cache/uv" CI=true)
    [[ -n "$ca" ]] && host_env+=("SSL_CERT_FILE=$ca" "PIP_CERT=$ca")
    run_commands "$work/clone" "${host_env[@]}" sh -c
    exit $?
fi

# shellcheck source=scripts/docker-engine.sh
source scripts/docker-engine.sh
use_engine
trap 'stop_engine; rm -rf "$work"' EXIT # use_engine's own trap stops only the engine it started
make_base_image
mkdir -p "$state/uv-cache"
chown -R 1000:1000 "$work" "$state/uv-cache"
container=(docker run --rm --network host --user 1000:1000 -e HOME=/work/home -e USER=dev -e CI=true
    -e UV_CACHE_DIR=/uv-cache -v "$work:/work" -v "$state/uv-cache:/uv-cache")
if [[ -n "$ca" ]]; then
    container+=(-v "$ca:/etc/ssl/certs/ca-certificates.crt:ro" -e SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
        -e PIP_CERT=/etc/ssl/certs/ca-certificates.crt)
fi
run_commands /work/clone "${container[@]}" "$base_image" sh -c
