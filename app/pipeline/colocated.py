"""The producer side of the seam, colocated: target and drafter share one device and one process.

`FeatureSource`s turn the batch plan into `FeatureBatch`es for the trainer. This one runs the
frozen target in-process; the multi-GPU source receives the same batches from target ranks instead.
Either way the trainer sees (planned batch, feature batch) pairs and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from app.data.batch import FeatureBatch
from app.data.batching import BatchPlanner, DataCursor, PlannedBatch, collate
from app.data.dataset import TokenizedDataset
from app.data.packing import pack_features, pack_row
from app.model.target import TargetModel


@dataclass
class SourceStats:
    """Counters the log line reads: batches produced, target time, queue depths."""

    target_batches: int = 0
    target_seconds: float = 0.0
    real_tokens: int = 0
    q_pre: list[int] = field(default_factory=lambda: [0])
    """Batches prepared ahead per target (colocated: produced on demand, so 0)."""
    q_hs: list[int] = field(default_factory=lambda: [0])
    """Feature batches waiting per drafter (colocated: consumed at once, so 0)."""


class ColocatedFeatureSource:
    """Plan -> collate -> target features -> packed fixed-shape row, all on `target.device`."""

    def __init__(
        self,
        target: TargetModel,
        dataset: TokenizedDataset,
        planner: BatchPlanner,
        *,
        token_budget: int,
        anchors: int,
        pad_token_id: int,
        seed: int,
    ) -> None:
        self.target = target
        self.dataset = dataset
        self.planner = planner
        self.token_budget = token_budget
        self.anchors = anchors
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.stats = SourceStats()

    def batches(self, cursor: DataCursor, epochs: int) -> Iterator[tuple[PlannedBatch, FeatureBatch]]:
        device = self.target.device
        for planned in self.planner.batches(cursor, epochs):
            started = time.perf_counter()
            batch = collate(self.dataset, planned.sample_ids, self.pad_token_id)
            row = pack_row(
                batch,
                token_budget=self.token_budget,
                anchors=self.anchors,
                pad_token_id=self.pad_token_id,
                seed=self.seed,
                epoch=planned.epoch,
                index=planned.index,
            )
            batch = batch.to(device)
            features = self.target.features(batch.input_ids, batch.attention_mask)
            self.stats.target_batches += 1
            self.stats.real_tokens += int(batch.attention_mask.sum())
            self.stats.target_seconds += time.perf_counter() - started
            yield planned, pack_features(batch, features, row.to(device))

    def close(self) -> None:
        """Nothing runs in the background here; the distributed source joins its threads."""
