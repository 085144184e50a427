#!/usr/bin/env bash
# Build the CPU variant of the image and run the image tests against a real Docker engine:
#   scripts/image-smoke.sh [pytest args ...]          (`just image-smoke`)
# The engine and the base image: scripts/docker-engine.sh (installs and starts them where needed, as root).
set -euo pipefail
cd "$(dirname "$0")/.."

script_name=image-smoke
# shellcheck source=scripts/docker-engine.sh
source scripts/docker-engine.sh

use_engine
docker-compose version >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || need docker-compose docker-compose
make_base_image

started=$SECONDS
status=0
DFLASH_BASE_IMAGE="$base_image" ./uvw run pytest -m image tests/image "$@" || status=$?
say "image tests finished in $((SECONDS - started)) s (exit $status)"
exit "$status"
