"""Image tests: build the CPU image with a real Docker engine, then run it and the compose stack.

Not part of the default `pytest` run (the `image` marker is deselected in pyproject's addopts):
`scripts/image-smoke.sh` (`just image-smoke`) starts an engine and runs `pytest -m image tests/image`.
Images are built with the docker CLI, not the SDK: the SDK's build API has no BuildKit session, so no
cache mounts and no secrets. Everything else goes through the `docker` SDK.
"""

from __future__ import annotations

from collections.abc import Iterator

import docker
import pytest
from harness import (
    BUILD_STAGE_IMAGE,
    CPU_IMAGE,
    GPU_IMAGE,
    HERE,
    ROOT,
    SERVER_IMAGE,
    build,
    cpu_build_args,
    gpu_build_args,
    measurements,
    stand_in_cache_entry,
)


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    client = docker.from_env(timeout=600)
    try:
        client.ping()
    except docker.errors.DockerException as error:
        raise RuntimeError(
            f"no Docker engine answers ({error}); run the image tests with scripts/image-smoke.sh"
        ) from None
    yield client
    client.close()


@pytest.fixture(scope="session")
def cpu_image(docker_client: docker.DockerClient) -> str:
    """The CPU variant of the real Dockerfile (same stages, Debian base, no fast kernels)."""
    seconds = build(CPU_IMAGE, dockerfile=ROOT / "Dockerfile", context=ROOT, build_args=cpu_build_args())
    size = docker_client.images.get(CPU_IMAGE).attrs["Size"]
    measurements[f"{CPU_IMAGE} build"] = f"{seconds:.0f} s (BuildKit cache as left by earlier builds)"
    measurements[f"{CPU_IMAGE} size"] = f"{size / 1e9:.2f} GB"
    return CPU_IMAGE


@pytest.fixture(scope="session")
def gpu_image(docker_client: docker.DockerClient) -> tuple[str, str]:
    """The default variant (FAST_KERNELS=1: flash-linear-attention, CUDA 12.8 from the torch wheels), built
    with a stand-in compile-cache entry in compile_cache/; returns the image and that entry's key."""
    with stand_in_cache_entry() as key:
        seconds = build(GPU_IMAGE, dockerfile=ROOT / "Dockerfile", context=ROOT, build_args=gpu_build_args())
    size = docker_client.images.get(GPU_IMAGE).attrs["Size"]
    measurements[f"{GPU_IMAGE} build"] = f"{seconds:.0f} s (BuildKit cache as left by earlier builds)"
    measurements[f"{GPU_IMAGE} size"] = f"{size / 1e9:.2f} GB"
    return GPU_IMAGE, key


@pytest.fixture(scope="session")
def server_image(cpu_image: str) -> str:
    """`transformers serve` (the dev group) on top of our CPU image: the compose stack's CPU stand-in for SGLang."""
    build(
        BUILD_STAGE_IMAGE,
        dockerfile=ROOT / "Dockerfile",
        context=ROOT,
        build_args=cpu_build_args(),
        target="build",
    )
    seconds = build(
        SERVER_IMAGE,
        dockerfile=HERE / "server.Dockerfile",
        context=HERE,
        build_args={"BUILD_IMAGE": BUILD_STAGE_IMAGE, "RUNTIME_IMAGE": cpu_image},
    )
    measurements[f"{SERVER_IMAGE} build"] = f"{seconds:.0f} s"
    return SERVER_IMAGE


def pytest_terminal_summary(terminalreporter) -> None:
    if measurements:
        terminalreporter.section("image measurements")
        for name, value in measurements.items():
            terminalreporter.write_line(f"{name}: {value}")
