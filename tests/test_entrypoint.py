"""entrypoint.sh on the host (the image runs the same script): torchrun from the config, guard rails.

DFLASH_DRY_RUN=1 stops each run after the checks, at the command it would exec; the image tests run
it for real inside the container.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.datagen_server import free_port

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = ROOT / "entrypoint.sh"


def run_entrypoint(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {
        key: value
        for key, value in os.environ.items()
        if key
        not in {
            "NNODES",
            "NODE_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "RDZV_ENDPOINT",
            "RDZV_ID",
            "DFLASH_CONFIG",
        }
    }
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    return subprocess.run(
        [str(ENTRYPOINT), *args],
        cwd=ROOT,
        env={**base, "DFLASH_DRY_RUN": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def launched(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stderr.splitlines() if line.startswith("entrypoint: running: "))
    return shlex.split(line.removeprefix("entrypoint: running: "))


def errors(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if "error:" in line]


@pytest.fixture
def run_paths(tmp_path: Path) -> dict[str, str]:
    data = tmp_path / "conversations.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
        + "\n"
    )
    return {
        "data": f'data.train_files=["{data}"]',
        "output": f"train.output_dir={tmp_path / 'run'}",
        "inductor": str(tmp_path / "inductor"),
    }


def train(run_paths: dict[str, str], *overrides: str, env: dict[str, str] | None = None):
    return run_entrypoint(
        "train",
        "configs/tiny.toml",
        run_paths["data"],
        run_paths["output"],
        *overrides,
        env={"DFLASH_SKIP_DOCTOR": "1", "TORCHINDUCTOR_CACHE_DIR": run_paths["inductor"], **(env or {})},
    )


def test_single_node_train_is_standalone_torchrun_with_nproc_from_the_config(run_paths, tmp_path):
    done = train(run_paths, "topology.nproc_per_node=4", "topology.drafter_ranks=4", "--resume")
    assert launched(done) == [
        *("torchrun", "--nnodes", "1", "--nproc-per-node", "4", "--standalone"),
        *("--no-python", "dflash", "train", "configs/tiny.toml", run_paths["data"], run_paths["output"]),
        *("topology.nproc_per_node=4", "topology.drafter_ranks=4", "--resume"),
    ]
    assert (tmp_path / "run").is_dir()  # the checkpoint directory is created and probed


def test_multi_node_static_rendezvous_from_the_environment(run_paths):
    """Node 1 joins the rendezvous node 0 serves: the entrypoint waits for it to answer, then execs."""
    with socket.create_server(("127.0.0.1", 0)) as node_0:
        port = str(node_0.getsockname()[1])
        env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        command = launched(train(run_paths, "topology.drafter_ranks=2", env=env))
    assert command[:11] == [
        *("torchrun", "--nnodes", "2", "--nproc-per-node", "1"),
        *("--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", port),
    ]
    assert command[-1] == "topology.nnodes=2"  # the trainer sees the same node count as torchrun


def test_multi_node_c10d_rendezvous_and_extra_torchrun_args(run_paths):
    env = {"NNODES": "2", "RDZV_ENDPOINT": "127.0.0.1:29400", "DFLASH_TORCHRUN_ARGS": "--max-restarts 2"}
    command = launched(train(run_paths, "topology.drafter_ranks=2", env=env))
    assert command[:13] == [
        *("torchrun", "--nnodes", "2", "--nproc-per-node", "1"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "dflash"),
        *("--max-restarts", "2"),
    ]


@pytest.mark.parametrize(
    ("env", "line"),
    [
        ({"NNODES": "2"},
         "dflash: error: topology.nnodes is 2: set RDZV_ENDPOINT=host:port (or MASTER_ADDR, MASTER_PORT and "
         "NODE_RANK) on every node"),
        ({"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
         "dflash: error: static rendezvous: NODE_RANK not set; set MASTER_ADDR, MASTER_PORT and NODE_RANK on every "
         "node (NODE_RANK 0 on the node at MASTER_ADDR, 1..N-1 on the others), or RDZV_ENDPOINT alone"),
        ({"RDZV_ENDPOINT": "127.0.0.1:29400"},
         "dflash: error: RDZV_ENDPOINT set but topology.nnodes is 1: set NNODES to the job's node count on every "
         "node, or unset RDZV_ENDPOINT for a one-node job"),
        ({"NNODES": "two"}, "entrypoint: error: NNODES=two: expected the job's node count (1, 2, ...)"),
        ({"NNODES": "2", "RDZV_ENDPOINT": "127.0.0.1:29400", "MASTER_ADDR": "127.0.0.1"},
         "dflash: error: RDZV_ENDPOINT (c10d rendezvous) and MASTER_ADDR (static rendezvous) are both set: set "
         "either RDZV_ENDPOINT (and RDZV_ID), or MASTER_ADDR, MASTER_PORT and NODE_RANK"),
    ],
)  # fmt: skip
def test_a_bad_or_partial_rendezvous_is_refused_in_one_line(run_paths, env, line):
    """Before the doctor, the config's model defaults or torchrun load: the whole stderr is that line."""
    two_nodes = ["topology.drafter_ranks=2"] if "NNODES" in env else []  # without NNODES the config's 1 node
    done = train(run_paths, *two_nodes, env=env)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [line]


def test_an_unreachable_rendezvous_is_refused_in_one_line(run_paths):
    port = free_port()  # node 0 never comes up
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    done = train(run_paths, "topology.drafter_ranks=2", env={**env, "DFLASH_RENDEZVOUS_WAIT_S": "1"})
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"dflash: error: rendezvous 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) did not answer within 1s "
        "(Connection refused): start the node that hosts it first, check the address, and that the port is "
        "open between the nodes (DFLASH_RENDEZVOUS_WAIT_S sets the wait)"
    ]


def test_missing_training_data_names_the_mount(run_paths):
    done = train(run_paths, 'data.train_files=["/data/regenerated"]')
    assert done.returncode == 2
    assert errors(done) == [
        "entrypoint: error: training data (data.train_files) /data/regenerated does not exist in the "
        "container: mount it (compose: a volume onto /data/regenerated; docker run: -v HOST_PATH:/data/regenerated)"
    ]


def test_bad_config_stops_with_dflash_one_line_error(run_paths):
    done = train(run_paths, "train.lr=-1")
    assert done.returncode == 2
    assert errors(done) == ["dflash: error: override 'train.lr=-1': train.lr: must be > 0.0, got -1"]


def test_config_comes_from_dflash_config_when_not_given(run_paths):
    done = run_entrypoint(
        "datagen",
        "datagen.prompts=[]",
        f"datagen.output_dir={Path(run_paths['inductor']).parent / 'regenerated'}",
        env={"DFLASH_SKIP_DOCTOR": "1", "DFLASH_CONFIG": "configs/tiny.toml"},
    )
    assert launched(done)[:3] == ["dflash", "datagen", "configs/tiny.toml"]
    assert run_entrypoint("train", env={"DFLASH_SKIP_DOCTOR": "1"}).stderr.splitlines()[-1] == (
        "entrypoint: error: train needs a config: entrypoint.sh train CONFIG [section.field=value ...] "
        "(or set DFLASH_CONFIG)"
    )


def test_unknown_mode_is_usage_error():
    done = run_entrypoint("serve")
    assert done.returncode == 2
    assert errors(done) == [
        "entrypoint: error: unknown mode 'serve' (train, build-cache, datagen, eval, export, doctor, smoke, shell)"
    ]


@pytest.mark.slow  # two real `dflash doctor` runs: about 15 s of CPU
def test_doctor_drift_against_a_recorded_run_stops_the_job(run_paths, tmp_path):
    from app.env import collect_fingerprint, save_fingerprint

    fingerprint = collect_fingerprint()
    fingerprint["torch"]["version"] = "2.9.1+cu130"  # the incident: another torch build swapped in
    recorded = save_fingerprint(fingerprint, tmp_path / "fingerprint.json")

    done = train(run_paths, env={"DFLASH_SKIP_DOCTOR": "0", "DFLASH_DOCTOR_AGAINST": str(recorded)})
    assert done.returncode == 1
    assert "breaking differences" in done.stdout and "entrypoint: running:" not in done.stderr
    assert errors(done)[-1] == (
        "entrypoint: error: dflash doctor reported a breaking drift (above); "
        "fix the image or set DFLASH_SKIP_DOCTOR=1 to run anyway"
    )
