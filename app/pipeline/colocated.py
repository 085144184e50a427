"""The producer side of the seam, colocated: target and drafter share one device and one process.

Each colocated rank runs the frozen target in-process on its own share of every round (with one
rank, on all of it). The remote source receives the same batches from target ranks instead; either
way the trainer sees `StepBatches` and nothing else.

A data thread prepares the rounds' batches on the host ahead of the step (`app.pipeline.prefetch`,
at most `topology.prefetch_batches` rounds); the main thread copies each to the device and queues
the target's forward, eager or replayed from its CUDA graphs (`app.pipeline.features`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

from app.data.batch import FeatureBatch
from app.data.batching import DataCursor
from app.data.dataset import TokenizedDataset
from app.model.target import TargetModel
from app.pipeline.assignment import Round, RoundPlanner
from app.pipeline.features import PackedForward, eager_forward, features_on_device
from app.pipeline.prefetch import BatchPreparer, Prefetcher, PreparedBatch
from app.pipeline.source import MicroBatch, SourceStats, StepBatches, padding_batch

PreparedRound = tuple[Round, list[PreparedBatch | None]]


class ColocatedFeatureSource:
    """Plan -> (data thread) collate, pack -> target features on `target.device` -> packed fixed-shape row."""

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
        prefetch: int,
        forward: PackedForward | None = None,
        final_hidden: bool = False,
    ) -> None:
        """`prefetch`: rounds prepared ahead; `forward`: the target's CUDA graphs, else its eager forward;
        `final_hidden`: the batches carry the target's final hidden states (`train.soft_targets`)."""
        self.target = target
        self.rounds = rounds
        self.drafter = drafter
        self.token_budget = token_budget
        self.anchors = anchors
        self.prefetch = prefetch
        self.forward = forward or eager_forward(target, final_hidden)
        self.feature_size = len(target.layer_ids) * target.hidden_size
        self.final_hidden = final_hidden
        self.width = self.feature_size + (target.hidden_size if final_hidden else 0)
        self.prepare = BatchPreparer(
            dataset, rounds.planner.shapes, token_budget=token_budget, anchors=anchors,
            pad_token_id=pad_token_id, seed=seed, device=target.device,
        )  # fmt: skip
        self.stats = SourceStats()
        self._padding: FeatureBatch | None = None
        self._prefetcher: Prefetcher[PreparedRound] | None = None

    def steps(self, cursor: DataCursor, epochs: int, steps: int) -> Iterator[StepBatches]:
        self.close()
        rounds = itertools.islice(self.rounds.rounds(cursor, epochs), steps)
        prefetcher = Prefetcher(rounds, self._prepare_round, depth=self.prefetch, device=self.target.device)
        self._prefetcher = prefetcher
        try:
            while True:
                started = time.perf_counter()
                prepared = prefetcher.next()
                if prepared is None:
                    return
                round_, batches = prepared
                micro = [
                    MicroBatch(batch.planned, self._features(batch))
                    if batch is not None
                    else MicroBatch(None, self._padding_batch())
                    for batch in batches
                ]
                self.stats.wait_seconds += time.perf_counter() - started
                self.stats.q_pre = [prefetcher.waiting()]
                yield StepBatches(round_, micro)
        finally:
            prefetcher.close()

    def _prepare_round(self, round_: Round) -> PreparedRound:
        """Data thread: this rank's batches of `round_` on the host (None for an epoch's padding)."""
        planned = round_.for_drafter(self.drafter, self.rounds.drafters)
        return round_, [self.prepare(batch) if batch is not None else None for batch in planned]

    def _features(self, prepared: PreparedBatch) -> FeatureBatch:
        self.stats.target_batches += 1
        self.stats.drafter_batches += 1
        self.stats.real_tokens += prepared.real_tokens
        batch = features_on_device(self.forward, prepared, self.target.device, self.feature_size)
        if (batch.target_hidden is not None) != self.final_hidden:  # a shape check: no device sync
            given = "with" if batch.target_hidden is not None else "without"
            raise RuntimeError(
                f"the target's forward gives its features {given} its final hidden states, which "
                f"train.soft_targets {'needs' if self.final_hidden else 'does not use'}"
            )
        return batch

    def _padding_batch(self) -> FeatureBatch:
        if self._padding is None:
            self._padding = padding_batch(
                self.token_budget, self.anchors, self.feature_size, self.target.dtype, self.target.device,
                self.width,
            )  # fmt: skip
        return self._padding

    def close(self) -> None:
        """Stop the data thread (it ends within `prefetch.POLL_S`); safe to call more than once."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
