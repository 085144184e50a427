"""The producer side of the seam on a split drafter rank: feature batches arrive from target ranks.

The rank walks the same rounds as every other rank; its receive thread takes its deliveries (in
plan order, from whichever target produced each) into the bounded `q_hs` queue, and each step
hands the trainer its micro-batches, with zero-loss padding where the epoch's last round has none.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from app.data.batch import FeatureBatch
from app.data.batching import DataCursor
from app.pipeline.assignment import RoundPlanner
from app.pipeline.distributed import Runtime
from app.pipeline.source import MicroBatch, SourceStats, StepBatches, padding_batch
from app.pipeline.transport import FeatureReceiver


class RemoteFeatureSource:
    """Receives this drafter rank's feature batches from the target ranks."""

    def __init__(
        self,
        runtime: Runtime,
        rounds: RoundPlanner,
        *,
        token_budget: int,
        anchors: int,
        feature_size: int,
        dtype: torch.dtype,
        capacity: int,
    ) -> None:
        self.runtime = runtime
        self.rounds = rounds
        self.drafter = runtime.layout.index
        self.token_budget = token_budget
        self.anchors = anchors
        self.feature_size = feature_size
        self.dtype = dtype
        self.capacity = capacity
        self.stats = SourceStats(q_pre=[0] * rounds.targets, q_hs=[0], from_targets=[0] * rounds.targets)
        self._receiver: FeatureReceiver | None = None
        self._padding: FeatureBatch | None = None

    def steps(self, cursor: DataCursor, epochs: int, steps: int) -> Iterator[StepBatches]:
        mine = (
            delivery
            for delivery in self.rounds.deliveries(cursor, epochs, steps)
            if delivery.drafter == self.drafter
        )
        self._receiver = FeatureReceiver(
            self.runtime,
            mine,
            token_budget=self.token_budget,
            anchors=self.anchors,
            feature_size=self.feature_size,
            dtype=self.dtype,
            capacity=self.capacity,
        )
        for number, round_ in enumerate(self.rounds.rounds(cursor, epochs)):
            if number >= steps:
                return
            micro = []
            for position in range(self.drafter, self.rounds.size, self.rounds.drafters):
                delivery = self.rounds.delivery(round_, position)
                if delivery is None:
                    micro.append(MicroBatch(None, self._padding_batch()))
                    continue
                started = time.perf_counter()
                features, real_tokens = self._receiver.get(delivery)
                self.stats.wait_seconds += time.perf_counter() - started
                self.stats.drafter_batches += 1
                self.stats.real_tokens += real_tokens
                self.stats.from_targets[delivery.target] += 1
                micro.append(MicroBatch(delivery.batch, features))
            self.stats.q_hs = [self._receiver.depth]
            yield StepBatches(round_, micro)

    def _padding_batch(self) -> FeatureBatch:
        if self._padding is None:
            self._padding = padding_batch(
                self.token_budget, self.anchors, self.feature_size, self.dtype, self.runtime.device
            )
        return self._padding

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
