"""The compose stack on CPU: datagen-server healthy -> datagen client writes shards -> train starts on them."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from compose_stack import compose, cpu_stack_file
from datagen_server import build_tiny_chat_model, free_port
from harness import ROOT, readable_by_container, writable_by_container

pytestmark = pytest.mark.image

PROMPTS = ["Continue: the quick brown fox", "Continue: a list of numbers", "Continue: how to read a file"]

STACK_CONFIG = """\
[target]
builtin = "tiny-lm"

[drafter]
num_layers = 2
block_size = 8
mask_token_id = 3

[data]
train_files = ["/data/regenerated"]
max_length = 512
token_budget = 1024
max_batch_size = 16

[train]
anchors = 64
precision = "fp32"
device = "cpu"
max_steps = 4
output_dir = "/checkpoints/tiny"

[telemetry]
wandb = "disabled"

[datagen]
prompts = ["/data/prompts.jsonl"]
max_tokens = 8
concurrency = 2
"""


def test_compose_file_parses_with_every_profile(tmp_path: Path):
    env_file = tmp_path / "dflash.env"
    env_file.write_text("WANDB_API_KEY=from-the-env-file\n")
    env = {"DFLASH_ENV_FILE": str(env_file)}
    files = [ROOT / "docker-compose.yml"]
    everything = ["--profile", "datagen", "--profile", "build-cache"]

    services = compose([*everything, "config", "--services"], env, files)
    assert services.returncode == 0, services.stderr
    assert sorted(services.stdout.split()) == ["build-cache", "datagen", "datagen-server", "train"]
    resolved = compose([*everything, "config"], env, files)
    assert resolved.returncode == 0, resolved.stderr
    assert "from-the-env-file" in resolved.stdout  # secrets arrive from the env file at run time
    assert "device_ids" in resolved.stdout and "service_healthy" in resolved.stdout


def test_cpu_stack_regenerates_data_then_train_starts_on_it(
    server_image: str, cpu_image: str, tiny_tokenizer_dir: Path, tmp_path: Path
):
    models = tmp_path / "models"
    readable_by_container(build_tiny_chat_model(models / "tiny-chat", tiny_tokenizer_dir).parent)
    data = writable_by_container(tmp_path / "data")
    checkpoints = writable_by_container(tmp_path / "checkpoints")
    (data / "stack.toml").write_text(STACK_CONFIG)
    (data / "prompts.jsonl").write_text(
        "".join(
            json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": text}]}) + "\n"
            for i, text in enumerate(PROMPTS)
        )
    )
    env_file = tmp_path / "dflash.env"
    env_file.write_text("")
    env = {
        "COMPOSE_PROJECT_NAME": f"dflash-test-{tmp_path.name}".lower().replace("_", "-"),
        "DFLASH_IMAGE": cpu_image,
        "DFLASH_SERVER_IMAGE": server_image,
        "DFLASH_ENV_FILE": str(env_file),
        "DFLASH_DATA": str(data),
        "DFLASH_MODELS": str(models),
        "DFLASH_CHECKPOINTS": str(checkpoints),
        "DFLASH_CONFIG": "/data/stack.toml",
        "DATAGEN_MODEL_PATH": "/models/tiny-chat",
        "DATAGEN_PORT": str(free_port()),
        "DFLASH_SHM_SIZE": "256mb",
    }
    stack = [cpu_stack_file(env, tmp_path)]
    try:
        up = compose(["--profile", "datagen", "up", "--exit-code-from", "datagen", "datagen"], env, stack)
        assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
        rows = pq.read_table(sorted((data / "regenerated").glob("part-*.parquet"))).to_pylist()
        assert sorted(row["id"] for row in rows) == ["p0", "p1", "p2"]
        assert all(row["messages"][-1]["role"] == "assistant" for row in rows)

        # The train service with the stack's volumes: doctor, the mount checks and the torchrun command.
        train = compose(["run", "--rm", "-T", "-e", "DFLASH_DRY_RUN=1", "train"], env, stack)
        assert train.returncode == 0, (train.stdout + train.stderr)[-4000:]
        assert "verdict: locked training stack OK" in train.stdout
        launched = shlex.split(train.stderr.split("entrypoint: running: ", 1)[1].splitlines()[0])
        assert launched == [
            "torchrun",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "1",
            "--standalone",
            "--no-python",
            "dflash",
            "train",
            "/data/stack.toml",
        ]
    finally:
        compose(["--profile", "datagen", "down", "--volumes", "--remove-orphans"], env, stack)


def test_train_on_a_machine_without_a_gpu_fails_naming_the_gpu_not_a_traceback(
    cpu_image: str, tmp_path: Path
):
    """`docker compose up train` from a fresh clone (no dflash.env, no .env) on this GPU-less engine: the
    GPU reservation is refused by the engine before our code runs, in a line that names the NVIDIA GPU."""
    env = {
        "COMPOSE_PROJECT_NAME": f"dflash-nogpu-{tmp_path.name}".lower().replace("_", "-"),
        "DFLASH_IMAGE": cpu_image,
        "DFLASH_ENV_FILE": str(tmp_path / "absent.env"),  # a fresh clone has no env file
        # Bind-mount sources of their own, so the run creates no directories in the checkout.
        "DFLASH_DATA": str(writable_by_container(tmp_path / "data")),
        "DFLASH_MODELS": str(writable_by_container(tmp_path / "models")),
        "DFLASH_CHECKPOINTS": str(writable_by_container(tmp_path / "checkpoints")),
        "DFLASH_SHM_SIZE": "64mb",
    }
    files = [ROOT / "docker-compose.yml"]
    try:
        up = compose(["up", "--no-build", "train"], env, files, timeout_s=300)
        output = up.stdout + up.stderr
        assert up.returncode != 0, output[-4000:]
        assert "Traceback" not in output, output[-4000:]
        named = [line for line in output.splitlines() if 'device driver "nvidia"' in line and "gpu" in line]
        assert named, output[-4000:]
    finally:
        compose(["down", "--volumes", "--remove-orphans"], env, files)
