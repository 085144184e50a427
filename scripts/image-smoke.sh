#!/usr/bin/env bash
# Build the CPU variant of the image and run the image tests against a real Docker engine:
#   scripts/image-smoke.sh [pytest args ...]          (`just image-smoke`)
#   FAST_KERNELS=1 scripts/image-smoke.sh [...]       the GPU variant's tests instead (marker gpu_image):
#                                                     no GPU needed, but the CUDA 12.8 bases must be
#                                                     pullable or in the engine (DFLASH_GPU_BASE_IMAGE)
# The engine and the base image: scripts/docker-engine.sh (installs and starts them where needed, as root).
set -euo pipefail
cd "$(dirname "$0")/.."

script_name=image-smoke
# shellcheck source=scripts/docker-engine.sh
source scripts/docker-engine.sh

# Bad input is a usage error (exit 2), before an engine is started.
case ${FAST_KERNELS:-0} in
0) selection="image and not gpu_image" ;;
1) selection="image and gpu_image" ;;
*)
    say "error: FAST_KERNELS must be 0 (the CPU variant) or 1 (the GPU variant), not '$FAST_KERNELS'"
    exit 2
    ;;
esac

use_engine
docker-compose version >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || need docker-compose docker-compose
make_base_image

started=$SECONDS
status=0
DFLASH_BASE_IMAGE="$base_image" ./uvw run pytest -m "$selection" tests/image "$@" || status=$?
say "image tests finished in $((SECONDS - started)) s (exit $status)"
exit "$status"
