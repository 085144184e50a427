"""Which batch goes where: optimizer steps as rounds of the epoch plan, drafters and targets per batch.

One optimizer step consumes a *round*: the next `R = drafters x grad_accum` batches of the epoch
plan from the cursor. Position p of a round goes to drafter `p mod D` as its micro-batch `p div D`,
so every drafter gets exactly `grad_accum` batches per step however many targets there are. Which
target produces each position is the `Feeding`: on one node, position p of round r (r = the round's
start div R) is produced by target `(r x R + p) mod T`, i.e. batch i by target `i mod T`; a
drafter's batches therefore come from every target in turn, and with T = 5, D = 3 no drafter waits
on a fixed pair of targets (a static "target t feeds drafter t mod D" would give two drafters twice
the work of the third). On several nodes the targets of a drafter's own node produce its batches
first (see `Feeding.build`). The producer never changes what is trained: every target computes the
same features for the same batch.

An epoch's last round may be short: its missing positions are padding (`None`), which the drafters
train as zero-loss batches so that DDP still sees the same number of micro-steps on every rank.
Every sample is seen exactly once per epoch; the gradient of that step is still divided by R.
Rounds never span epochs, so (epoch, batch) cursors stay valid resume points for any topology.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.data.batching import BatchPlanner, DataCursor, PlannedBatch

if TYPE_CHECKING:
    from app.pipeline.roles import RankLayout


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


@dataclass(frozen=True)
class Feeding:
    """The target of every position of a round, for a cycle of rounds that then repeats."""

    cycle: tuple[tuple[int, ...], ...]
    """`cycle[r mod len(cycle)][p]`: the target producing position p of round r."""
    drafter_nodes: tuple[int, ...]
    target_nodes: tuple[int, ...]

    @classmethod
    def build(cls, drafter_nodes: tuple[int, ...], target_nodes: tuple[int, ...], size: int) -> Feeding:
        """Every target produces the same number of batches per cycle (`share`); a drafter's own node's
        targets produce its batches first, up to their share, spread evenly over the cycle, and the
        batches they cannot take go, in round order, to the targets with share left, in turn.

        When each node holds the same fraction of the drafters as of the targets (every node runs the
        same split), no batch leaves its node; on one node this is batch i by target i mod T.
        """
        targets, drafters = len(target_nodes), len(drafter_nodes)
        rounds = targets // math.gcd(size, targets)
        share = rounds * size // targets
        table: dict[tuple[int, int], int] = {}
        left = dict.fromkeys(range(targets), share)
        overflow: list[tuple[int, int]] = []
        for node in sorted(set(drafter_nodes)):
            slots = [
                (r, p) for r in range(rounds) for p in range(size) if drafter_nodes[p % drafters] == node
            ]
            local = [target for target, where in enumerate(target_nodes) if where == node]
            take, taken = min(len(slots), len(local) * share), 0
            for number, slot in enumerate(slots):
                # the `take` local slots, spread evenly (Bresenham) so no target idles for whole rounds
                if (number + 1) * take // len(slots) > number * take // len(slots):
                    table[slot] = local[taken % len(local)]
                    left[table[slot]] -= 1
                    taken += 1
                else:
                    overflow.append(slot)
        spare = [target for turn in range(share) for target in range(targets) if left[target] > turn]
        table.update(zip(sorted(overflow), spare, strict=True))
        cycle = tuple(tuple(table[r, p] for p in range(size)) for r in range(rounds))
        return cls(cycle, tuple(drafter_nodes), tuple(target_nodes))

    def target(self, round_number: int, position: int) -> int:
        return self.cycle[round_number % len(self.cycle)][position]

    def pairs(self) -> Counter[tuple[int, int]]:
        """(target, drafter) -> batches per cycle."""
        drafters = len(self.drafter_nodes)
        return Counter((t, p % drafters) for row in self.cycle for p, t in enumerate(row))

    def describe(self, token_budget: int, feature_size: int, value_bytes: int) -> str:
        """The header line: where each role runs, who feeds whom, and what crosses nodes per optimizer
        step (a batch is `token_budget` rows of `feature_size` = K x hidden values on the wire)."""
        pairs = self.pairs()
        crossing = [pair for pair in pairs if self.target_nodes[pair[0]] != self.drafter_nodes[pair[1]]]
        per_step = sum(pairs[pair] for pair in crossing) / len(self.cycle)

        def on(node: int, nodes: tuple[int, ...]) -> str:
            return ",".join(str(index) for index, where in enumerate(nodes) if where == node) or "none"

        placed = " | ".join(
            f"node {node} = drafters {on(node, self.drafter_nodes)} + targets {on(node, self.target_nodes)}"
            for node in sorted({*self.drafter_nodes, *self.target_nodes})
        )
        feeds = " ".join(
            f"t{t}->" + ",".join(f"d{d}" for d in sorted(d for target, d in pairs if target == t))
            for t in range(len(self.target_nodes))
        )
        megabytes = per_step * token_budget * feature_size * value_bytes / 1e6
        return (
            f"features: {placed}; feeding {feeds}; {len(crossing)} of {len(pairs)} pairs cross nodes: "
            f"{per_step:.2f} of {len(self.cycle[0])} batches per step, {megabytes:.2f} MB per step across nodes "
            f"({token_budget} tokens x {feature_size} (K x hidden) x {value_bytes} B per batch)"
        )


class RoundPlanner:
    """Rounds over a `BatchPlanner`'s epoch plans for `drafters` ranks accumulating `grad_accum` each."""

    def __init__(
        self,
        planner: BatchPlanner,
        *,
        drafters: int,
        grad_accum: int,
        targets: int,
        nodes: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    ) -> None:
        if drafters < 1 or grad_accum < 1:
            raise ValueError(f"drafters and grad_accum must be >= 1, got {drafters}, {grad_accum}")
        self.planner = planner
        self.drafters = drafters
        self.grad_accum = grad_accum
        self.targets = targets
        """Target ranks (0: colocated, each drafter rank produces its own batches)."""
        drafter_nodes, target_nodes = nodes or ((0,) * drafters, (0,) * targets)
        if (len(drafter_nodes), len(target_nodes)) != (drafters, targets):
            raise ValueError(f"nodes {nodes} do not list {drafters} drafters and {targets} targets")
        self.feeding = Feeding.build(drafter_nodes, target_nodes, self.size) if targets else None
        """Split topology: which target produces each position of a round."""

    @classmethod
    def for_layout(cls, planner: BatchPlanner, layout: RankLayout | None, grad_accum: int) -> RoundPlanner:
        """The rounds of a job laid out as `layout` (None: one process, colocated)."""
        if layout is None:
            return cls(planner, drafters=1, grad_accum=grad_accum, targets=0)
        return cls(
            planner,
            drafters=layout.num_drafters,
            grad_accum=grad_accum,
            targets=layout.num_targets,
            nodes=(layout.drafter_nodes, layout.target_nodes),
        )

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

    def delivery(self, round_: Round, position: int) -> Delivery | None:
        """Position `position` of `round_` with its drafter and (split) target; None for padding."""
        batch = round_.batches[position]
        if batch is None:
            return None
        target = self.feeding.target(round_.start // self.size, position) if self.feeding else -1
        return Delivery(batch, target, position % self.drafters)

    def deliveries(self, cursor: DataCursor, epochs: int, steps: int) -> Iterator[Delivery]:
        """The real batches of the next `steps` rounds from `cursor`, in plan order, with their ranks' indices.

        Targets send and drafters receive in this order (each filtering its own), which is what keeps
        the point-to-point transport free of deadlocks: every wait is for an earlier batch.
        """
        for number, round_ in enumerate(self.rounds(cursor, epochs)):
            if number >= steps:
                return
            for position in range(self.size):
                if (delivery := self.delivery(round_, position)) is not None:
                    yield delivery
