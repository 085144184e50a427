"""The GPU image (FAST_KERNELS=1), checked without a GPU: the locked stack with both fast kernels, the
compiled causal-conv1d extension and its CUDA architectures, the non-root user, the baked compile cache.

Selected by `FAST_KERNELS=1 scripts/image-smoke.sh` (marker `gpu_image`); it needs the CUDA 12.8 bases
(DFLASH_GPU_BASE_IMAGE, DFLASH_GPU_RUNTIME_IMAGE) from a registry or already in the engine.
"""

from __future__ import annotations

import json
import re

import docker
import pytest
from harness import GPU_ARCH_LIST, git_revision, lock_sha256, locked_stack_fingerprint, run_container

pytestmark = [pytest.mark.image, pytest.mark.gpu_image, pytest.mark.timeout(7200)]

# Loads the extension for real (the import needs libcudart and torch's CUDA libraries, not a GPU or
# libcuda), then lists the cubins in its .so with the cuobjdump that the locked triton ships.
EXTENSION_PROBE = """
import json, os, subprocess
import torch, triton
import causal_conv1d_cuda
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
listing = subprocess.run([cuobjdump, "--list-elf", causal_conv1d_cuda.__file__],
                         capture_output=True, text=True, check=True).stdout
print(json.dumps({"file": causal_conv1d_cuda.__file__, "cuda": torch.version.cuda, "elf": listing}))
"""


def test_gpu_image_is_the_locked_stack_with_both_fast_kernels(
    docker_client: docker.DockerClient, gpu_image: tuple[str, str]
):
    image, _ = gpu_image
    config = docker_client.images.get(image).attrs["Config"]
    assert config["Labels"]["dflash.fast-kernels"] == "1"
    assert config["Labels"]["org.opencontainers.image.revision"] == git_revision()
    assert config["Labels"]["dflash.uv-lock.sha256"] == lock_sha256()
    assert config["User"] == "1000:1000"

    whoami = run_container(docker_client, image, ["shell", "id", "-u"])
    assert (whoami.exit_code, whoami.stdout.strip()) == (0, "1000")

    fingerprint = locked_stack_fingerprint(docker_client, image)
    kernels = fingerprint["fast_kernels"]
    assert kernels["fla"] == {"present": True, "version": "0.6.0", "error": None}
    assert kernels["causal_conv1d"] == {"present": True, "version": "1.7.0", "error": None}


def test_causal_conv1d_extension_loads_and_holds_the_target_architectures(
    docker_client: docker.DockerClient, gpu_image: tuple[str, str]
):
    image, _ = gpu_image
    done = run_container(docker_client, image, ["shell", "python", "-c", EXTENSION_PROBE])
    assert done.exit_code == 0, done.stderr[-4000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["file"].startswith("/app/.venv/") and probe["file"].endswith(".so")
    assert probe["cuda"] == "12.8"
    built_for = set(re.findall(r"\.(sm_\d+)\.cubin", probe["elf"]))
    wanted = {f"sm_{arch.split('+')[0].replace('.', '')}" for arch in GPU_ARCH_LIST.split()}
    assert built_for == wanted, probe["elf"]


def test_baked_compile_cache_is_the_last_layer_and_doctor_finds_it(
    docker_client: docker.DockerClient, gpu_image: tuple[str, str]
):
    image, key = gpu_image
    # Newest first; the layers after compile_cache/ are metadata only (ARG, LABEL, ENV: no files).
    layers = [entry for entry in docker_client.images.get(image).history() if entry["Size"] > 0]
    assert "COPY compile_cache /app/compile_cache" in layers[0]["CreatedBy"], layers[:3]

    done = run_container(docker_client, image, ["doctor"])
    assert done.exit_code == 0, done.stderr
    assert "compile caches in compile_cache/" in done.stdout, done.stdout
    assert f"differs: {key} (built stand-in)" in done.stdout, done.stdout
