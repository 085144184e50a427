"""The CPU image: the locked stack and nothing else, the smoke run, and the entrypoint's guard rails."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import docker
import pytest
from harness import (
    git_revision,
    lock_sha256,
    locked_stack_fingerprint,
    readable_by_container,
    run_container,
    writable_by_container,
)

pytestmark = pytest.mark.image

SMOKE_CACHE_VOLUME = "dflash-image-tests-cache"


def test_image_is_the_locked_stack_run_by_a_non_root_user(docker_client: docker.DockerClient, cpu_image: str):
    config = docker_client.images.get(cpu_image).attrs["Config"]
    assert config["Labels"]["org.opencontainers.image.revision"] == git_revision()
    assert config["Labels"]["dflash.uv-lock.sha256"] == lock_sha256()
    assert config["User"] == "1000:1000"
    env = dict(entry.split("=", 1) for entry in config["Env"])
    assert env["HOME"] == "/home/dflash" and env["USER"] == "dflash"
    assert env["PATH"].startswith("/app/.venv/bin:")

    fingerprint = locked_stack_fingerprint(docker_client, cpu_image)
    cache = fingerprint["compile_cache"]
    assert cache["inductor_dir"] == "/home/dflash/.cache/dflash/inductor"
    assert cache["triton_dir"] == "/home/dflash/.cache/dflash/triton"
    assert not cache["inductor_under_tmp"] and not cache["triton_under_tmp"]
    # FAST_KERNELS=0: the CPU variant carries neither; the GPU image must show both present.
    assert {status["present"] for status in fingerprint["fast_kernels"].values()} == {False}


def host_tiny_lm(tmp_path: Path) -> tuple[Path, str]:
    """The built-in tiny-lm target as the host has it (built here once if not), copied where the image's
    user can read it, and the path the image looks for it at: its key (architecture, recipe, corpus,
    torch version) is the image's, both being the same locked stack, so the container does not spend
    minutes of its smoke run training it again."""
    from app.model.tiny_lm import ensure_tiny_lm

    built = ensure_tiny_lm()
    copy = tmp_path / "tiny-lm"
    shutil.copytree(built, copy)
    return readable_by_container(copy), f"/home/dflash/.cache/dflash/tiny-lm/{built.name}"


def test_smoke_trains_and_exports(docker_client: docker.DockerClient, cpu_image: str, tmp_path: Path):
    runs = writable_by_container(tmp_path / "runs")
    tiny_lm, tiny_lm_in_image = host_tiny_lm(tmp_path)
    done = run_container(
        docker_client,
        cpu_image,
        ["smoke", "runs/smoke"],
        volumes={
            str(runs): {"bind": "/app/runs", "mode": "rw"},
            # Like compose's kernel-cache volume: kernels compiled by one run survive to the next.
            SMOKE_CACHE_VOLUME: {"bind": "/home/dflash/.cache/dflash", "mode": "rw"},
            # Read-only: a key mismatch (a build attempt) fails loudly instead of training in the container.
            str(tiny_lm): {"bind": tiny_lm_in_image, "mode": "ro"},
        },
        timeout_s=840,
    )
    assert "tiny-lm: building" not in done.stderr, (
        "the image trained tiny-lm again: its key differs from the host's"
    )
    assert done.exit_code == 0, (done.stdout + done.stderr)[-4000:]
    assert "smoke: ok" in done.stdout
    assert "verdict: locked training stack OK" in done.stdout
    conversations = (runs / "smoke/data/conversations.jsonl").read_text().splitlines()
    assert len(conversations) == 64
    exported = runs / "smoke/export"
    assert (exported / "config.json").is_file()
    assert list(exported.glob("*.safetensors"))


def test_missing_data_mount_is_one_clear_line(docker_client: docker.DockerClient, cpu_image: str):
    done = run_container(
        docker_client,
        cpu_image,
        ["train", "configs/tiny.toml", 'data.train_files=["/data/regenerated"]'],
        environment={"DFLASH_SKIP_DOCTOR": "1"},
    )
    assert done.exit_code == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert errors == [
        "entrypoint: error: training data (data.train_files) /data/regenerated does not exist in the "
        "container: mount it (compose: a volume onto /data/regenerated; docker run: -v HOST_PATH:/data/regenerated)"
    ]


def test_read_only_checkpoint_dir_is_one_clear_line(
    docker_client: docker.DockerClient, cpu_image: str, tmp_path: Path
):
    data = tmp_path / "data"
    data.mkdir()
    (data / "conversations.jsonl").write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
        )
        + "\n"
    )
    checkpoints = writable_by_container(tmp_path / "checkpoints")
    done = run_container(
        docker_client,
        cpu_image,
        [
            "train",
            "configs/tiny.toml",
            'data.train_files=["/data/conversations.jsonl"]',
            "train.output_dir=/checkpoints",
        ],
        environment={"DFLASH_SKIP_DOCTOR": "1"},
        volumes={
            str(data): {"bind": "/data", "mode": "ro"},
            str(checkpoints): {"bind": "/checkpoints", "mode": "ro"},
        },
    )
    assert done.exit_code == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "entrypoint: error: checkpoint directory (train.output_dir) /checkpoints is read-only or not "
        "writable by uid 1000: mount it read-write (no :ro) and owned by uid 1000"
    )


def test_docker_stop_reaches_the_exec_ed_process(docker_client: docker.DockerClient, cpu_image: str):
    """tini (PID 1) -> entrypoint.sh -> exec: SIGTERM from `docker stop` arrives, no 10 s SIGKILL wait."""
    container = docker_client.containers.run(
        cpu_image, ["shell", "sleep", "600"], detach=True, network_mode="host"
    )
    try:
        deadline = time.monotonic() + 60
        while container.top()["Processes"] is None or not any(
            "sleep 600" in " ".join(process) for process in container.top()["Processes"]
        ):
            assert time.monotonic() < deadline, "sleep never started"
            time.sleep(0.2)
        started = time.monotonic()
        container.stop(timeout=30)
        stopped_after = time.monotonic() - started
        assert container.wait(timeout=10)["StatusCode"] == 143  # 128 + SIGTERM, not 137 (SIGKILL)
        assert stopped_after < 10
    finally:
        container.remove(force=True)
