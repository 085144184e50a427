"""Which batch goes where: optimizer steps as rounds of the epoch plan, drafters and targets per batch.

One optimizer step consumes a *round*: the next `R = drafters x grad_accum` batches of the epoch
plan from the cursor. Position p of a round goes to drafter `p mod D` as its micro-batch `p div D`,
so every drafter gets exactly `grad_accum` batches per step however many targets there are. Batch
`i` of an epoch plan is produced by target `i mod T`; a drafter's batches therefore come from every
target in turn, and with T = 5, D = 3 no drafter waits on a fixed pair of targets (a static
"target t feeds drafter t mod D" would give two drafters twice the work of the third).

An epoch's last round may be short: its missing positions are padding (`None`), which the drafters
train as zero-loss batches so that DDP still sees the same number of micro-steps on every rank.
Every sample is seen exactly once per epoch; the gradient of that step is still divided by R.
Rounds never span epochs, so (epoch, batch) cursors stay valid resume points for any topology.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from app.data.batching import BatchPlanner, DataCursor, PlannedBatch


@dataclass(frozen=True)
class Round:
    """The batches of one optimizer step, by position (None: padding past the epoch's end)."""

    epoch: int
    start: int
    """Plan index of position 0."""
    batches: tuple[PlannedBatch | None, ...]
    next_cursor: DataCursor
    """The cursor to save once this round is trained on."""

    def for_drafter(self, drafter: int, drafters: int) -> list[PlannedBatch | None]:
        """Drafter `drafter`'s micro-batches, in the order it trains them."""
        return list(self.batches[drafter::drafters])

    @property
    def real(self) -> list[PlannedBatch]:
        return [batch for batch in self.batches if batch is not None]


@dataclass(frozen=True)
class Delivery:
    """One batch on the wire: produced by target `target`, trained by drafter `drafter`."""

    batch: PlannedBatch
    target: int
    drafter: int


class RoundPlanner:
    """Rounds over a `BatchPlanner`'s epoch plans for `drafters` ranks accumulating `grad_accum` each."""

    def __init__(self, planner: BatchPlanner, *, drafters: int, grad_accum: int, targets: int) -> None:
        if drafters < 1 or grad_accum < 1:
            raise ValueError(f"drafters and grad_accum must be >= 1, got {drafters}, {grad_accum}")
        self.planner = planner
        self.drafters = drafters
        self.grad_accum = grad_accum
        self.targets = targets
        """Target ranks (0: colocated, each drafter rank produces its own batches)."""

    @property
    def size(self) -> int:
        """Batches per optimizer step, over all drafters."""
        return self.drafters * self.grad_accum

    def rounds(self, cursor: DataCursor, epochs: int) -> Iterator[Round]:
        """Every round from `cursor` to the end of epoch `epochs - 1`."""
        epoch, start = cursor.epoch, cursor.batch
        while epoch < epochs:
            plan = self.planner.plan(epoch)
            while start < len(plan):
                stop = start + self.size
                batches = tuple(
                    PlannedBatch(epoch, index, plan[index]) if index < len(plan) else None
                    for index in range(start, stop)
                )
                following = DataCursor(epoch, stop) if stop < len(plan) else DataCursor(epoch + 1, 0)
                yield Round(epoch, start, batches, following)
                start = stop
            epoch, start = epoch + 1, 0

    def total_steps(self, epochs: int) -> int:
        """Optimizer steps in epochs 0..epochs-1 from the start: each epoch's batches in rounds, rounded up."""
        return sum(-(-len(self.planner.plan(epoch)) // self.size) for epoch in range(epochs))

    def target_of(self, batch: PlannedBatch) -> int:
        """The target that produces `batch` (split topology only)."""
        return batch.index % self.targets

    def deliveries(self, cursor: DataCursor, epochs: int, steps: int) -> Iterator[Delivery]:
        """The real batches of the next `steps` rounds from `cursor`, in plan order, with their ranks' indices.

        Targets send and drafters receive in this order (each filtering its own), which is what keeps
        the point-to-point transport free of deadlocks: every wait is for an earlier batch.
        """
        for number, round_ in enumerate(self.rounds(cursor, epochs)):
            if number >= steps:
                return
            for position, batch in enumerate(round_.batches):
                if batch is not None:
                    yield Delivery(
                        batch, self.target_of(batch) if self.targets else -1, position % self.drafters
                    )
