"""The process groups of a torchrun job, named for what travels on them.

- `features` (the default group; NCCL on GPU, gloo on CPU): feature tensors and the borrowed heads,
  target -> drafter, point to point.
- `meta` (gloo, every rank): the small CPU header + packed row of each feature batch, so that a
  drafter knows on the host which batch arrived before touching the GPU.
- `drafters` (NCCL on GPU, gloo on CPU, drafter ranks only): DDP's gradient all-reduce.
- `drafter_control` (gloo, drafter ranks): per-step stop agreement and log-step counters, on the host.

Every group gets `topology.recv_timeout_s` as its timeout, so no collective or receive waits forever;
the watchdog (heartbeats through the rendezvous store) brings the job down much sooner when a rank
dies. One process per GPU: rank r uses cuda:LOCAL_RANK.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from app.config import RunConfig
from app.errors import UserError
from app.pipeline.roles import RankLayout, layout_from_environment
from app.pipeline.sidechannel import SideChannel, Watchdog

Log = Callable[[str], None]


@dataclass
class Runtime:
    """This rank's place in the job and the groups it communicates on."""

    layout: RankLayout
    device: torch.device
    features: dist.ProcessGroup
    meta: dist.ProcessGroup
    drafters: dist.ProcessGroup | None
    """None on target ranks."""
    drafter_control: dist.ProcessGroup | None
    side: SideChannel
    watchdog: Watchdog
    recv_timeout_s: float

    def close(self, *, clean: bool) -> None:
        """Leave the job: mark this rank as leaving on purpose, stop the watchdog, tear the groups down.

        `clean` False (an error or a stop signal may have left sends or receives pending) skips the
        group teardown, which could block on them; the process is about to exit anyway.
        """
        with contextlib.suppress(Exception):  # the store's host may already be gone at the very end
            self.side.mark_left(self.layout.rank)
        self.watchdog.stop()
        if clean:
            dist.destroy_process_group()


LOST_PEER_SIGNS = (
    "Connection reset by peer",  # gloo: the peer's socket closed mid-read (it died or exited)
    "Connection closed by peer",  # gloo: an orderly close from a peer that left
    "Broken pipe",  # gloo: a write to a peer that is gone
    "remote process exited",  # NCCL: its remote-error text
)
"""What a collective's or a receive's error says when its other end went away."""


def lost_a_peer(error: BaseException) -> bool:
    """True for an error that only says a peer of a collective left the job: a consequence of another
    rank's failure (killed, or exiting on its own error), never a job's first failure. It names no
    rank (gloo's pair errors give an address), so the rank that saw why must be the one to say it."""
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in LOST_PEER_SIGNS)


def wants_distributed(config: RunConfig) -> bool:
    """True when the topology lays out more than one process (run under torchrun)."""
    return config.topology.nnodes * config.topology.nproc_per_node > 1


def start_runtime(config: RunConfig, log: Log) -> Runtime:
    """Join the torchrun job: layout, device, process groups, side channel and watchdog."""
    topology = config.topology
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        world = topology.nnodes * topology.nproc_per_node
        raise UserError(
            f"topology: {world} processes configured; launch under torchrun "
            f"(`torchrun --nnodes {topology.nnodes} --nproc-per-node {topology.nproc_per_node} "
            "--no-python dflash train ...`, which entrypoint.sh train runs)"
        )
    layout = layout_from_environment(topology)
    device = _rank_device(config.train.device, layout.local_rank)
    timeout = timedelta(seconds=topology.recv_timeout_s)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    features = dist.group.WORLD
    assert features is not None
    meta = dist.new_group(backend="gloo", timeout=timeout)
    # new_group is collective over the whole job: every rank creates every group, in the same order.
    drafters = dist.new_group(list(layout.drafter_ranks), timeout=timeout)
    drafter_control = dist.new_group(list(layout.drafter_ranks), backend="gloo", timeout=timeout)
    side = SideChannel.connect(topology.recv_timeout_s)
    watchdog = Watchdog(
        layout, SideChannel.connect(topology.recv_timeout_s), log, timeout_s=topology.heartbeat_timeout_s
    )
    log(f"{layout.name}: {layout.role} on {device} ({dist.get_backend(features)}, {layout.world_size} ranks)")
    return Runtime(
        layout=layout,
        device=device,
        features=features,
        meta=meta,
        drafters=drafters if layout.trains else None,
        drafter_control=drafter_control if layout.trains else None,
        side=side,
        watchdog=watchdog.start(),
        recv_timeout_s=topology.recv_timeout_s,
    )


def _rank_device(choice: str, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is used, else the CPU (gloo)."""
    use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("train.device: cuda requested but no CUDA device is visible")
    if local_rank >= torch.cuda.device_count():
        raise UserError(
            f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
            "topology.nproc_per_node must not exceed the GPUs per node"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
