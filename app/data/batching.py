"""Length-bucketed target batches: a deterministic plan per (seed, epoch) and a resumable cursor.

A target batch has one of the run's fixed shapes (`app.data.shapes`): it pads to the ladder rung
holding its longest sample, with that rung's rows (at most `token_budget` tokens, at most
`max_batch_size` rows). To keep padding small without giving up randomness, each epoch shuffles the
samples, sorts every window of `bucket_window` samples by length, cuts each window into batches,
and finally shuffles the batch order. Every sample appears exactly once per epoch.

Plans are pure functions of (lengths, config, seed, epoch): any rank computes the same plan, and a
`DataCursor` (epoch, batch index) is all a checkpoint needs to resume exactly where it stopped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from app.config.schema import DataConfig
from app.data.batch import TargetBatch
from app.data.shapes import TargetShapes
from app.errors import UserError

if TYPE_CHECKING:
    from app.data.dataset import TokenizedDataset

Plan = list[list[int]]


def plan_epoch(
    lengths: np.ndarray, *, shapes: TargetShapes, bucket_window: int, seed: int, epoch: int
) -> Plan:
    """The batches of one epoch, in training order; each a list of sample indices, longest first."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > shapes.lengths[-1]):
        raise ValueError(
            f"sample lengths must be in [1, max_length={shapes.lengths[-1]}], got [{lengths.min()}, {lengths.max()}]"
        )
    rng = np.random.default_rng([seed % 2**64, epoch])
    order = rng.permutation(len(lengths))
    batches: Plan = []
    for start in range(0, len(order), bucket_window):
        window = order[start : start + bucket_window]
        window = window[np.argsort(-lengths[window], kind="stable")]
        batches += _cut_sorted(window, lengths, shapes)
    return [batches[i] for i in rng.permutation(len(batches))]


def _cut_sorted(window: np.ndarray, lengths: np.ndarray, shapes: TargetShapes) -> Plan:
    """Greedy cut of samples sorted longest first: each batch takes the rows of the rung of its first
    sample (the window's last batch may hold fewer; collate fills it with padding rows)."""
    batches = []
    start = 0
    while start < len(window):
        rows, _ = shapes.shape_for(int(lengths[window[start]]))
        batches.append(window[start : start + rows].tolist())
        start += rows
    return batches


@dataclass(frozen=True)
class DataCursor:
    """Where training stands in the data: the next batch to train on is `batch` of `epoch`."""

    epoch: int = 0
    batch: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> DataCursor:
        values = {}
        for key in ("epoch", "batch"):
            value = state.get(key) if isinstance(state, Mapping) else None
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UserError(f"data cursor: `{key}` must be a non-negative integer, got {value!r}")
            values[key] = value
        return cls(**values)


@dataclass(frozen=True)
class PlannedBatch:
    """One batch of the plan and where it sits in it."""

    epoch: int
    index: int
    sample_ids: list[int]

    @property
    def next_cursor(self) -> DataCursor:
        """The cursor to save once this batch is trained on."""
        return DataCursor(self.epoch, self.index + 1)


class BatchPlanner:
    """Epoch plans over one dataset's lengths with fixed batching settings and seed."""

    def __init__(self, lengths: np.ndarray, *, shapes: TargetShapes, bucket_window: int, seed: int) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.shapes = shapes
        self.bucket_window = bucket_window
        self.seed = seed
        # A trainer asks for the same epoch over and over; plans of 1M samples take a second.
        self.plan = lru_cache(maxsize=2)(self._plan)

    @classmethod
    def from_config(cls, lengths: np.ndarray, data: DataConfig, seed: int) -> BatchPlanner:
        return cls(
            lengths, shapes=TargetShapes.from_config(data), bucket_window=data.bucket_window, seed=seed
        )

    def _plan(self, epoch: int) -> Plan:
        """The plan of `epoch` (see `plan_epoch`)."""
        return plan_epoch(
            self.lengths, shapes=self.shapes, bucket_window=self.bucket_window, seed=self.seed, epoch=epoch
        )

    def batches(self, cursor: DataCursor, epochs: int) -> Iterator[PlannedBatch]:
        """Every batch from `cursor` (inclusive) to the end of epoch `epochs - 1`."""
        epoch, index = cursor.epoch, cursor.batch
        while epoch < epochs:
            plan = self.plan(epoch)
            for position in range(index, len(plan)):
                yield PlannedBatch(epoch, position, plan[position])
            epoch, index = epoch + 1, 0

    @property
    def fingerprint(self) -> str:
        """Identity of every plan this planner makes: save it with a cursor, compare it on resume
        (a cursor means nothing over different data or batching settings)."""
        digest = hashlib.sha256(self.lengths.tobytes())
        shapes = self.shapes
        settings = (shapes.token_budget, shapes.max_batch_size, self.bucket_window, self.seed, shapes.lengths)
        digest.update(repr(settings).encode())
        return digest.hexdigest()[:16]

    def total_batches(self, epochs: int) -> int:
        """Batches in epochs 0..epochs-1 (the count varies a little between epochs)."""
        return sum(len(self.plan(epoch)) for epoch in range(epochs))


@dataclass(frozen=True)
class PlanStats:
    """How well a plan uses the token budget."""

    batches: int
    samples: int
    real_tokens: int
    padded_tokens: int
    """Target-side tokens computed: rows x padded length of each batch's shape, summed over batches."""
    token_budget: int
    shapes: int
    """Distinct (rows, length) target shapes the plan uses."""

    @property
    def padding_overhead(self) -> float:
        """Padded target tokens computed per real token, minus 1 (0.0: no padding at all)."""
        return self.padded_tokens / self.real_tokens - 1 if self.real_tokens else 0.0

    @property
    def row_fill(self) -> float:
        """Real tokens / drafter row tokens (every batch becomes one row of `token_budget`)."""
        return self.real_tokens / (self.batches * self.token_budget) if self.batches else 1.0

    def describe(self) -> str:
        return (
            f"{self.batches} batches of {self.samples} samples in {self.shapes} target shapes: padding "
            f"overhead {self.padding_overhead:.1%}, drafter row fill {self.row_fill:.1%}"
        )


def plan_stats(plan: Plan, lengths: np.ndarray, shapes: TargetShapes) -> PlanStats:
    lengths = np.asarray(lengths, dtype=np.int64)
    real = padded = samples = 0
    used = set()
    for batch in plan:
        batch_lengths = lengths[batch]
        rows, length = shapes.shape_for(int(batch_lengths.max()))
        used.add((rows, length))
        real += int(batch_lengths.sum())
        padded += rows * length
        samples += len(batch)
    return PlanStats(len(plan), samples, real, padded, shapes.token_budget, len(used))


def collate(
    dataset: TokenizedDataset, sample_ids: Sequence[int], pad_token_id: int, shapes: TargetShapes
) -> TargetBatch:
    """Right-pad the samples into a `TargetBatch` of the run's shape for them: the rung holding the
    longest, with that rung's rows (rows past the samples are all padding, sample id -1)."""
    samples = dataset.fetch(sample_ids)
    rows, width = shapes.shape_for(max(len(ids) for ids, _ in samples))
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((rows, width), dtype=torch.int64)
    loss_mask = torch.zeros((rows, width), dtype=torch.bool)
    for row, (ids, mask) in enumerate(samples):
        input_ids[row, : len(ids)] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        attention_mask[row, : len(ids)] = 1
        loss_mask[row, : len(ids)] = torch.from_numpy(np.asarray(mask, dtype=bool))
    ids = torch.full((rows,), -1, dtype=torch.int64)
    ids[: len(samples)] = torch.tensor(list(sample_ids), dtype=torch.int64)
    return TargetBatch(
        input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, sample_ids=ids
    )
