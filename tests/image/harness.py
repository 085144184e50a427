"""Helpers of the image tests: build with the docker CLI (BuildKit), run with the docker SDK."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import docker

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BASE_IMAGE = os.environ.get("DFLASH_BASE_IMAGE", "local/bookworm-python:base")
CPU_IMAGE = "dflash:cpu"
BUILD_STAGE_IMAGE = "dflash:cpu-build"
SERVER_IMAGE = "dflash:cpu-server"
GPU_IMAGE = "dflash:gpu"
STAND_IN_CACHE_KEY = "stand-in-h200-sm90-0000000000000000"
BUILD_TIMEOUT_S = 3600
measurements: dict[str, str] = {}
"""Build times, image sizes and versions found, printed in pytest's terminal summary (conftest)."""


@dataclass(frozen=True)
class Finished:
    exit_code: int
    stdout: str
    stderr: str


def docker_cli() -> str:
    """A docker CLI that builds with BuildKit: one with buildx, else Debian's 20.10 client (built-in BuildKit)."""
    chosen = os.environ.get("DFLASH_DOCKER_CLI")
    if chosen:
        return chosen
    for candidate in ("docker", "/usr/bin/docker"):
        path = shutil.which(candidate)
        if path is None:
            continue
        if subprocess.run([path, "buildx", "version"], capture_output=True, check=False).returncode == 0:
            return path
        version = subprocess.run(
            [path, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True, check=False
        ).stdout.strip()
        if version.split(".")[0] in {"20", "21", "22"}:  # before 23 the CLI drives BuildKit itself
            return path
    raise RuntimeError(
        "no docker CLI that can build with BuildKit: install docker-buildx or Debian's docker.io"
    )


def build(
    tag: str, *, dockerfile: Path, context: Path, build_args: dict[str, str], target: str | None = None
) -> float:
    """`docker build` with BuildKit, host network and the machine's CA as a secret; returns seconds taken."""
    command = [
        docker_cli(),
        "build",
        "--network",
        "host",
        "--progress",
        "plain",
        "-t",
        tag,
        "-f",
        str(dockerfile),
    ]
    ca_file = os.environ.get("SSL_CERT_FILE")
    if ca_file and Path(ca_file).is_file():
        command += ["--secret", f"id=ca,src={ca_file}"]
    for name, value in build_args.items():
        command += ["--build-arg", f"{name}={value}"]
    if target:
        command += ["--target", target]
    started = time.monotonic()
    done = subprocess.run(
        [*command, str(context)],
        env={**os.environ, "DOCKER_BUILDKIT": "1"},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"docker build of {tag} failed:\n{(done.stdout + done.stderr)[-6000:]}")
    return time.monotonic() - started


def git_revision() -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return done.stdout.strip() or "unknown"


def lock_sha256() -> str:
    return hashlib.sha256((ROOT / "uv.lock").read_bytes()).hexdigest()


def cpu_build_args() -> dict[str, str]:
    return {
        "BASE_IMAGE": BASE_IMAGE,
        "RUNTIME_IMAGE": BASE_IMAGE,
        "FAST_KERNELS": "0",
        "REVISION": git_revision(),
        "LOCK_SHA256": lock_sha256(),
    }


def gpu_build_args() -> dict[str, str]:
    """The default variant as `docker build .` makes it: only the base (the same local Debian one as the
    CPU image's, unless overridden) and provenance are passed, so a default that drops a kernel fails a test."""
    return {
        "BASE_IMAGE": BASE_IMAGE,
        "RUNTIME_IMAGE": BASE_IMAGE,
        "REVISION": git_revision(),
        "LOCK_SHA256": lock_sha256(),
    }


@contextmanager
def stand_in_cache_entry() -> Iterator[str]:
    """A compile-cache entry (a manifest only, no artifacts) in compile_cache/ while an image is built,
    as `dflash build-cache` leaves one before `docker compose build` bakes it; yields its key."""
    entry = ROOT / "compile_cache" / STAND_IN_CACHE_KEY
    entry.mkdir()
    try:
        manifest = {
            "schema": 1,
            "key": STAND_IN_CACHE_KEY,
            "created_at": "stand-in",
            "fields": {"machine.gpu": "NVIDIA H200", "machine.capability": "9.0"},
            "artifacts": {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()},
        }
        (entry / "manifest.json").write_text(json.dumps(manifest))
        yield STAND_IN_CACHE_KEY
    finally:
        (entry / "manifest.json").unlink(missing_ok=True)
        entry.rmdir()


def run_container(
    client: docker.DockerClient, image: str, command: list[str], timeout_s: float = 900, **options
) -> Finished:
    """Run to completion and return the exit code with stdout and stderr apart; the container is removed."""
    container = client.containers.run(image, command, detach=True, network_mode="host", **options)
    try:
        status = container.wait(timeout=timeout_s)
        return Finished(
            exit_code=status["StatusCode"],
            stdout=container.logs(stdout=True, stderr=False).decode(errors="replace"),
            stderr=container.logs(stdout=False, stderr=True).decode(errors="replace"),
        )
    finally:
        container.remove(force=True)


def readable_by_container(path: Path) -> Path:
    """Make a host tree readable by the image's non-root user (safetensors files are written 0600)."""
    for item in [path, *path.rglob("*")]:
        item.chmod(0o755 if item.is_dir() else 0o644)
    return path


def writable_by_container(path: Path) -> Path:
    """A host directory the image's non-root user (uid 1000) can write, as a bind mount needs."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    return path


def locked_stack_fingerprint(client: docker.DockerClient, image: str) -> dict:
    """`dflash doctor --json` in `image`, checked to report the locked stack (the lock's hash, every
    package checked, nothing stray, mismatched or duplicated, torch 2.10.0): its fingerprint."""
    done = run_container(client, image, ["doctor", "--json"])
    assert done.exit_code == 0, done.stderr
    fingerprint = json.loads(done.stdout)
    assert fingerprint["lock"]["sha256"] == lock_sha256()
    packages = fingerprint["packages"]
    assert packages["checked"], packages
    assert (packages["stray"], packages["mismatched"], packages["duplicates"]) == ([], [], [])
    assert fingerprint["torch"]["version"].startswith("2.10.0")
    return fingerprint


def prebuild(variants: list[str]) -> None:
    """Build the images the tests will use, outside pytest: a cold build takes longer than pytest's
    per-test timeout on 2 cores, and the fixtures' own builds then only hit BuildKit's cache."""
    for variant in variants:
        if variant == "cpu":
            seconds = build(
                CPU_IMAGE, dockerfile=ROOT / "Dockerfile", context=ROOT, build_args=cpu_build_args()
            )
            print(f"{CPU_IMAGE} built in {seconds:.0f} s", flush=True)
        elif variant == "gpu":
            with stand_in_cache_entry():
                seconds = build(
                    GPU_IMAGE, dockerfile=ROOT / "Dockerfile", context=ROOT, build_args=gpu_build_args()
                )
            print(f"{GPU_IMAGE} built in {seconds:.0f} s", flush=True)
        else:
            raise SystemExit(f"harness.py: unknown variant {variant!r} (cpu or gpu)")


if __name__ == "__main__":
    import sys

    prebuild(sys.argv[1:])
