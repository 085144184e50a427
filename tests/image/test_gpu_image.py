"""The default (GPU) image, checked without a GPU: the locked stack with flash-linear-attention, a CUDA
12.8 userspace from the torch wheels for Hopper and Blackwell, Triton's ptxas, the non-root user, the
baked compile cache.

Selected by `FAST_KERNELS=1 scripts/image-smoke.sh` (marker `gpu_image`). Built exactly as `docker build .`
builds it (the Dockerfile's defaults, only the base and provenance passed), on the same local Debian base
as the CPU image: no CUDA base image and no registry.
"""

from __future__ import annotations

import json

import docker
import pytest
from harness import git_revision, lock_sha256, locked_stack_fingerprint, measurements, run_container

pytestmark = [pytest.mark.image, pytest.mark.gpu_image]

# Hopper (H100/H200), B200, RTX PRO 6000 / RTX 50: the GPUs the appliance is run on.
WANTED_ARCHES = {"sm_90", "sm_100", "sm_120"}

# What torch was built for, read without a GPU: torch.cuda.get_arch_list() answers [] when no device is
# visible, the compiled-in arch flags do not. cuDNN's version loads libcudnn from the venv.
TORCH_PROBE = """
import json, torch
print(json.dumps({"cuda": torch.version.cuda, "arches": torch._C._cuda_getArchFlags().split(),
                  "cudnn": torch.backends.cudnn.version(), "nccl": list(torch.cuda.nccl.version())}))
"""

# Every shared library torch ships, with what the dynamic loader cannot find for it: ldd lists the whole
# closure, following the $ORIGIN rpaths into the venv's nvidia/*/lib as the real load does. (Not every
# file of the nvidia-* wheels: cuFile's RDMA and NVSHMEM's MPI/PMIx bootstraps are plugins torch never
# links, loaded only on clusters that have those libraries.)
LDD_PROBE = r"""
import glob, json, os, subprocess, sysconfig
site = sysconfig.get_paths()["purelib"]
libraries = sorted(glob.glob(f"{site}/torch/lib/*.so*"))
missing = {}
for library in libraries:
    listing = subprocess.run(["ldd", library], capture_output=True, text=True, check=True).stdout
    absent = sorted({line.split()[0] for line in listing.splitlines() if "not found" in line})
    if absent:
        missing[os.path.relpath(library, site)] = absent
print(json.dumps({"checked": len(libraries), "missing": missing}))
"""

# Triton compiles its kernels to cubins with the ptxas it ships; without it no Triton kernel runs.
PTXAS_PROBE = """
import os, subprocess, triton
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
version = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
print([line for line in version.splitlines() if "release" in line][0])
"""

# The kernel modules a hybrid target loads (fla's Triton conv stands in for causal-conv1d's CUDA one).
FLA_PROBE = """
import fla, fla.modules.causal_conv1d, fla.ops.gated_delta_rule
print(fla.__version__)
"""

# The driver's library: the NVIDIA container runtime mounts it from the host at run time.
DRIVER_LIBRARIES = {"libcuda.so.1"}


def probe(client: docker.DockerClient, image: str, code: str) -> str:
    done = run_container(client, image, ["shell", "python", "-c", code])
    assert done.exit_code == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout.strip().splitlines()[-1]


def test_default_image_is_the_locked_stack_with_flash_linear_attention(
    docker_client: docker.DockerClient, gpu_image: tuple[str, str]
):
    image, _ = gpu_image
    config = docker_client.images.get(image).attrs["Config"]
    assert config["Labels"]["dflash.fast-kernels"] == "1"
    assert config["Labels"]["dflash.causal-conv1d"] == "0"
    assert config["Labels"]["org.opencontainers.image.revision"] == git_revision()
    assert config["Labels"]["dflash.uv-lock.sha256"] == lock_sha256()
    assert config["User"] == "1000:1000"

    whoami = run_container(docker_client, image, ["shell", "id", "-u"])
    assert (whoami.exit_code, whoami.stdout.strip()) == (0, "1000")

    fingerprint = locked_stack_fingerprint(docker_client, image)
    kernels = fingerprint["fast_kernels"]
    assert kernels["fla"] == {"present": True, "version": "0.6.0", "error": None}
    assert kernels["causal_conv1d"]["present"] is False  # the optional nvcc variant only

    done = run_container(docker_client, image, ["doctor"])
    assert done.exit_code == 0, done.stdout + done.stderr
    assert "hybrid targets' causal conv on CUDA: flash-linear-attention (Triton)" in done.stdout, done.stdout


def test_torch_is_cuda_12_8_built_for_hopper_and_blackwell(
    docker_client: docker.DockerClient, gpu_image: tuple[str, str]
):
    found = json.loads(probe(docker_client, gpu_image[0], TORCH_PROBE))
    assert found["cuda"] == "12.8"
    assert set(found["arches"]) >= WANTED_ARCHES, found["arches"]
    assert found["cudnn"] >= 91000, found  # cuDNN 9.10+, from the nvidia-cudnn-cu12 wheel
    measurements["dflash:gpu CUDA"] = f"{found['cuda']}, cuDNN {found['cudnn']}, NCCL {found['nccl']}"


def test_every_cuda_library_torch_links_resolves_in_the_image_but_the_driver(
    docker_client: docker.DockerClient, gpu_image: tuple[str, str]
):
    found = json.loads(probe(docker_client, gpu_image[0], LDD_PROBE))
    assert found["checked"] >= 5, found  # libtorch_cuda, libtorch_cpu, libc10_cuda, ... were found
    unresolved = {lib: sorted(set(absent) - DRIVER_LIBRARIES) for lib, absent in found["missing"].items()}
    assert {lib: absent for lib, absent in unresolved.items() if absent} == {}


def test_triton_ptxas_is_present(docker_client: docker.DockerClient, gpu_image: tuple[str, str]):
    version = probe(docker_client, gpu_image[0], PTXAS_PROBE)
    assert version.startswith("Cuda compilation tools, release 12."), version
    measurements["dflash:gpu Triton ptxas"] = version


def test_flash_linear_attention_imports(docker_client: docker.DockerClient, gpu_image: tuple[str, str]):
    assert probe(docker_client, gpu_image[0], FLA_PROBE) == "0.6.0"


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
