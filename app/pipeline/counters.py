"""What the log line needs from every drafter rank, gathered once per log line (not per step).

Each drafter rank keeps, per optimizer step, the sums of its micro-batches' loss, accuracy and
streak over real batches and the number of real batches (`StepTotals`), plus its pipeline counters.
On log steps the drafter group all-gathers them on the host (gloo): per-step metrics over every
real batch of the step, and the counters per rank, so the line's totals agree with the ranks'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from app.pipeline.distributed import Runtime

STEP_FIELDS = ("loss", "acc", "streak", "real", "tree_accepted", "tree_blocks")
"""Per-step sums over a rank's micro-batches: loss x real, acc x real, streak x real, real batches,
and on the steps that measure it the tree streak's accepted slots and sampled blocks."""


@dataclass
class RankCounters:
    """One drafter rank's cumulative pipeline counters and its current queue depth."""

    drafter_batches: int
    """Real batches this rank has trained on."""
    real_tokens: int
    """Real context tokens in them."""
    target_batches: int
    """Batches this rank's own target produced (colocated ranks; 0 on split drafters)."""
    q_hs: int
    """Feature batches received and waiting (split drafters; 0 when colocated)."""
    wait_ms: int
    """Milliseconds the trainer waited for this rank's batches (`SourceStats.wait_seconds`)."""
    from_targets: list[int]
    """Split drafters: batches trained per producing target (summed over drafters: each target's
    delivered batches, exactly); empty when colocated."""

    def as_tensor(self) -> torch.Tensor:
        head = [self.drafter_batches, self.real_tokens, self.target_batches, self.q_hs, self.wait_ms]
        return torch.tensor(head + self.from_targets, dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> RankCounters:
        numbers = [int(value) for value in values.tolist()]
        return cls(*numbers[:5], from_targets=numbers[5:])


@dataclass
class GatheredWindow:
    """A log window's metrics over every drafter rank."""

    step_totals: torch.Tensor
    """`[steps, len(STEP_FIELDS)]` float32 sums over all ranks."""
    counters: list[RankCounters]
    """Per drafter rank, in drafter order."""

    @property
    def step_losses(self) -> list[float]:
        totals = self.step_totals
        return (totals[:, 0] / totals[:, 3].clamp_min(1)).tolist()

    def mean(self, field: str, per: str = "real") -> float:
        """Mean of `field` over every real batch of the window (or every unit of another field)."""
        column = self.step_totals[:, STEP_FIELDS.index(field)]
        return float(column.sum() / self.step_totals[:, STEP_FIELDS.index(per)].sum().clamp_min(1))

    def tree_streak(self) -> float | None:
        """The window's tree streak per sampled block; None when no step of it measured one."""
        blocks = float(self.step_totals[:, STEP_FIELDS.index("tree_blocks")].sum())
        return self.mean("tree_accepted", per="tree_blocks") if blocks else None


def gather_window(runtime: Runtime | None, step_totals: torch.Tensor, mine: RankCounters) -> GatheredWindow:
    """Sum the window's per-step totals over the drafter group and collect every rank's counters.

    Collective over `drafter_control`: every drafter rank calls it on the same steps (they are in
    lockstep), with the same number of steps. One process: no communication.
    """
    step_totals = step_totals.detach().float().cpu()
    if runtime is None or runtime.drafter_control is None or runtime.layout.num_drafters == 1:
        return GatheredWindow(step_totals, [mine])
    steps = step_totals.shape[0]
    packed = torch.cat([step_totals.double().flatten(), mine.as_tensor()])
    gathered = [torch.empty_like(packed) for _ in range(runtime.layout.num_drafters)]
    dist.all_gather(gathered, packed, group=runtime.drafter_control)
    width = len(STEP_FIELDS)
    totals = torch.stack([g[: steps * width].view(steps, width) for g in gathered]).sum(dim=0).float()
    counters = [RankCounters.from_tensor(g[steps * width :]) for g in gathered]
    return GatheredWindow(totals, counters)


@dataclass
class Window:
    """Totals over ranks at the previous log line; the line's rates are over the window since then."""

    started: float
    step: int
    drafter_batches: int
    real_tokens: int
    target_batches: int


@dataclass
class TargetView:
    """Per target: batches produced so far, and batches prepared ahead (`q_pre`)."""

    counts: list[int]
    q_pre: list[int]
    forward_s: list[float]
    """Split: seconds each target rank has spent in its forward, as last reported (empty when colocated)."""
    library_jit: list[int]
    """Split: Triton compiles and autotunings each target rank counted after start (empty when colocated)."""

    @property
    def total(self) -> int:
        return sum(self.counts)


def target_view(runtime: Runtime | None, gathered: GatheredWindow | None, reader: bool) -> TargetView:
    """What the targets did. Split: batches per target as the drafters received them (exact), and
    `q_pre` as the target ranks last reported through the side channel (read by the logging rank,
    `reader`, only). Colocated: each rank counts its own target's batches."""
    counters = gathered.counters if gathered is not None else []
    if runtime is not None and not runtime.layout.colocated:
        targets = runtime.layout.num_targets
        counts = [sum(c.from_targets[t] for c in counters) for t in range(targets)]
        reported = runtime.side.target_stats(targets) if reader else [{}] * targets
        q_pre = [t.get("q_pre", 0) for t in reported]
        forward_s = [t.get("forward_s", 0.0) for t in reported]
        return TargetView(counts, q_pre, forward_s, [t.get("library_jit", 0) for t in reported])
    return TargetView([c.target_batches for c in counters], [0] * max(1, len(counters)), [], [])
