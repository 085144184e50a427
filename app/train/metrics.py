"""What training measures and shows: one component per drafter rank, built once by the trainer.

The trainer hands it each step's metrics, still on the device, and calls it at the loop's fixed
points; everything about the log line lives here, so the loop reads like the algorithm. It owns the
log window (the steps since the previous line), their gathering over the drafter ranks (one host
sync per line, not per step), the non-finite reads (a non-finite loss or gradient norm stops the run
at a log line or before a save, never checkpointed), epoch progress and the time spent not training.
Only the logging rank prints and reports; every drafter rank gathers, as the gathering is collective.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist

from app.checkpoint.store import checkpoint_root, latest_checkpoint
from app.data.batching import BatchPlanner, DataCursor
from app.errors import JobFailed
from app.model.objective import LossOutput
from app.pipeline.assignment import Round
from app.pipeline.counters import RankCounters, target_view
from app.pipeline.distributed import Runtime
from app.pipeline.source import SourceStats
from app.telemetry.hardware import Peak, device_memory_gb, utilization
from app.telemetry.logline import LogLine
from app.telemetry.session import Telemetry


class NonFiniteLoss(JobFailed):
    """The loss became NaN/inf: the run stops, naming the step and the batches that did it; the rank
    that ran the trainer adds where the run can go on from (`resuming_from`)."""

    def __init__(self, step: int, round_: Round, advice: str = "") -> None:
        self.step, self.round = step, round_
        samples = [sample for batch in round_.real for sample in batch.sample_ids]
        indices = [batch.index for batch in round_.real]
        super().__init__(
            f"non-finite loss at step {step} (epoch {round_.epoch}, batch{'es' if len(indices) > 1 else ''} "
            f"{', '.join(map(str, indices))}, samples {samples[:8]}{'...' if len(samples) > 8 else ''})"
            + (f"; {advice}" if advice else "")
        )

    def resuming_from(self, run_dir: Path) -> NonFiniteLoss:
        """The same failure, advising the checkpoint the run in `run_dir` resumes from (its newest; none
        written: the run starts again)."""
        checkpoint = latest_checkpoint(checkpoint_root(run_dir))
        where = (
            f"resume from {checkpoint}" if checkpoint else "no checkpoint was written: start the run again"
        )
        return NonFiniteLoss(
            self.step, self.round, f"{where} with a lower train.lr, or inspect those samples"
        )


@dataclass
class Sums:
    """The metrics a step sums over its real micro-batches, one field each, in the order they cross the
    drafter group; a step holds them 0-d (`StepSums`), a log window `[steps]` (`WindowSums`)."""

    loss: torch.Tensor
    acc: torch.Tensor
    streak: torch.Tensor
    batches: torch.Tensor
    """Real micro-batches summed (the divisor of the three above)."""
    tree_accepted: torch.Tensor
    """Leading slots on a path of the tree, over the blocks sampled (log steps only, else 0)."""
    tree_blocks: torch.Tensor


class StepSums(Sums):
    """Sums over one optimizer step's real micro-batches of this rank, 0-d float32 on the device."""

    @classmethod
    def zeros(cls, device: torch.device) -> StepSums:
        return cls(*(torch.zeros((), device=device) for _ in fields(cls)))

    def add(self, out: LossOutput) -> None:
        """Add one real micro-batch's loss and metrics (on the device: no host sync)."""
        self.loss += out.loss.detach().float()
        self.acc += out.acc.float()
        self.streak += out.streak.float()
        self.batches += 1
        if out.tree_streak is not None:
            self.tree_accepted += out.tree_streak[0]
            self.tree_blocks += out.tree_streak[1]

    def packed(self) -> torch.Tensor:
        """`[len(fields)]`, in field order: what crosses the drafter group in one collective."""
        return torch.stack([getattr(self, f.name) for f in fields(self)])


@dataclass
class StepOutput:
    """One optimizer step's metrics, still on the device (read on log steps and before saves only)."""

    sums: StepSums
    noise: float
    grad_norm: torch.Tensor
    round: Round
    flops: torch.Tensor
    """Useful FLOPs of this rank's real micro-batches (`app.model.flops`), on the device."""


class WindowSums(Sums):
    """A log window's step sums over every drafter rank: `[steps]` float32 per field."""

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> WindowSums:
        """From `[steps, len(fields)]` (`StepSums.packed` of each step, stacked)."""
        return cls(*packed.unbind(dim=1))

    @property
    def step_losses(self) -> list[float]:
        return (self.loss / self.batches.clamp_min(1)).tolist()

    def mean(self, values: torch.Tensor, per: torch.Tensor | None = None) -> float:
        """Mean of `values` over every real batch of the window (or every unit of `per`)."""
        per = self.batches if per is None else per
        return float(values.sum() / per.sum().clamp_min(1))

    def tree_streak(self) -> float | None:
        """The window's tree streak per sampled block; None when no step of it measured one."""
        return self.mean(self.tree_accepted, per=self.tree_blocks) if float(self.tree_blocks.sum()) else None


def gather_window(
    runtime: Runtime | None, pending: list[StepOutput], mine: RankCounters
) -> tuple[WindowSums, list[RankCounters]]:
    """Sum the window's step sums over the drafter group and collect every rank's counters (in
    drafter order). Collective over `drafter_control`: every drafter rank calls it on the same steps
    (they are in lockstep). One process: no communication."""
    totals = torch.stack([out.sums.packed() for out in pending]).float().cpu()
    if runtime is None or runtime.drafter_control is None or runtime.layout.num_drafters == 1:
        return WindowSums.unpack(totals), [mine]
    steps, width = totals.shape
    packed = torch.cat([totals.double().flatten(), mine.as_tensor()])
    gathered = [torch.empty_like(packed) for _ in range(runtime.layout.num_drafters)]
    dist.all_gather(gathered, packed, group=runtime.drafter_control)
    summed = torch.stack([g[: steps * width].view(steps, width) for g in gathered]).sum(dim=0).float()
    return WindowSums.unpack(summed), [RankCounters.from_tensor(g[steps * width :]) for g in gathered]


def rank_counters(stats: SourceStats) -> RankCounters:
    return RankCounters(
        stats.drafter_batches,
        stats.real_tokens,
        stats.target_batches,
        sum(stats.q_hs),
        round(stats.wait_seconds * 1000),
        stats.from_targets,
    )


@dataclass
class Window:
    """Totals over ranks at the previous log line; the line's rates are over the window since then."""

    started: float
    step: int
    drafter_batches: int
    real_tokens: int
    target_batches: int


class TrainingMetrics:
    """One drafter rank's log window, from the first step this process trains to the last."""

    def __init__(
        self,
        telemetry: Telemetry,
        *,
        runtime: Runtime | None,
        planner: BatchPlanner,
        total_steps: int,
        device: torch.device,
        peak: Peak | None,
        noise: bool,
        colocated: bool,
    ) -> None:
        self.telemetry = telemetry
        self.runtime = runtime
        self.is_logger = runtime is None or runtime.layout.is_logger
        self.planner = planner
        self.total_steps = total_steps
        self.device = device
        self.peak = peak
        self.noise = noise
        self.colocated = colocated
        self.pending: list[StepOutput] = []
        self.paused_s = 0.0
        self.evaluated = False
        self.started = time.monotonic()
        self.window = Window(self.started, 0, 0, 0, 0)

    def start(self, step: int) -> None:
        """Training starts (or resumes) at `step`; this process's counters start at 0."""
        self.started = time.monotonic()
        self.window = Window(self.started, step, 0, 0, 0)

    def add(self, out: StepOutput) -> None:
        self.pending.append(out)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @contextmanager
    def paused(self, evaluation: bool = False) -> Iterator[None]:
        """Time spent not training (an eval, a checkpoint's host copy): the line's rates, mfu and ETA
        are over the window's training time only, so an eval reads as a pause, not a slowdown. An
        `evaluation` also marks the window's record (`evaluated`): the memory it reserved is the eval's."""
        self.evaluated |= evaluation
        started = time.monotonic()
        try:
            yield
        finally:
            self.paused_s += time.monotonic() - started

    def refuse_non_finite(self, step: int) -> None:
        """Stop at the first of the steps not yet checked whose loss or gradient norm is not finite. It
        reads them from the device: only where the loop synchronises anyway (a log line, a save)."""
        if not self.pending:
            return
        losses = torch.stack([out.sums.loss for out in self.pending])
        norms = torch.stack([out.grad_norm.float() for out in self.pending])
        first_step = step - len(self.pending) + 1
        for offset, finite in enumerate((torch.isfinite(losses) & torch.isfinite(norms)).tolist()):
            if not finite:
                raise NonFiniteLoss(first_step + offset, self.pending[offset].round)

    def log(self, step: int, cursor: DataCursor, stats: SourceStats, lr: float) -> list[float]:
        """Close the window at `step`: gather it over the drafter ranks, print and report the line on the
        logging rank; the window's per-step losses (every rank)."""
        if not self.pending:
            return []
        pending, window = self.pending, self.window
        sums, counters = self._gather(step, stats)
        now = time.monotonic()
        targets = target_view(self.runtime, counters, reader=self.is_logger)
        drafted = sum(c.drafter_batches for c in counters)
        self.window = Window(now, step, drafted, sum(c.real_tokens for c in counters), targets.total)
        if not self.is_logger:
            return sums.step_losses
        seconds = now - window.started
        training_s = max(seconds - self.paused_s, 1e-9)  # an eval or a save is no slower training
        flops = float(torch.stack([out.flops for out in pending]).sum())
        losses = sums.step_losses
        line = LogLine(
            elapsed_s=now - self.started,
            step=step,
            total_steps=self.total_steps,
            loss=sum(losses) / len(losses),
            acc=sums.mean(sums.acc),
            streak=sums.mean(sums.streak),
            tree_streak=sums.tree_streak(),
            lr=lr,
            noise=pending[-1].noise if self.noise else None,
            target_batches_per_s=(targets.total - window.target_batches) / training_s,
            drafter_batches_per_s=(drafted - window.drafter_batches) / training_s,
            tokens_per_s=(self.window.real_tokens - window.real_tokens) / training_s,
            q_pre=targets.q_pre,
            q_hs=[c.q_hs for c in counters],
            epoch_progress=self.epoch_progress(cursor),
            eta_s=(self.total_steps - step) * training_s / max(1, step - window.step),
            memory_gb=device_memory_gb(self.device),
            mfu=utilization(flops, training_s, self.peak),
            colocated=self.colocated,
            paused_s=self.paused_s,
        )
        details = {
            "window_s": seconds,
            "tflops_per_s": flops / training_s / 1e12,
            "step_losses": losses,
            "grad_norm": torch.stack([out.grad_norm.float() for out in pending]).mean().item(),
            "drafter_batch_counts": [c.drafter_batches for c in counters],
            "target_batch_counts": targets.counts,
            "feature_wait_s": [c.wait_ms / 1000 for c in counters],
            "target_forward_s": targets.forward_s,
            "target_library_jit": targets.library_jit,
            "evaluated": self.evaluated,
        }
        self.telemetry.on_window(line, details)
        self.paused_s, self.evaluated = 0.0, False
        return losses

    def _gather(self, step: int, stats: SourceStats) -> tuple[WindowSums, list[RankCounters]]:
        """Every drafter rank's step sums and feed counters of the window, which ends here; a non-finite
        loss or gradient norm stops the run."""
        sums, counters = gather_window(self.runtime, self.pending, rank_counters(stats))
        first_step = step - len(self.pending) + 1
        for offset, loss in enumerate(sums.step_losses):
            if not math.isfinite(loss):
                raise NonFiniteLoss(first_step + offset, self.pending[offset].round)
        self.refuse_non_finite(step)  # the gradient norms: all-reduced, so alike on every drafter rank
        self.pending = []
        return sums, counters

    def epoch_progress(self, cursor: DataCursor) -> float:
        if cursor.batch == 0:
            return float(cursor.epoch)  # at an epoch boundary (the next epoch's plan may not even exist)
        return cursor.epoch + cursor.batch / max(1, len(self.planner.plan(cursor.epoch)))
