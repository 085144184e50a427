"""Which rank does what: `target`, `drafter` or `colocated`, from `topology` and torchrun's rank.

Split topology (`topology.target_ranks = T > 0`): global ranks 0..D-1 train the drafter (DDP over
them; drafter rank 0 is global rank 0, the rank that logs and writes checkpoints) and ranks
D..D+T-1 run the frozen target. Colocated (`target_ranks = 0`): every rank runs target and drafter
on its own share of the batches, and all of them form the drafter group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from app.config.schema import TopologyConfig
from app.errors import UserError

Role = Literal["target", "drafter", "colocated"]


@dataclass(frozen=True)
class RankLayout:
    """One rank's place in the job: its role, its index within that role, and the role groups."""

    rank: int
    world_size: int
    local_rank: int
    target_ranks: tuple[int, ...]
    """Global ranks of targets 0..T-1 (empty when colocated)."""
    drafter_ranks: tuple[int, ...]
    """Global ranks of drafters 0..D-1 (every rank when colocated)."""

    @property
    def colocated(self) -> bool:
        return not self.target_ranks

    @property
    def role(self) -> Role:
        if self.colocated:
            return "colocated"
        return "drafter" if self.rank in self.drafter_ranks else "target"

    @property
    def trains(self) -> bool:
        """This rank holds a drafter and an optimizer."""
        return self.rank in self.drafter_ranks

    @property
    def index(self) -> int:
        """Index within the role: drafter d or target t."""
        ranks = self.drafter_ranks if self.trains else self.target_ranks
        return ranks.index(self.rank)

    @property
    def is_logger(self) -> bool:
        """Drafter rank 0 writes the log line, metrics, status and checkpoints."""
        return self.rank == self.drafter_ranks[0]

    @property
    def name(self) -> str:
        """`drafter 1 (rank 1)`: how logs and failure reports name this rank."""
        return describe_rank(self, self.rank)

    @property
    def num_drafters(self) -> int:
        return len(self.drafter_ranks)

    @property
    def num_targets(self) -> int:
        return len(self.target_ranks)


def layout_for(topology: TopologyConfig, rank: int, world_size: int, local_rank: int) -> RankLayout:
    """The layout of `rank` in a job of `world_size` processes laid out by `topology`."""
    expected = topology.nnodes * topology.nproc_per_node
    if world_size != expected:
        raise UserError(
            f"topology: the config lays out {expected} processes (nnodes {topology.nnodes} x "
            f"nproc_per_node {topology.nproc_per_node}) but torchrun started {world_size}; "
            f"launch with `torchrun --nnodes {topology.nnodes} --nproc-per-node {topology.nproc_per_node}` "
            "(entrypoint.sh train does)"
        )
    if not 0 <= rank < world_size:
        raise UserError(f"RANK={rank} is outside the job's {world_size} processes")
    drafters = topology.drafter_ranks
    if topology.target_ranks == 0:
        return RankLayout(rank, world_size, local_rank, (), tuple(range(world_size)))
    return RankLayout(
        rank,
        world_size,
        local_rank,
        target_ranks=tuple(range(drafters, drafters + topology.target_ranks)),
        drafter_ranks=tuple(range(drafters)),
    )


def layout_from_environment(topology: TopologyConfig) -> RankLayout:
    """This process's layout from torchrun's RANK / WORLD_SIZE / LOCAL_RANK (one process: rank 0 of 1)."""
    return layout_for(
        topology,
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def describe_rank(layout: RankLayout, rank: int) -> str:
    """`target 2 (rank 5)`, `drafter 0 (rank 0)` or `colocated 1 (rank 1)` for any rank of the job."""
    if rank in layout.target_ranks:
        return f"target {layout.target_ranks.index(rank)} (rank {rank})"
    role = "colocated" if layout.colocated else "drafter"
    return f"{role} {layout.drafter_ranks.index(rank)} (rank {rank})"
