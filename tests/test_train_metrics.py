"""What training measures and shows (`app.train.metrics`), in one process without a model: the step
sums a window pools, the log line and record of a window (rates over its training time, pauses left
out), epoch progress, and the refusal of a non-finite loss or gradient naming the step and batches."""

from __future__ import annotations

import math
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from app.checkpoint.store import save_checkpoint
from app.data.batching import BatchPlanner, DataCursor, PlannedBatch
from app.data.shapes import TargetShapes, length_ladder
from app.model.objective import LossOutput
from app.pipeline.assignment import Round
from app.pipeline.counters import RankCounters
from app.pipeline.distributed import Runtime
from app.pipeline.roles import RankLayout
from app.pipeline.sidechannel import SideChannel
from app.pipeline.source import SourceStats
from app.telemetry.hardware import Peak
from app.telemetry.session import Telemetry
from app.train.metrics import (
    NonFiniteLoss,
    StepOutput,
    StepSums,
    TrainingMetrics,
    WindowSums,
    gather_window,
    rank_counters,
)

CPU = torch.device("cpu")
PLANNER = BatchPlanner(
    np.full(40, 64), shapes=TargetShapes(length_ladder(64, 32, 2), 256, 4), bucket_window=8, seed=0
)  # 40 samples of 64 tokens, 4 to a batch: 10 batches an epoch


class Records:
    """A reporter keeping each record it is handed."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def on_start(self, start) -> None:
        pass

    def on_log(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def on_checkpoint(self, path, step) -> None:
        pass

    def on_exit(self, reason, step) -> None:
        pass


def loss_output(
    loss: float, acc: float, streak: float, tree: tuple[float, float] | None = None
) -> LossOutput:
    return LossOutput(
        loss=torch.tensor(loss, dtype=torch.float64),
        acc=torch.tensor(acc),
        streak=torch.tensor(streak),
        noise=0.0,
        supervised_tokens=torch.tensor(8),
        tree_streak=None if tree is None else (torch.tensor(tree[0]), torch.tensor(tree[1])),
    )


def round_of(epoch: int, *indices: int, padded: int = 0) -> Round:
    batches = [PlannedBatch(epoch, index, [10 * index + k for k in range(4)]) for index in indices]
    return Round(epoch, indices[0], (*batches, *[None] * padded), DataCursor(epoch, indices[-1] + 1))


def step(
    outs: list[LossOutput], grad_norm: float, noise: float = 0.0, flops: float = 0.0, epoch: int = 0
) -> StepOutput:
    sums = StepSums.zeros(CPU)
    for out in outs:
        sums.add(out)
    return StepOutput(sums, noise, torch.tensor(grad_norm), round_of(epoch, len(outs)), torch.tensor(flops))


def metrics(
    records: Records,
    lines: list[str],
    *,
    noise: bool = True,
    peak: Peak | None = None,
    planner: BatchPlanner = PLANNER,
    total_steps: int = 10,
    runtime: Any = None,
) -> TrainingMetrics:
    """The metrics of a colocated run (no runtime), or of a split one's drafter (its runtime)."""
    return TrainingMetrics(
        Telemetry([records], [], lines.append),
        runtime=runtime,
        planner=planner,
        total_steps=total_steps,
        device=CPU,
        peak=peak,
        noise=noise,
        colocated=runtime is None,
    )


def test_a_step_sums_its_micro_batches_and_a_window_pools_its_steps():
    sums = StepSums.zeros(CPU)
    assert [float(v) for v in sums.packed()] == [0.0] * 6 and sums.loss.dtype == torch.float32
    sums.add(loss_output(1.0, 0.5, 1.0))
    sums.add(loss_output(2.0, 0.25, 3.0, tree=(6.0, 4.0)))
    sums.add(loss_output(0.5, 0.25, 2.0, tree=(1.0, 2.0)))
    assert sums.packed().tolist() == [3.5, 1.0, 6.0, 3.0, 7.0, 6.0]
    assert sums.packed().dtype == torch.float32
    other = step([loss_output(4.0, 1.0, 0.0)], grad_norm=1.0)
    window, counters = gather_window(
        None, [StepOutput(sums, 0.0, torch.tensor(1.0), None, None), other], RankCounters(1, 2, 3, 4, 5, [6])
    )  # type: ignore[arg-type]
    assert counters == [RankCounters(1, 2, 3, 4, 5, [6])]
    assert window.step_losses == pytest.approx([3.5 / 3, 4.0])
    assert window.mean(window.acc) == pytest.approx(2.0 / 4)  # per real batch of the window
    assert window.mean(window.streak, per=window.tree_blocks) == pytest.approx(6.0 / 6)
    assert window.tree_streak() == pytest.approx(7.0 / 6)
    empty = WindowSums.unpack(torch.zeros(2, 6))
    assert empty.step_losses == [0.0, 0.0] and empty.mean(empty.acc) == 0.0 and empty.tree_streak() is None


def test_rank_counters_carry_a_rank_s_source_stats():
    stats = SourceStats(
        target_batches=7,
        wait_seconds=1.2344,
        real_tokens=900,
        drafter_batches=5,
        q_pre=[1],
        q_hs=[2, 3],
        from_targets=[4, 1],
    )
    assert rank_counters(stats) == RankCounters(5, 900, 7, 5, 1234, [4, 1])
    assert rank_counters(SourceStats(wait_seconds=0.0016)).wait_ms == 2


def test_a_window_s_line_and_record_are_over_its_training_time_only():
    records, lines = Records(), []
    shown = metrics(records, lines, peak=Peak(1e-6, "test"))
    shown.start(2)  # resumed at step 2: the first window covers steps 3 and 4
    assert shown.window.step == 2 and shown.window.drafter_batches == 0
    shown.add(
        step([loss_output(1.0, 0.5, 1.0), loss_output(2.0, 0.7, 2.0)], grad_norm=1.0, noise=0.5, flops=1e6)
    )
    shown.add(step([loss_output(4.0, 0.9, 3.0, tree=(6.0, 4.0))], grad_norm=3.0, noise=0.25, flops=3e6))
    with shown.paused(evaluation=True):
        time.sleep(0.05)
    stats = SourceStats(target_batches=3, wait_seconds=0.5, real_tokens=300, drafter_batches=3)
    assert shown.log(4, DataCursor(1, 5), stats, lr=1e-3) == [1.5, 4.0]
    (record,) = records.records
    training_s = record["window_s"] - record["paused_s"]
    assert record["paused_s"] >= 0.05 and training_s > 0 and record["evaluated"] is True
    assert record["elapsed_s"] >= record["window_s"] and record["elapsed_s"] < 60
    assert (record["step"], record["total_steps"], record["lr"], record["noise"]) == (4, 10, 1e-3, 0.25)
    assert record["loss"] == pytest.approx(2.75)  # the mean of the steps' losses
    assert record["acc"] == pytest.approx(0.7) and record["streak"] == pytest.approx(2.0)
    assert record["tree_streak"] == pytest.approx(1.5)
    assert record["target_batches_per_s"] == pytest.approx(3 / training_s)
    assert record["drafter_batches_per_s"] == pytest.approx(3 / training_s)
    assert record["tokens_per_s"] == pytest.approx(300 / training_s)
    assert record["eta_s"] == pytest.approx(6 * training_s / 2)  # 6 steps left at the window's 2 steps
    assert record["tflops_per_s"] == 4e6 / training_s / 1e12
    assert record["mfu"] == pytest.approx(4e6 / training_s / 1e6)
    assert record["epoch_progress"] == pytest.approx(1.5) and record["memory_gb"] is None
    assert (record["q_pre"], record["q_hs"], record["colocated"]) == ([0], [0], True)
    assert record["grad_norm"] == pytest.approx(2.0) and record["step_losses"] == [1.5, 4.0]
    assert record["drafter_batch_counts"] == [3] and record["target_batch_counts"] == [3]
    assert record["feature_wait_s"] == [0.5] and record["events"] == []
    assert record["target_forward_s"] == [] and record["target_library_jit"] == []
    (line,) = lines
    assert " step=4/10 loss=2.7500 acc=0.700 streak=2.00 tree_streak=1.50 lr=0.001 noise=0.2500 " in line
    # the next window: its rates count only what happened since, and the pause was the last window's
    shown.add(step([loss_output(2.0, 0.5, 1.0)], grad_norm=2.0, noise=0.125, flops=2e6))
    stats = SourceStats(target_batches=5, wait_seconds=0.75, real_tokens=420, drafter_batches=4)
    assert shown.log(5, DataCursor(2, 0), stats, lr=5e-4) == [2.0]
    second = records.records[1]
    training_s = second["window_s"] - second["paused_s"]
    assert second["paused_s"] == 0.0 and second["evaluated"] is False and second["tree_streak"] is None
    assert second["target_batches_per_s"] == pytest.approx(2 / training_s)
    assert second["drafter_batches_per_s"] == pytest.approx(1 / training_s)
    assert second["tokens_per_s"] == pytest.approx(120 / training_s)
    assert second["eta_s"] == pytest.approx(5 * training_s)
    assert second["epoch_progress"] == 2.0 and second["noise"] == 0.125
    assert second["elapsed_s"] > record["elapsed_s"] and second["window_s"] < second["elapsed_s"]
    assert shown.log(6, DataCursor(2, 1), stats, lr=5e-4) == []  # no step since: no window
    assert len(records.records) == 2


def test_a_run_without_noise_or_peak_shows_neither():
    records, lines = Records(), []
    quiet = metrics(records, lines, noise=False)
    quiet.add(step([loss_output(1.0, 0.5, 1.0)], grad_norm=1.0, noise=0.5))
    with quiet.paused():
        pass
    quiet.log(1, DataCursor(0, 3), SourceStats(drafter_batches=1), lr=1e-3)
    (record,) = records.records
    assert record["noise"] is None and record["mfu"] is None and record["evaluated"] is False
    assert record["epoch_progress"] == pytest.approx(0.3) and "noise=" not in lines[0]


def test_epoch_progress_is_the_share_of_the_epoch_s_batches_trained():
    progress = metrics(Records(), []).epoch_progress
    assert len(PLANNER.plan(3)) == 10
    assert progress(DataCursor(3, 0)) == 3.0
    assert progress(DataCursor(3, 4)) == pytest.approx(3.4)
    assert progress(DataCursor(3, 1)) == pytest.approx(3.1)
    assert progress(DataCursor(0, 10)) == 1.0


def test_a_non_finite_loss_or_gradient_stops_at_its_step_naming_its_batches(tmp_path: Path):
    watched = metrics(Records(), [])
    watched.refuse_non_finite(3)  # nothing pending: nothing to check
    watched.add(step([loss_output(1.0, 0.5, 1.0)], grad_norm=1.0))
    bad = StepSums.zeros(CPU)
    bad.add(loss_output(1.0, 0.5, 1.0))
    many = round_of(2, *range(3, 13), padded=2)
    watched.add(StepOutput(bad, 0.0, torch.tensor(math.inf), many, torch.tensor(0.0)))
    watched.add(step([loss_output(1.0, 0.5, 1.0)], grad_norm=math.nan))
    with pytest.raises(NonFiniteLoss) as caught:
        watched.refuse_non_finite(7)  # the pending steps are 5, 6 and 7
    assert caught.value.step == 6 and caught.value.round is many
    assert str(caught.value) == (
        "non-finite loss at step 6 (epoch 2, batches 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, "
        "samples [30, 31, 32, 33, 40, 41, 42, 43]...)"
    )
    with pytest.raises(NonFiniteLoss) as caught:  # the log line refuses it too, before anything is shown
        watched.log(7, DataCursor(0, 1), SourceStats(), lr=1e-3)
    assert caught.value.step == 6
    lossy = metrics(Records(), [])
    lossy.add(step([loss_output(1.0, 0.5, 1.0)], grad_norm=1.0))
    lossy.add(step([loss_output(math.nan, 0.5, 1.0)], grad_norm=1.0))
    with pytest.raises(NonFiniteLoss) as caught:
        lossy.log(2, DataCursor(0, 1), SourceStats(), lr=1e-3)
    assert caught.value.step == 2
    assert str(caught.value) == "non-finite loss at step 2 (epoch 0, batch 1, samples [10, 11, 12, 13])"
    assert str(caught.value.resuming_from(tmp_path)) == (
        "non-finite loss at step 2 (epoch 0, batch 1, samples [10, 11, 12, 13]); no checkpoint was written: "
        "start the run again with a lower train.lr, or inspect those samples"
    )
    save_checkpoint(tmp_path, 1, {"w": torch.zeros(1)}, {}, {}, {}, keep_last=2)
    again = caught.value.resuming_from(tmp_path)
    assert again.step == 2 and again.round is caught.value.round
    assert str(again).endswith(
        f"; resume from {tmp_path / 'checkpoints' / 'step_00000001'} with a lower train.lr, or inspect those samples"
    )
    eight = NonFiniteLoss(1, round_of(0, 0, 1))
    assert (
        str(eight)
        == "non-finite loss at step 1 (epoch 0, batches 0, 1, samples [0, 1, 2, 3, 10, 11, 12, 13])"
    )


def split_runtime(rank: int, drafter_ranks: tuple[int, ...], side: SideChannel) -> Runtime:
    """A split job's drafter rank: target rank 0 feeds it; no collective is ever called (one drafter,
    or no drafter group), so no process group is made."""
    layout = RankLayout(rank, 1 + len(drafter_ranks), rank, 1 + len(drafter_ranks), (0,), drafter_ranks)
    return Runtime(layout, CPU, None, None, None, None, side, None, 60.0)  # type: ignore[arg-type]


def test_a_split_drafter_shows_the_targets_batches_as_received_and_their_reported_queues():
    side = SideChannel(dist.HashStore())
    side.publish_target_stats(0, {"q_pre": 3, "forward_s": 1.5, "library_jit": 2})
    records, lines = Records(), []
    shown = metrics(records, lines, noise=False, runtime=split_runtime(1, (1,), side))
    shown.add(step([loss_output(1.0, 0.5, 1.0)], grad_norm=1.0))
    stats = SourceStats(wait_seconds=0.25, real_tokens=64, drafter_batches=1, q_hs=[2], from_targets=[5])
    assert shown.log(1, DataCursor(0, 1), stats, lr=1e-3) == [1.0]
    (record,) = records.records
    training_s = record["window_s"] - record["paused_s"]
    assert record["target_batch_counts"] == [5] and record["q_pre"] == [3] and record["q_hs"] == [2]
    assert record["target_forward_s"] == [1.5] and record["target_library_jit"] == [2]
    assert (
        record["target_batches_per_s"] == 5 / training_s and record["drafter_batches_per_s"] == 1 / training_s
    )
    assert record["colocated"] is False and record["noise"] is None


def test_a_drafter_that_is_not_the_logger_reports_nothing_but_returns_its_losses():
    records = Records()
    lines: list[str] = []
    quiet = metrics(
        records, lines, noise=False, runtime=split_runtime(2, (1, 2), SideChannel(dist.HashStore()))
    )
    assert quiet.is_logger is False
    quiet.add(step([loss_output(3.0, 0.5, 1.0)], grad_norm=1.0))
    quiet.add(step([loss_output(1.0, 0.5, 1.0), loss_output(2.0, 0.5, 1.0)], grad_norm=1.0))
    # no drafter group (drafter_control None): the window is this rank's own, not gathered
    assert quiet.log(2, DataCursor(0, 2), SourceStats(drafter_batches=3, from_targets=[3]), lr=1e-3) == [
        3.0,
        1.5,
    ]
    assert records.records == [] and lines == [] and quiet.pending == []
    assert quiet.window.step == 2 and quiet.window.drafter_batches == 3 and quiet.window.target_batches == 3


def test_a_window_from_the_start_counts_from_step_0_and_a_single_batch_is_its_own_mean():
    records, lines = Records(), []
    fresh = metrics(records, lines)  # never `start`ed: the window opens at step 0 with nothing counted
    fresh.add(step([loss_output(1.0, 0.5, 1.0)], grad_norm=1.0))
    fresh.add(step([loss_output(2.0, 0.5, 1.0)], grad_norm=1.0))
    stats = SourceStats(target_batches=2, real_tokens=128, drafter_batches=2)
    fresh.log(2, DataCursor(0, 2), stats, lr=1e-3)
    (record,) = records.records
    training_s = record["window_s"] - record["paused_s"]
    assert record["eta_s"] == 8 * training_s / 2
    assert (
        record["target_batches_per_s"] == 2 / training_s and record["drafter_batches_per_s"] == 2 / training_s
    )
    assert record["tokens_per_s"] == 128 / training_s
    one = WindowSums.unpack(torch.tensor([[2.0, 0.75, 3.0, 1.0, 0.0, 0.0]]))
    assert one.mean(one.acc) == 0.75 and one.mean(one.streak) == 3.0 and one.step_losses == [2.0]


def test_the_sums_live_on_the_step_s_device_and_nine_samples_are_cut_to_eight():
    assert {getattr(StepSums.zeros(torch.device("meta")), f.name).device.type for f in fields(StepSums)} == {
        "meta"
    }
    nine = Round(
        0, 0, (PlannedBatch(0, 0, list(range(5))), PlannedBatch(0, 1, list(range(5, 9)))), DataCursor(0, 2)
    )
    assert (
        str(NonFiniteLoss(3, nine))
        == "non-finite loss at step 3 (epoch 0, batches 0, 1, samples [0, 1, 2, 3, 4, 5, 6, 7]...)"
    )


def test_epoch_progress_of_a_one_batch_epoch():
    single = BatchPlanner(np.full(4, 64), shapes=TargetShapes((64,), 256, 4), bucket_window=8, seed=0)
    assert len(single.plan(0)) == 1
    progress = metrics(Records(), [], noise=False, planner=single, total_steps=4).epoch_progress
    assert progress(DataCursor(0, 1)) == 1.0 and progress(DataCursor(2, 0)) == 2.0
