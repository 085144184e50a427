"""Which rank does what: `target`, `drafter` or `colocated`, from `topology` and torchrun's rank.

Split topology (`topology.target_ranks = T > 0`): D ranks train the drafter (DDP over them) and T
run the frozen target. Colocated (`target_ranks = 0`): every rank runs target and drafter on its own
share of the batches, and all of them form the drafter group.

Placement (docs/architecture.md, Process topology). torchrun numbers the ranks node by node (node n
holds ranks n x P .. n x P + P - 1, P = nproc_per_node). The drafters are spread evenly over the
nodes, node 0 taking the first of any remainder; on each node its drafters take the first local
ranks and targets the rest. Both roles are numbered in global rank order, so drafter 0 is global
rank 0 (it logs and checkpoints) and the drafter group's ranks are the drafter indices on any node
count: the same layout trains bit for bit the same on one node or several. On one node this is
drafters 0..D-1, targets D..D+T-1. Which target feeds which drafter is the assignment's
(`assignment.Feeding`: a drafter's own node first).
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
    nproc_per_node: int
    """Ranks per node: global rank r runs on node r div nproc_per_node (torchrun numbers them so)."""
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

    @property
    def nnodes(self) -> int:
        return self.world_size // self.nproc_per_node

    @property
    def node(self) -> int:
        """This rank's node (torchrun's GROUP_RANK)."""
        return self.node_of(self.rank)

    def node_of(self, rank: int) -> int:
        return rank // self.nproc_per_node

    @property
    def drafter_nodes(self) -> tuple[int, ...]:
        """The node of each drafter 0..D-1."""
        return tuple(map(self.node_of, self.drafter_ranks))

    @property
    def target_nodes(self) -> tuple[int, ...]:
        """The node of each target 0..T-1."""
        return tuple(map(self.node_of, self.target_ranks))


def place_roles(topology: TopologyConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(target ranks, drafter ranks), each in role-index order (see the module docstring)."""
    world = topology.nnodes * topology.nproc_per_node
    if topology.target_ranks == 0:
        return (), tuple(range(world))
    base, extra = divmod(topology.drafter_ranks, topology.nnodes)
    targets: list[int] = []
    drafters: list[int] = []
    for node in range(topology.nnodes):
        first, own = node * topology.nproc_per_node, base + (node < extra)
        drafters += range(first, first + own)
        targets += range(first + own, first + topology.nproc_per_node)
    return tuple(targets), tuple(drafters)


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
    targets, drafters = place_roles(topology)
    return RankLayout(rank, world_size, local_rank, topology.nproc_per_node, targets, drafters)


TORCHRUN_VARIABLES = {
    "RANK": 0,
    "LOCAL_RANK": 0,
    "WORLD_SIZE": 1,
    "LOCAL_WORLD_SIZE": 1,
    "GROUP_WORLD_SIZE": 1,
}
"""The integers torchrun sets in each process it starts, and the least value each may take."""


def torchrun_variables() -> dict[str, int]:
    """The torchrun variables set in this process's environment, as integers; one that is not an
    integer at least its minimum is a UserError naming it (`dflash train` checks them before torch
    loads: a stray `WORLD_SIZE=abc` is a typo or a leftover export, not a traceback)."""
    found = {}
    for name, least in TORCHRUN_VARIABLES.items():
        text = os.environ.get(name)
        if text is None:
            continue
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise UserError(
                f"{name}={shown_value(text)}: expected an integer >= {least} (torchrun sets it in each process it starts; "
                f"outside torchrun, unset {name})"
            )
        found[name] = value
    return found


def shown_value(text: str) -> str:
    """A variable's value as an error line shows it: as it is, or quoted with escapes where it holds a
    newline or another character that would break the one line."""
    return text if text.isprintable() else repr(text)


def require_launch_matching(topology: TopologyConfig) -> None:
    """Before torch loads: under torchrun (it always sets TORCHELASTIC_RUN_ID), the job's shape is the
    config's (`layout_from_environment`); outside it, no torchrun variable left over from another
    launch claims another number of processes than the config lays out."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        layout_from_environment(topology)
        return
    expected = topology.nnodes * topology.nproc_per_node
    found = [name for name in TORCHRUN_VARIABLES if name in os.environ]
    if not found or torchrun_variables().get("WORLD_SIZE", 1) == expected:
        return
    launch = ", or launch under torchrun (entrypoint.sh train does)" if expected > 1 else ""
    raise UserError(
        f"{' '.join(f'{name}={shown_value(os.environ[name])}' for name in found)}: set outside torchrun (a leftover "
        f"export?) for a config that lays out {expected} process{'es' * (expected > 1)}; unset "
        f"{' '.join(found)}{launch}"
    )


def layout_from_environment(topology: TopologyConfig) -> RankLayout:
    """This process's layout from torchrun's RANK / WORLD_SIZE / LOCAL_RANK (one process: rank 0 of 1),
    its node count and processes per node checked against the config's (GROUP_WORLD_SIZE /
    LOCAL_WORLD_SIZE: 4 processes as 1 node x 4 is another placement than 2 x 2)."""
    variables = torchrun_variables()
    layout = layout_for(
        topology,
        rank=variables.get("RANK", 0),
        world_size=variables.get("WORLD_SIZE", 1),
        local_rank=variables.get("LOCAL_RANK", 0),
    )
    nodes = variables.get("GROUP_WORLD_SIZE", topology.nnodes)
    per_node = variables.get("LOCAL_WORLD_SIZE", topology.nproc_per_node)
    if (nodes, per_node) != (topology.nnodes, topology.nproc_per_node):
        raise UserError(
            f"topology: the config lays out nnodes {topology.nnodes} x nproc_per_node "
            f"{topology.nproc_per_node} but torchrun started {nodes} node{'s' if nodes > 1 else ''} x "
            f"{per_node} (GROUP_WORLD_SIZE={nodes}, LOCAL_WORLD_SIZE={per_node}); launch `torchrun --nnodes "
            f"{topology.nnodes} --nproc-per-node {topology.nproc_per_node}` on each of the "
            f"{topology.nnodes} nodes with one rendezvous (entrypoint.sh train does, from NNODES and RDZV_ENDPOINT)"
        )
    return layout


def describe_rank(layout: RankLayout, rank: int) -> str:
    """`target 2 (rank 5)`, `drafter 0 (rank 0)` or `colocated 1 (rank 1)` for any rank of the job; on
    several nodes also the node (`target 2 (rank 5, node 1)`)."""
    where = f"rank {rank}" + (f", node {layout.node_of(rank)}" if layout.nnodes > 1 else "")
    if rank in layout.target_ranks:
        return f"target {layout.target_ranks.index(rank)} ({where})"
    role = "colocated" if layout.colocated else "drafter"
    return f"{role} {layout.drafter_ranks.index(rank)} ({where})"
