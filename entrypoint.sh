#!/usr/bin/env bash
# The image's entry point: one mode per stage, each preceded by the environment check.
#
#   entrypoint.sh train       [CONFIG] [section.field=value ...] [--resume]   torchrun, nproc from the config
#   entrypoint.sh build-cache [CONFIG] [section.field=value ...]              bake compile_cache/ on this GPU
#   entrypoint.sh datagen     [CONFIG] [section.field=value ...]              client of the SGLang server(s)
#   entrypoint.sh eval|export ARGS...                                         `dflash eval|export ARGS...`
#   entrypoint.sh doctor      [ARGS...]                                       the environment report alone
#   entrypoint.sh smoke       [OUT_DIR]                                       doctor + tiny train + export
#   entrypoint.sh shell       [COMMAND ...]                                   bash, or COMMAND
#
# CONFIG defaults to $DFLASH_CONFIG. Environment:
#   DFLASH_SKIP_DOCTOR=1       run even when `dflash doctor` says this is not the locked stack
#   DFLASH_DOCTOR_AGAINST=RUN  also diff against a recorded run's fingerprint; a breaking change stops
#   NNODES                     multi-node: the job's node count, passed to the trainer as topology.nnodes
#   RDZV_ENDPOINT=host:port, RDZV_ID               c10d rendezvous (node ranks assigned by it), or
#   MASTER_ADDR, MASTER_PORT, NODE_RANK            static rendezvous (NODE_RANK 0 at MASTER_ADDR);
#                              the same on every node but NODE_RANK; a partial or mixed set is refused
#   DFLASH_RENDEZVOUS_WAIT_S   how long a joining node waits for the endpoint to answer (default 300)
#   DFLASH_TORCHRUN_ARGS       extra torchrun arguments, e.g. "--max-restarts 2"
#   DFLASH_DRY_RUN=1           print the command that would run, after the checks, and exit
#
# Train execs torchrun, so `docker stop` (SIGTERM through tini) reaches torchrun, which passes it to every
# rank: the trainer writes its checkpoint and exits. Give it time: compose sets stop_grace_period.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() {
    printf 'entrypoint: error: %s\n' "$*" >&2
    exit 2
}

note() {
    printf 'entrypoint: %s\n' "$*" >&2
}

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

# `dflash doctor` exits 1 when this is not the locked training stack (stray or off-lock packages, torch
# that does not import) or, with --against, on a breaking difference from the recorded run.
check_environment() {
    if [[ "${DFLASH_SKIP_DOCTOR:-0}" == 1 ]]; then
        note "DFLASH_SKIP_DOCTOR=1: running without the environment check"
        return
    fi
    local status=0
    dflash doctor || status=$?
    if [[ $status -eq 0 && -n "${DFLASH_DOCTOR_AGAINST:-}" ]]; then
        dflash doctor --against "$DFLASH_DOCTOR_AGAINST" || status=$?
    fi
    if [[ $status -ne 0 ]]; then
        printf 'entrypoint: error: %s\n' "dflash doctor reported a breaking drift (above); fix the image or set DFLASH_SKIP_DOCTOR=1 to run anyway" >&2
        exit "$status"
    fi
}

# One value of the resolved config: a list one item per line, a table as JSON, null as nothing.
config_get() {
    python3 - "$resolved" "$1" <<'EOF'
import json, sys

section, _, field = sys.argv[2].partition(".")
value = json.loads(sys.argv[1])[section][field]
for item in value if isinstance(value, list) else [value]:
    if item is not None:
        print(item if isinstance(item, str) else json.dumps(item))
EOF
}

require_present() {
    local path=$1 what=$2
    [[ -e "$path" ]] ||
        die "$what $path does not exist in the container: mount it (compose: a volume onto $path; docker run: -v HOST_PATH:$path)"
}

require_writable() {
    local dir=$1 what=$2 probe
    mkdir -p "$dir" 2>/dev/null ||
        die "$what $dir cannot be created: its parent is read-only or not writable by uid $(id -u); mount a writable volume there"
    probe=$(mktemp -p "$dir" .write-probe.XXXXXX 2>/dev/null) ||
        die "$what $dir is read-only or not writable by uid $(id -u): mount it read-write (no :ro) and owned by uid $(id -u)"
    rm -f "$probe"
}

check_target() {
    local target_path
    target_path=$(config_get target.path)
    if [[ -n "$target_path" ]]; then
        require_present "$target_path" "target model (target.path)"
    fi
}

check_train_paths() {
    local path
    check_target
    while IFS= read -r path; do
        [[ -z "$path" ]] || require_present "$path" "training data (data.train_files)"
    done < <(config_get data.train_files)
    while IFS= read -r path; do
        [[ -z "$path" ]] || require_present "$path" "eval data (data.eval_files)"
    done < <(config_get data.eval_files)
    require_writable "$(config_get train.output_dir)" "checkpoint directory (train.output_dir)"
    require_writable "${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/dflash/inductor}" "inductor cache (TORCHINDUCTOR_CACHE_DIR)"
}

check_datagen_paths() {
    local path
    while IFS= read -r path; do
        [[ -z "$path" ]] || require_present "$path" "prompts (datagen.prompts)"
    done < <(config_get datagen.prompts)
    require_writable "$(config_get datagen.output_dir)" "datagen output (datagen.output_dir)"
}

# torchrun from the config's topology and this node's rendezvous variables: `dflash config torchrun`
# refuses a partial or mixed rendezvous in one line (exit 2) and waits for an endpoint another node hosts.
torchrun_command() {
    local listed
    listed=$(dflash config torchrun "$config" "${overrides[@]}")
    mapfile -t torchrun_cmd <<<"$listed"
    if [[ -n "${DFLASH_TORCHRUN_ARGS:-}" ]]; then
        local extra
        read -r -a extra <<<"$DFLASH_TORCHRUN_ARGS"
        torchrun_cmd+=("${extra[@]}")
    fi
}

launch() {
    local shown
    printf -v shown '%q ' "$@"
    note "running: ${shown% }"
    if [[ "${DFLASH_DRY_RUN:-0}" == 1 ]]; then
        exit 0
    fi
    exec "$@"
}

mode=${1:-}
[[ -n "$mode" ]] || {
    usage >&2
    exit 2
}
shift

case "$mode" in
train | build-cache | datagen)
    config=${DFLASH_CONFIG:-}
    if [[ $# -gt 0 && "$1" != -* && "$1" != *=* ]]; then
        config=$1
        shift
    fi
    [[ -n "$config" ]] || die "$mode needs a config: entrypoint.sh $mode CONFIG [section.field=value ...] (or set DFLASH_CONFIG)"
    [[ -f "$config" ]] || die "config $config not found (the image bakes configs/ in /app/configs; mount your own file to use it)"
    args=("$@")
    # NNODES from the launcher's environment is the truth for this job; the config must agree with it.
    if [[ -n "${NNODES:-}" ]]; then
        [[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES=$NNODES: expected the job's node count (1, 2, ...)"
        args+=("topology.nnodes=$NNODES")
    fi
    overrides=()
    for arg in "${args[@]}"; do
        if [[ "$arg" == *=* && "$arg" != -* ]]; then
            overrides+=("$arg")
        fi
    done
    if [[ "$mode" == train ]]; then
        torchrun_command # first: a bad rendezvous stops in a second, before the doctor or any model code loads
    fi
    # Resolved once (file + overrides + defaults): a bad config stops here with dflash's one-line error.
    resolved=$(dflash config show "$config" "${overrides[@]}" --json)
    check_environment
    case "$mode" in
    train)
        check_train_paths
        launch "${torchrun_cmd[@]}" --no-python dflash train "$config" "${args[@]}"
        ;;
    build-cache)
        check_target
        require_writable "$(config_get compile.cache_dir)" "compile cache (compile.cache_dir)"
        launch dflash build-cache "$config" "${args[@]}"
        ;;
    datagen)
        check_datagen_paths
        launch dflash datagen "$config" "${args[@]}"
        ;;
    esac
    ;;
eval | export)
    check_environment
    launch dflash "$mode" "$@"
    ;;
doctor)
    launch dflash doctor "$@"
    ;;
smoke)
    launch "$here/scripts/container-smoke.sh" "$@"
    ;;
shell)
    if [[ $# -eq 0 ]]; then
        set -- bash
    fi
    launch "$@"
    ;;
-h | --help | help)
    usage
    ;;
*)
    usage >&2
    die "unknown mode '$mode' (train, build-cache, datagen, eval, export, doctor, smoke, shell)"
    ;;
esac
