"""`dflash bench pipeline` on CPU: a real 1 target + 1 drafter torchrun job (gloo) over two nodes (one
bench per node, two torchrun agents joined by a c10d rendezvous on 127.0.0.1) against its stages
alone, read back from the run's own metrics. One node's topology is the same code with `--standalone`
(tests/test_launch.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.pipeline import format_report, read_train_records, steady_state
from app.errors import UserError
from tests.datagen_server import free_port
from tests.helpers import SMALL, run_dflash
from tests.jobs import child_environment

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12


@pytest.fixture(scope="module")
def split_report(tiny_lm_dir, tiny_conversations, tmp_path_factory):
    """The report of the node that ran drafter rank 0, the bench's work dir, and each node's output."""
    overrides = [
        *SMALL,
        f"data.train_files=['{tiny_conversations}']",
        "topology.target_ranks=1",
        "topology.drafter_ranks=1",
        "topology.nnodes=2",
        "topology.nproc_per_node=1",
        "topology.prefetch_batches=1",  # short queues: the target cannot finish ahead of the window
        "topology.feature_queue=1",
        "telemetry.log_every=2",
        "telemetry.warmup_steps=2",
    ]
    workdir = tmp_path_factory.mktemp("bench")
    rendezvous = {"NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "RDZV_ID": workdir.name}
    command = [
        sys.executable,
        "-m",
        "app",
        "bench",
        "pipeline",
        str(ROOT / "configs" / "tiny.toml"),
        *overrides,
    ]
    command += ["--steps", str(STEPS), "--workdir", str(workdir)]
    environment = {**child_environment(), **rendezvous}
    nodes = [
        subprocess.Popen(
            [*command, "--out", str(workdir / f"node{node}.json")],
            cwd=ROOT,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=900)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(output[-3000:] for output in outputs)
    reports = [json.loads(path.read_text()) for path in sorted(workdir.glob("node*.json"))]
    assert len(reports) == 1, outputs  # one node ran drafter rank 0, which logs
    return reports[0], workdir, outputs


def test_split_pipeline_report(split_report) -> None:
    report, workdir, outputs = split_report
    steady, stages, capacity = report["pipeline"], report["stages"], report["capacity"]
    # Log lines at steps 2, 4, ..., 12; after warm-up (step 2) the window runs from step 4 to step 12.
    assert steady["steps"] == [4, STEPS] and steady["drafter_batches_per_rank"] == [STEPS - 4]
    # Target batch counts are the drafters' receipts: both roles move the same batches.
    assert steady["target_batches_per_s"] == pytest.approx(steady["drafter_batches_per_s"])
    assert len(steady["q_pre"]) == 1 and len(steady["q_hs"]) == 1
    # The target's forward seconds are sampled when the logging rank reads them, up to a batch stale
    # (~20 ms here): over this sub-second window that can put a busy target a few percent above 1.
    assert 0 < steady["target_busy"][0] <= 1.2 and 0 <= steady["drafter_waiting"][0] <= 1
    assert stages["device"] == "cpu" and stages["target_forward_s"] > 0 and stages["drafter_step_s"] > 0
    assert stages["target_forward_full_batch_s"] > 0 and stages["host_prepare_s"] > 0
    assert stages["compile"]["compiled"] is False
    assert set(capacity["batches_per_s"]) == {"target", "drafter"}
    slowest = min(capacity["batches_per_s"].values())
    assert capacity["efficiency"] == pytest.approx(steady["drafter_batches_per_s"] / slowest)

    text = format_report(report)
    assert text.startswith("pipeline 1 target + 1 drafter ranks on 2 nodes") and "efficiency: " in text
    assert "host preparation " in text
    assert "target ranks in their forward: [" in text
    assert text.splitlines()[0] in "".join(outputs)  # printed by the node that reports
    elsewhere = (
        "bench pipeline: this node's ranks are done; the report is printed on the node of drafter rank 0"
    )
    assert sum(elsewhere in output for output in outputs) == 1
    run_dirs = list(workdir.glob("pipeline-*"))
    assert len(run_dirs) == 2 and all((run_dir / "torchrun.log").stat().st_size > 0 for run_dir in run_dirs)
    assert sum((run_dir / "status.json").is_file() for run_dir in run_dirs) == 1


def test_too_few_log_lines_after_warm_up_is_a_usage_error(split_report) -> None:
    _, workdir, _ = split_report
    (run_dir,) = [run_dir for run_dir in workdir.glob("pipeline-*") if (run_dir / "metrics.jsonl").exists()]
    records = read_train_records(run_dir / "metrics.jsonl")
    with pytest.raises(
        UserError,
        match=r"1 log lines after telemetry.warmup_steps=10 \(the run logged steps 2-12\); raise --steps",
    ):
        steady_state(records, warmup_steps=10)


def test_a_multi_node_bench_without_the_jobs_rendezvous_is_refused_in_one_line(tmp_path) -> None:
    """Refused before anything runs, naming the variables each node needs."""
    overrides = ["topology.nnodes=2", "topology.nproc_per_node=1", "topology.drafter_ranks=2"]
    done = run_dflash(
        "bench", "pipeline", "configs/tiny.toml", *overrides, "--workdir", str(tmp_path / "bench")
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "dflash: error: topology.nnodes is 2: set RDZV_ENDPOINT=host:port (or MASTER_ADDR, MASTER_PORT and "
        "NODE_RANK) on every node"
    ]
    assert not (tmp_path / "bench").exists()
