"""The seam between producers and the trainer: per optimizer step, this rank's micro-batches.

A feature source (colocated: the target runs in-process; remote: features arrive from target ranks)
turns rounds of the epoch plan into `StepBatches` for one drafter rank. The trainer sees nothing
else: not where the features were computed, not which target produced them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from app.data.batch import DrafterRow, FeatureBatch
from app.data.batching import DataCursor, PlannedBatch
from app.pipeline.assignment import Round


@dataclass
class MicroBatch:
    """One feature batch of a step; `planned` None marks padding past an epoch's end (zero loss)."""

    planned: PlannedBatch | None
    features: FeatureBatch


@dataclass
class StepBatches:
    """What one drafter rank trains in one optimizer step."""

    round: Round
    micro: list[MicroBatch]

    @property
    def next_cursor(self) -> DataCursor:
        return self.round.next_cursor


@dataclass
class SourceStats:
    """This rank's pipeline counters; the trainer sums them over ranks on log steps."""

    target_batches: int = 0
    """Batches this rank's target produced (colocated ranks only; target ranks report their own)."""
    wait_seconds: float = 0.0
    """Time the trainer waited for this rank's batches: the target forward itself when colocated,
    a starved feature queue on a split drafter."""
    real_tokens: int = 0
    """Real (non-padding) context tokens of the batches handed to the trainer."""
    drafter_batches: int = 0
    """Real batches handed to the trainer."""
    q_pre: list[int] = field(default_factory=lambda: [0])
    """Batches prepared ahead per target (colocated: produced on demand, so 0)."""
    q_hs: list[int] = field(default_factory=lambda: [0])
    """Feature batches waiting per drafter (colocated: consumed at once, so 0)."""
    from_targets: list[int] = field(default_factory=list)
    """Split drafters: real batches received per producing target (empty when colocated)."""


class FeatureSource(Protocol):
    stats: SourceStats

    def steps(self, cursor: DataCursor, epochs: int, steps: int) -> Iterator[StepBatches]:
        """This rank's micro-batches for the next `steps` optimizer steps from `cursor`."""

    def close(self) -> None:
        """Stop background work (threads); safe to call more than once."""


def padding_batch(
    token_budget: int,
    anchors: int,
    feature_size: int,
    dtype: torch.dtype,
    device: torch.device,
    target_width: int | None = None,
) -> FeatureBatch:
    """A fixed-shape batch that carries no loss: no document, no valid anchor, zero features (and, with
    `target_width` above `feature_size`, zero target hidden states: `FeatureBatch.split`).

    A DDP rank trains it when the epoch's last round has no batch for it, so that every rank runs
    the same forward/backward and all-reduce; its gradient is exactly zero.
    """
    row = DrafterRow(
        input_ids=torch.zeros(token_budget, dtype=torch.int64),
        position_ids=torch.zeros(token_budget, dtype=torch.int64),
        document_ids=torch.full((token_budget,), -1, dtype=torch.int32),
        loss_mask=torch.zeros(token_budget, dtype=torch.bool),
        anchor_positions=torch.zeros(anchors, dtype=torch.int64),
        anchor_valid=torch.zeros(anchors, dtype=torch.bool),
    )
    features = torch.zeros(token_budget, target_width or feature_size, dtype=dtype, device=device)
    return FeatureBatch.split(row.to(device), features, feature_size)


def real_tokens(row: DrafterRow) -> int:
    """Context tokens of a packed row that are not padding."""
    return int((row.document_ids >= 0).sum())
