"""The pipeline's counters the log line shows: each drafter rank's feed counters (gathered with its
step sums once per log line, `app.train.metrics`) and what the target ranks did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.pipeline.distributed import Runtime


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


def target_view(runtime: Runtime | None, counters: list[RankCounters], reader: bool) -> TargetView:
    """What the targets did. Split: batches per target as the drafters received them (exact), and
    `q_pre` as the target ranks last reported through the side channel (read by the logging rank,
    `reader`, only). Colocated: each rank counts its own target's batches."""
    if runtime is not None and not runtime.layout.colocated:
        targets = runtime.layout.num_targets
        counts = [sum(c.from_targets[t] for c in counters) for t in range(targets)]
        reported = runtime.side.target_stats(targets) if reader else [{}] * targets
        q_pre = [t.get("q_pre", 0) for t in reported]
        forward_s = [t.get("forward_s", 0.0) for t in reported]
        return TargetView(counts, q_pre, forward_s, [t.get("library_jit", 0) for t in reported])
    return TargetView([c.target_batches for c in counters], [0] * max(1, len(counters)), [], [])
