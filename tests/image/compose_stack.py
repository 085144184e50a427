"""The compose stack through the real `docker-compose` binary (Debian's Compose v1 here, v2 elsewhere)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml
from harness import ROOT

COMPOSE_TIMEOUT_S = 1200


def compose_command() -> list[str]:
    """`docker-compose` (v1) when installed, else the `docker compose` plugin (v2)."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


def compose(
    args: list[str], env: dict[str, str], files: list[Path], timeout_s: float = COMPOSE_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    command = [*compose_command(), *(arg for file in files for arg in ("-f", str(file))), *args]
    return subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def without_gpu_reservations(merged: dict[str, Any]) -> dict[str, Any]:
    """The merged config minus every `deploy.resources.reservations.devices` entry.

    An override file can only add to that list, and Compose v1 has no `!reset`; a machine without the
    NVIDIA runtime refuses to start a container that reserves a GPU.
    """
    for service in merged["services"].values():
        reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        reservations.pop("devices", None)
    return merged


def cpu_stack_file(env: dict[str, str], directory: Path) -> Path:
    """docker-compose.yml + docker-compose.cpu.yml, merged and validated by compose itself, for a CPU box."""
    files = [ROOT / "docker-compose.yml", ROOT / "docker-compose.cpu.yml"]
    done = compose(["config"], env, files)
    if done.returncode != 0:
        raise RuntimeError(f"docker-compose config failed: {done.stderr.strip()}")
    stack = directory / "docker-compose.cpu-stack.yml"
    stack.write_text(yaml.safe_dump(without_gpu_reservations(yaml.safe_load(done.stdout)), sort_keys=False))
    return stack
