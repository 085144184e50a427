#!/usr/bin/env bash
# Make the image's default base, local/bookworm-python:base (Debian bookworm + Python 3.11), with
# debootstrap from Debian's archive, in the engine DOCKER_HOST points at (else a private one started
# here, as root): `docker build .` needs nothing else, no container registry.  (`just base-image`)
set -euo pipefail
cd "$(dirname "$0")/.."

script_name=base-image
# shellcheck source=scripts/docker-engine.sh
source scripts/docker-engine.sh

use_engine
make_base_image
say "$base_image is in the engine at ${DOCKER_HOST:-the default socket}"
