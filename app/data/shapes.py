"""The fixed set of target batch shapes a run can produce, known before it starts.

A hybrid target's library kernels (flash-linear-attention's Triton kernels) compile and autotune once
per new (rows, length) input shape: seconds each, and a fresh container meets a new shape in nearly
every batch when batches pad to their longest sample. So a target batch pads to a **rung** of a
length ladder instead: the smallest rung that holds its longest sample, with
`rows = min(max_batch_size, token_budget // rung)` rows (missing rows are all padding). The ladder is
geometric, `data.lengths_per_octave` rungs per doubling, each a multiple of `data.length_multiple`,
ending at `data.max_length`: a few dozen shapes at production lengths, all baked by
`dflash build-cache`, for a few percent of padding (reported in the data summary line).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from app.config.schema import DataConfig


def length_ladder(max_length: int, multiple: int, per_octave: int) -> tuple[int, ...]:
    """Ascending padded lengths: `multiple * 2**(i / per_octave)` rounded up to a multiple of
    `multiple`, below `max_length`, then `max_length` itself."""
    rungs: set[int] = set()
    index = 0
    while (rung := math.ceil(2 ** (index / per_octave) - 1e-9) * multiple) < max_length:
        rungs.add(rung)
        index += 1
    return (*sorted(rungs), max_length)


@dataclass(frozen=True)
class TargetShapes:
    """The run's target batch shapes: one (rows, length) per rung of the ladder."""

    lengths: tuple[int, ...]
    token_budget: int
    max_batch_size: int

    @classmethod
    def from_config(cls, data: DataConfig) -> TargetShapes:
        multiple = data.length_multiple or max(16, data.max_length // 128)
        ladder = length_ladder(data.max_length, multiple, data.lengths_per_octave)
        return cls(ladder, data.token_budget, data.max_batch_size)

    def length_for(self, longest: int) -> int:
        """The rung a batch whose longest sample has `longest` tokens pads to."""
        index = bisect.bisect_left(self.lengths, longest)
        if index == len(self.lengths):
            raise ValueError(
                f"a sample of {longest} tokens is longer than data.max_length={self.lengths[-1]}"
            )
        return self.lengths[index]

    def rows(self, length: int) -> int:
        """Rows of every batch padded to `length` (at least 1: max_length <= token_budget)."""
        return max(1, min(self.max_batch_size, self.token_budget // length))

    def shape_for(self, longest: int) -> tuple[int, int]:
        length = self.length_for(longest)
        return self.rows(length), length

    @property
    def all(self) -> list[tuple[int, int]]:
        """Every (rows, length) a batch of this run can have, shortest first."""
        return [(self.rows(length), length) for length in self.lengths]

    def describe(self) -> str:
        shown = ", ".join(str(length) for length in self.lengths[:4])
        more = f", ... {self.lengths[-1]}" if len(self.lengths) > 4 else ""
        return f"{len(self.lengths)} target shapes (lengths {shown}{more})"
