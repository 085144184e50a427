"""The compose stack through the real `docker-compose` binary (Debian's Compose v1 here, v2 elsewhere)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
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


def is_compose_v1(command: list[str]) -> bool:
    done = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, check=False)
    return done.stdout.strip().startswith("1.")


INTERPOLATED = re.compile(r"\$\{(\w+):-([^}]*)\}")


def for_compose_v1(file: Path, env: dict[str, str], directory: Path) -> Path:
    """`file` as Compose v1 reads it: v1 predates `env_file: [{path, required: false}]`, so each such
    entry becomes the plain path when that file exists and is dropped when it is optional and absent
    (what v2 does with it). Only the `${NAME:-default}` form of the path is resolved."""
    compose_file = yaml.safe_load(file.read_text())
    for service in compose_file.get("services", {}).values():
        entries = service.get("env_file")
        if not isinstance(entries, list):
            continue
        kept = []
        for entry in entries:
            if not isinstance(entry, dict):
                kept.append(entry)
                continue
            path = INTERPOLATED.sub(lambda m: env.get(m[1]) or m[2], entry["path"])
            if entry.get("required", True) or (ROOT / path).is_file():
                kept.append(path)
        service["env_file"] = kept
    copy = directory / f"v1-{file.name}"
    copy.write_text(yaml.safe_dump(compose_file, sort_keys=False))
    return copy


def compose(
    args: list[str], env: dict[str, str], files: list[Path], timeout_s: float = COMPOSE_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    command = compose_command()
    environment = {**os.environ, **env}
    with tempfile.TemporaryDirectory() as scratch:
        if is_compose_v1(command):
            files = [for_compose_v1(file, environment, Path(scratch)) for file in files]
            # Relative paths (build context, bind mounts) stay relative to the checkout, not the copies.
            command = [*command, "--project-directory", str(ROOT)]
        command = [*command, *(arg for file in files for arg in ("-f", str(file))), *args]
        return subprocess.run(
            command,
            cwd=ROOT,
            env=environment,
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
