#!/usr/bin/env bash
# Build the CPU variant of the image and run the image tests against a real Docker engine:
#   scripts/image-smoke.sh [pytest args ...]          (`just image-smoke`)
#   FAST_KERNELS=1 scripts/image-smoke.sh [...]       the default (GPU) image's tests instead (marker
#                                                     gpu_image): no GPU and no CUDA base needed
# The engine and the base image: scripts/docker-engine.sh (installs and starts them where needed, as root).
set -euo pipefail
cd "$(dirname "$0")/.."

script_name=image-smoke
# shellcheck source=scripts/docker-engine.sh
source scripts/docker-engine.sh

# Bad input is a usage error (exit 2), before an engine is started.
case ${FAST_KERNELS:-0} in
0) selection="image and not gpu_image" variant=cpu ;;
1) selection="image and gpu_image" variant=gpu ;;
*)
    say "error: FAST_KERNELS must be 0 (the CPU variant) or 1 (the GPU variant), not '$FAST_KERNELS'"
    exit 2
    ;;
esac

use_engine
docker-compose version >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || need docker-compose docker-compose
make_base_image

# The build runs here, not in a test's setup: from a cold cache it takes longer than pytest's per-test
# timeout on 2 cores. The tests' own builds of the same image then only hit BuildKit's cache.
started=$SECONDS
DFLASH_BASE_IMAGE="$base_image" ./uvw run python tests/image/harness.py "$variant"
say "$variant image built in $((SECONDS - started)) s"

started=$SECONDS
status=0
DFLASH_BASE_IMAGE="$base_image" ./uvw run pytest -m "$selection" tests/image "$@" || status=$?
say "image tests finished in $((SECONDS - started)) s (exit $status)"
exit "$status"
