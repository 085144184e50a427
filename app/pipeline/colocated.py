"""The producer side of the seam, colocated: target and drafter share one device and one process.

Each colocated rank runs the frozen target in-process on its own share of every round (with one
rank, on all of it). The remote source receives the same batches from target ranks instead; either
way the trainer sees `StepBatches` and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from app.data.batch import FeatureBatch
from app.data.batching import DataCursor, PlannedBatch, collate
from app.data.dataset import TokenizedDataset
from app.data.packing import pack_features, pack_row
from app.model.target import TargetModel
from app.pipeline.assignment import RoundPlanner
from app.pipeline.source import MicroBatch, SourceStats, StepBatches, padding_batch


class ColocatedFeatureSource:
    """Plan -> collate -> target features -> packed fixed-shape row, all on `target.device`."""

    def __init__(
        self,
        target: TargetModel,
        dataset: TokenizedDataset,
        rounds: RoundPlanner,
        *,
        drafter: int,
        token_budget: int,
        anchors: int,
        pad_token_id: int,
        seed: int,
    ) -> None:
        self.target = target
        self.dataset = dataset
        self.rounds = rounds
        self.drafter = drafter
        self.token_budget = token_budget
        self.anchors = anchors
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.stats = SourceStats()
        self._padding: FeatureBatch | None = None

    def steps(self, cursor: DataCursor, epochs: int, steps: int) -> Iterator[StepBatches]:
        for number, round_ in enumerate(self.rounds.rounds(cursor, epochs)):
            if number >= steps:
                return
            micro = [
                MicroBatch(planned, self._features(planned) if planned is not None else self._padding_batch())
                for planned in round_.for_drafter(self.drafter, self.rounds.drafters)
            ]
            yield StepBatches(round_, micro)

    def _features(self, planned: PlannedBatch) -> FeatureBatch:
        device = self.target.device
        started = time.perf_counter()
        batch = collate(self.dataset, planned.sample_ids, self.pad_token_id, self.rounds.planner.shapes)
        row = pack_row(
            batch,
            token_budget=self.token_budget,
            anchors=self.anchors,
            pad_token_id=self.pad_token_id,
            seed=self.seed,
            epoch=planned.epoch,
            index=planned.index,
        )
        real_tokens = int(batch.attention_mask.sum())
        batch = batch.to(device)
        features = self.target.features(batch.input_ids)
        self.stats.target_batches += 1
        self.stats.drafter_batches += 1
        self.stats.real_tokens += real_tokens
        self.stats.wait_seconds += time.perf_counter() - started
        return pack_features(batch, features, row.to(device))

    def _padding_batch(self) -> FeatureBatch:
        if self._padding is None:
            width = len(self.target.layer_ids) * self.target.hidden_size
            self._padding = padding_batch(
                self.token_budget, self.anchors, width, self.target.dtype, self.target.device
            )
        return self._padding

    def close(self) -> None:
        """Nothing runs in the background here."""
