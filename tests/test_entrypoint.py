"""entrypoint.sh on the host (the image runs the same script): torchrun from the config, guard rails.

DFLASH_DRY_RUN=1 stops each run after the checks, at the command it would exec; the image tests run
it for real inside the container.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = ROOT / "entrypoint.sh"


def run_entrypoint(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {
        key: value
        for key, value in os.environ.items()
        if key not in {"NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT", "DFLASH_CONFIG"}
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
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29600"}
    command = launched(train(run_paths, "topology.drafter_ranks=2", env=env))
    assert command[:11] == [
        *("torchrun", "--nnodes", "2", "--nproc-per-node", "1"),
        *("--node-rank", "1", "--master-addr", "10.0.0.7", "--master-port", "29600"),
    ]
    assert command[-1] == "topology.nnodes=2"  # the trainer sees the same node count as torchrun


def test_multi_node_c10d_rendezvous_and_extra_torchrun_args(run_paths):
    env = {"NNODES": "2", "RDZV_ENDPOINT": "head:29400", "DFLASH_TORCHRUN_ARGS": "--max-restarts 2"}
    command = launched(train(run_paths, "topology.drafter_ranks=2", env=env))
    assert command[:13] == [
        *("torchrun", "--nnodes", "2", "--nproc-per-node", "1"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400", "--rdzv-id", "dflash"),
        *("--max-restarts", "2"),
    ]


def test_multi_node_without_a_rendezvous_is_refused(run_paths):
    done = train(run_paths, "topology.drafter_ranks=2", env={"NNODES": "2"})
    assert done.returncode == 2
    assert errors(done) == [
        "entrypoint: error: topology.nnodes is 2: set RDZV_ENDPOINT=host:port "
        "(or MASTER_ADDR, MASTER_PORT and NODE_RANK) on every node"
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
