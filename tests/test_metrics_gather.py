"""A log window gathered over two drafter processes (`app.train.metrics.gather_window` and the metrics
component's log), in a real gloo job of three processes on CPU (a target rank and two drafters, which
gather over their own group): what only a job of several drafters runs, checked without torchrun or a
model, so that a mutation run sees it."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from app.data.batching import DataCursor
from app.pipeline.counters import RankCounters
from app.pipeline.distributed import Runtime
from app.pipeline.roles import RankLayout
from app.pipeline.sidechannel import SideChannel
from app.pipeline.source import SourceStats
from app.train.metrics import StepOutput, StepSums, gather_window

REPO = Path(__file__).resolve().parents[1]
STEPS = 3


def rank_sums(rank: int, step: int) -> list[float]:
    """Step `step`'s packed sums on drafter `rank`, each field its own value (loss, acc, streak,
    batches, tree_accepted, tree_blocks), so a swapped field, step or rank shows."""
    return [
        100.0 * (rank + 1) + step,
        10.0 + rank + step,
        20.0 + 2 * rank,
        1.0 + rank,
        3.0 * step,
        1.0 + step,
    ]


def rank_counts(rank: int) -> RankCounters:
    base = 1 + 10 * rank
    return RankCounters(base, base + 1, base + 2, base + 3, base + 4, [base + 5, base + 6])


def step_output(values: list[float]) -> StepOutput:
    sums = StepSums(*(torch.tensor(value) for value in values))
    return StepOutput(sums, 0.0, torch.tensor(1.0), None, torch.tensor(0.0))  # type: ignore[arg-type]


def drafter_runtime(rank: int, drafters: dist.ProcessGroup) -> Runtime:
    """Drafter `rank - 1` of a split job: target rank 0 and drafter ranks 1 and 2."""
    layout = RankLayout(rank, 3, rank, 3, (0,), (1, 2))
    side = SideChannel(dist.HashStore())
    return Runtime(layout, torch.device("cpu"), None, None, None, drafters, side, None, 60.0)  # type: ignore[arg-type]


def gather_on_rank(rank: int, store: str) -> dict:
    """One of the three processes. A drafter gathers the window directly, then through the metrics
    component's log (the logging drafter and the other); the target rank only joins the groups."""
    from tests.test_train_metrics import Records, metrics

    dist.init_process_group(  # a partner that died leaves this one waiting a minute, not half an hour
        "gloo", init_method=f"file://{store}", rank=rank, world_size=3, timeout=timedelta(seconds=60)
    )
    try:
        drafters = dist.new_group([1, 2])
        if rank == 0:
            dist.barrier()
            return {}
        drafter = rank - 1
        runtime = drafter_runtime(rank, drafters)
        pending = [step_output(rank_sums(drafter, step)) for step in range(STEPS)]
        window, counters = gather_window(runtime, pending, rank_counts(drafter))
        records: Records = Records()
        shown = metrics(records, [], noise=False, runtime=runtime)
        for step in range(STEPS):
            shown.pending.append(step_output(rank_sums(drafter, step)))
        stats = SourceStats(
            drafter_batches=1 + drafter, real_tokens=64 * (1 + drafter), from_targets=[1 + drafter]
        )
        losses = shown.log(STEPS, DataCursor(0, STEPS), stats, lr=1e-3)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {
        "fields": [tensor.tolist() for tensor in vars(window).values()],
        "dtype": str(window.loss.dtype),
        "counters": [vars(counter) for counter in counters],
        "losses": losses,
        "logged": len(records.records),
        "drafted": shown.window.drafter_batches,
        "tokens": shown.window.real_tokens,
        "target_batches": shown.window.target_batches,
    }


def run_two_drafters(tmp_path: Path) -> list[dict]:
    """Drafter 0 (rank 1) in this process, so that a mutation run, which follows only this process's
    calls, sees what the gathering runs; the target (rank 0) and drafter 1 (rank 2) in children."""
    code = (
        "import json, sys; from tests.test_metrics_gather import gather_on_rank; "
        "print(json.dumps(gather_on_rank(int(sys.argv[1]), sys.argv[2])))"
    )
    store = str(tmp_path / "store")
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), store],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 2)
    ]
    try:
        first = gather_on_rank(1, store)
    finally:
        outputs = [child.communicate(timeout=120) for child in children]
    for child, (_, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err[-3000:]
    return [first, json.loads(outputs[1][0].strip().splitlines()[-1])]


def test_two_drafters_gather_one_window_summed_step_by_step_and_every_rank_s_counters(tmp_path: Path) -> None:
    first, second = run_two_drafters(tmp_path)
    expected = [
        [sum(rank_sums(rank, step)[field] for rank in (0, 1)) for step in range(STEPS)] for field in range(6)
    ]
    for shown in (first, second):  # alike on every drafter rank
        assert shown["fields"] == expected
        assert shown["dtype"] == "torch.float32"
        assert shown["counters"] == [vars(rank_counts(0)), vars(rank_counts(1))]  # in drafter order
        # the component's window: each step's loss over both ranks' batches, not this rank's alone
        assert shown["losses"] == pytest.approx(
            [expected[0][step] / expected[3][step] for step in range(STEPS)]
        )
        assert shown["drafted"] == 1 + 2 and shown["tokens"] == 64 + 128
        assert shown["target_batches"] == 1 + 2  # target 0's batches as both drafters received them
    assert first["logged"] == 1 and second["logged"] == 0  # drafter 0 reports, drafter 1 does not
