"""docker-compose.yml, the Dockerfile and .dockerignore hold the appliance's container invariants.

A cheap structural check for the default suite; the image tests (`just image-smoke`) run the real
`docker-compose config` and bring the stack up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|^AWS_", re.IGNORECASE)


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service["deploy"]["resources"]["reservations"]["devices"]


def mount_target(volume: str) -> str:
    """`${DFLASH_DATA:-./data}:/data:ro` -> `/data` (the source may hold a `:-` default)."""
    return volume.rsplit("}:", 1)[-1].split(":")[1 if "}" not in volume else 0]


def test_gpu_reservations_are_the_compose_spec_list_form(services):
    """deploy.resources.reservations.devices as the compose spec documents it: a list of device requests,
    each a mapping with `capabilities` (a list, required) and the GPUs by `device_ids` (a list of
    strings) rather than `count` (the spec forbids both in one request)."""
    for name in ("train", "build-cache", "datagen-server"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert isinstance(devices, list) and devices, name
        for device in devices:
            assert set(device) <= {"capabilities", "driver", "count", "device_ids", "options"}, name
            assert isinstance(device["capabilities"], list) and "gpu" in device["capabilities"], name
            assert isinstance(device["device_ids"], list), name
            assert all(isinstance(entry, str) for entry in device["device_ids"]), name
            assert "count" not in device, name


def test_gpu_services_reserve_gpus_chosen_by_an_environment_variable(services):
    assert "deploy" not in services["datagen"]  # the client only talks HTTP
    for name in ("train", "build-cache", "datagen-server"):
        service = services[name]
        (device,) = gpu_devices(service)
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        (ids,) = device["device_ids"]
        assert re.fullmatch(r"\$\{[A-Z_]+:-[0-9,]+\}", ids), f"{name}: device ids {ids!r} not configurable"
    assert (
        gpu_devices(services["train"])[0]["device_ids"]
        != gpu_devices(services["datagen-server"])[0]["device_ids"]
    )


def test_train_mounts_data_read_only_and_checkpoints_and_kernel_cache_writable(services):
    volumes = {mount_target(volume): volume for volume in services["train"]["volumes"]}
    assert volumes["/data"].endswith(":ro")
    assert not volumes["/checkpoints"].endswith(":ro")
    assert volumes["/home/dflash/.cache/dflash"].startswith("kernel-cache:")
    assert services["train"]["command"] == ["train"]
    assert services["train"]["stop_grace_period"] == "10m"  # time to checkpoint after SIGTERM


def test_build_cache_writes_the_compile_cache_the_image_bakes(services):
    assert "./compile_cache:/app/compile_cache" in services["build-cache"]["volumes"]
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    copies_and_runs = [line for line in dockerfile if line.startswith(("COPY", "RUN", "ADD"))]
    assert copies_and_runs[-1] == "COPY compile_cache /app/compile_cache"


def test_datagen_client_waits_for_a_healthy_pinned_sglang_server(services):
    server, client = services["datagen-server"], services["datagen"]
    image = server["image"]
    assert re.fullmatch(r"\$\{SGLANG_IMAGE:-lmsysorg/sglang:v[0-9][^}]*\}", image), image
    assert "latest" not in image
    assert any(probe in " ".join(server["healthcheck"]["test"]) for probe in ("/health", "/v1/models"))
    assert client["depends_on"] == {"datagen-server": {"condition": "service_healthy"}}
    assert client["image"] == services["train"]["image"]  # our image, not the serving one
    assert "datagen-server:30000" in " ".join(client["command"])


def test_no_secret_is_written_into_compose_or_the_image(services):
    for name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            assert not SECRET_NAME.search(key), f"{name}: secret {key}={value} belongs in the env file"
        if service["image"] == services["train"]["image"]:
            # Optional, so a fresh clone starts without creating it; still the only source of secrets.
            assert service["env_file"] == [{"path": "${DFLASH_ENV_FILE:-dflash.env}", "required": False}], (
                name
            )
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"^(ENV|ARG) .*(KEY|SECRET|TOKEN|AWS_)", dockerfile, re.MULTILINE)
    # The build CA arrives as a BuildKit secret mount, never a COPY.
    assert "--mount=type=secret,id=ca" in dockerfile and "COPY ca" not in dockerfile


def test_training_image_has_no_serving_stack():
    dockerfile = (ROOT / "Dockerfile").read_text().lower()
    assert "sglang" not in dockerfile and "flashinfer" not in dockerfile
    assert "uv sync --locked --no-install-project" in dockerfile


def test_dockerignore_keeps_data_state_and_history_out_of_the_context():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (
        ".git",
        ".venv",
        ".tools",
        "runs",
        "data",
        "checkpoints",
        "wandb",
        ".pytest_cache",
        "**/__pycache__",
    ):
        assert entry in ignored
    assert "compile_cache" not in ignored  # baked as the image's last layer


def test_train_passes_every_rendezvous_variable_the_launch_reads(services):
    """A variable left out of `environment` would silently not reach the entrypoint on a node."""
    from app.pipeline.launch import C10D, STATIC, WAIT_VARIABLE

    passed = services["train"]["environment"]
    for name in ("NNODES", *C10D, *STATIC, WAIT_VARIABLE, "DFLASH_TORCHRUN_ARGS"):
        assert name in passed and passed[name] is None, name  # from the shell, never a value baked in


def compose_v2() -> list[str] | None:
    """The Compose v2 CLI (the `docker compose` plugin, or a v2 `docker-compose`), else None: v1
    predates the optional env file's syntax."""
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        done = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, check=False)
        if done.returncode == 0 and done.stdout.strip().lstrip("v").startswith("2."):
            return command
    return None


def test_compose_config_validates_on_a_fresh_clone_without_an_env_file(tmp_path: Path):
    """`docker compose config` as a new user runs it: no dflash.env, no .env, every profile."""
    command = compose_v2()
    if command is None:
        pytest.skip(
            "no Compose v2 CLI here (`docker compose` plugin); Compose v1 cannot read `required: false`"
        )
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "docker-compose.yml").write_text((ROOT / "docker-compose.yml").read_text())
    env = {key: value for key, value in os.environ.items() if not key.startswith(("DFLASH_", "COMPOSE_"))}
    done = subprocess.run(
        [*command, "--profile", "datagen", "--profile", "build-cache", "config", "--format", "json"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    resolved = json.loads(done.stdout)["services"]
    assert sorted(resolved) == ["build-cache", "datagen", "datagen-server", "train"]
    (device,) = resolved["train"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
