"""`dflash bench pipeline` on CPU: a real 1 target + 1 drafter torchrun job (gloo) against its stages
alone, read back from the run's own metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.bench.pipeline import format_report, read_train_records, run_pipeline_bench, steady_state
from app.errors import UserError
from tests.helpers import SMALL, run_dflash

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12


@pytest.fixture(scope="module")
def split_report(tiny_lm_dir, tiny_conversations, tmp_path_factory):
    overrides = [
        *SMALL,
        f"data.train_files=['{tiny_conversations}']",
        "topology.target_ranks=1",
        "topology.drafter_ranks=1",
        "topology.nproc_per_node=2",
        "topology.prefetch_batches=1",  # short queues: the target cannot finish ahead of the window
        "topology.feature_queue=1",
        "telemetry.log_every=2",
        "telemetry.warmup_steps=2",
    ]
    workdir = tmp_path_factory.mktemp("bench")
    return run_pipeline_bench(str(ROOT / "configs" / "tiny.toml"), overrides, STEPS, workdir), workdir


def test_split_pipeline_report(split_report) -> None:
    report, workdir = split_report
    steady, stages, capacity = report["pipeline"], report["stages"], report["capacity"]
    # Log lines at steps 2, 4, ..., 12; after warm-up (step 2) the window runs from step 4 to step 12.
    assert steady["steps"] == [4, STEPS] and steady["drafter_batches_per_rank"] == [STEPS - 4]
    # Target batch counts are the drafters' receipts: both roles move the same batches.
    assert steady["target_batches_per_s"] == pytest.approx(steady["drafter_batches_per_s"])
    assert len(steady["q_pre"]) == 1 and len(steady["q_hs"]) == 1
    assert 0 < steady["target_busy"][0] <= 1 and 0 <= steady["drafter_waiting"][0] <= 1
    assert stages["device"] == "cpu" and stages["target_forward_s"] > 0 and stages["drafter_step_s"] > 0
    assert stages["target_forward_full_batch_s"] > 0
    assert stages["compile"]["compiled"] is False
    assert set(capacity["batches_per_s"]) == {"target", "drafter"}
    slowest = min(capacity["batches_per_s"].values())
    assert capacity["efficiency"] == pytest.approx(steady["drafter_batches_per_s"] / slowest)

    text = format_report(report)
    assert text.startswith("pipeline 1 target + 1 drafter ranks") and "efficiency: " in text
    assert "target ranks in their forward: [" in text
    (run_dir,) = workdir.glob("pipeline-*")
    assert (run_dir / "torchrun.log").stat().st_size > 0 and (run_dir / "status.json").is_file()


def test_too_few_log_lines_after_warm_up_is_a_usage_error(split_report) -> None:
    _, workdir = split_report
    (run_dir,) = workdir.glob("pipeline-*")
    records = read_train_records(run_dir / "metrics.jsonl")
    with pytest.raises(
        UserError,
        match=r"1 log lines after telemetry.warmup_steps=10 \(the run logged steps 2-12\); raise --steps",
    ):
        steady_state(records, warmup_steps=10)


def test_a_multi_node_topology_is_refused_in_one_line() -> None:
    overrides = ["topology.nnodes=2", "topology.nproc_per_node=1", "topology.drafter_ranks=2"]
    done = run_dflash("bench", "pipeline", "configs/tiny.toml", *overrides)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "dflash: error: bench pipeline: topology.nnodes must be 1 (the benchmark runs one node's ranks)"
    ]
