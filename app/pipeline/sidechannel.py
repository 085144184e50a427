"""Small messages between ranks through torchrun's rendezvous store, outside the data path.

Heartbeats and the first failure (so that a killed or failing rank brings every rank down within
seconds, named in every log), the start point every rank agrees on (drafter rank 0 decides it,
resuming or not), target ranks' counters for the log line, and the end of the run. The store is a
TCPStore served by the torchrun agent (or by rank 0 without torchrun); each `SideChannel` opens its
own client connection, so threads never share one. Keys live under the job's run id and restart
count: a torchrun restart never reads the previous attempt's keys.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from app.data.batching import DataCursor
from app.pipeline.roles import RankLayout, describe_rank

Log = Callable[[str], None]


class StartTimeout(RuntimeError):
    """The start point never came: drafter rank 0 failed before deciding it."""


@dataclass(frozen=True)
class StartPoint:
    """Where every rank starts: the optimizer step and the global plan cursor (from a checkpoint or 0)."""

    step: int
    cursor: DataCursor
    resumed: bool = False
    """Drafter rank 0 loaded a checkpoint: the other drafter ranks receive its optimizer state."""


class SideChannel:
    """One client connection to the job's store, with the keys of this module."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    @classmethod
    def connect(cls, timeout_s: float) -> SideChannel:
        """A new client of the rendezvous store named by torchrun's MASTER_ADDR / MASTER_PORT."""
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        job = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(dist.PrefixStore(f"dflash/{job}/{attempt}/", client))

    # ---- heartbeats ---------------------------------------------------------------------------------

    def beat(self, rank: int) -> int:
        return self.store.add(f"heartbeat/{rank}", 1)

    def beats(self, rank: int) -> int:
        """Heartbeats `rank` has sent so far (adding 0 reads a counter without blocking)."""
        return self.store.add(f"heartbeat/{rank}", 0)

    def mark_left(self, rank: int) -> None:
        """`rank` exits on purpose: its heartbeats stop, and that is not a failure."""
        self.store.set(f"left/{rank}", "1")

    def has_left(self, rank: int) -> bool:
        return self.store.check([f"left/{rank}"])

    # ---- failures -----------------------------------------------------------------------------------

    def post_failure(self, rank: int, cause: str) -> dict[str, Any]:
        """Record `rank`'s failure unless one is already recorded; returns the one that counts (the first)."""
        mine = json.dumps({"rank": rank, "cause": cause})
        first = self.store.compare_set("failure", "", mine)
        return json.loads(first)

    def failure(self) -> dict[str, Any] | None:
        """The job's first failure ({rank, cause}), or None."""
        if not self.store.check(["failure"]):
            return None
        return json.loads(self.store.get("failure"))

    def wait_failure(self, timeout_s: float, poll_s: float = 0.05) -> dict[str, Any] | None:
        """The job's first failure once one is recorded, or None after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (failure := self.failure()) is None and time.monotonic() < deadline:
            time.sleep(poll_s)
        return failure

    # ---- start and end ------------------------------------------------------------------------------

    def publish_start(self, start: StartPoint) -> None:
        state = {"step": start.step, "cursor": start.cursor.state_dict(), "resumed": start.resumed}
        self.store.set("start", json.dumps(state))

    def wait_start(self, timeout_s: float) -> StartPoint:
        """Block until drafter rank 0 has published the start point (it loads the checkpoint first)."""
        self.wait_for("start", "drafter rank 0 published no start point", timeout_s)
        state = json.loads(self.store.get("start"))
        return StartPoint(state["step"], DataCursor.from_state_dict(state["cursor"]), state["resumed"])

    def mark_ready(self, name: str) -> None:
        self.store.set(f"ready/{name}", "1")

    def wait_ready(self, name: str, what: str) -> None:
        """Wait, as long as it takes, for `mark_ready(name)`; a failure anywhere in the job ends the wait."""
        self.wait_for(f"ready/{name}", what, timeout_s=None)

    def wait_for(self, key: str, what: str, timeout_s: float | None, poll_s: float = 0.05) -> None:
        """Poll for `key`; raise `StartTimeout` on a recorded failure or after `timeout_s` (None: never)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.store.check([key]):
            failure = self.failure()
            if failure is not None:
                raise StartTimeout(
                    f"rank {failure['rank']} failed before training started: {failure['cause']}"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise StartTimeout(f"{what} within {timeout_s:.0f}s (topology.recv_timeout_s)")
            time.sleep(poll_s)

    def publish_finished(self, reason: str, step: int) -> None:
        """The drafters are done ("completed" or "stopped") at `step`: targets stop producing."""
        self.store.set("finished", json.dumps({"reason": reason, "step": step}))

    def finished(self) -> dict[str, Any] | None:
        if not self.store.check(["finished"]):
            return None
        return json.loads(self.store.get("finished"))

    # ---- target counters ----------------------------------------------------------------------------

    def publish_target_stats(self, target: int, stats: dict[str, Any]) -> None:
        self.store.set(f"stats/target/{target}", json.dumps(stats))

    def target_stats(self, targets: int) -> list[dict[str, Any]]:
        """Every target's latest counters (empty dicts for targets that have not reported yet)."""
        keys = [f"stats/target/{t}" for t in range(targets)]
        return [json.loads(self.store.get(key)) if self.store.check([key]) else {} for key in keys]


class Watchdog:
    """A daemon thread per rank: heartbeats, and the job's fast failure path.

    Every `interval_s` it beats, reads the job's first failure, and checks heartbeats: global rank 0
    watches every rank, every other rank watches rank 0 (so the store sees O(ranks) requests per
    interval, not O(ranks^2)). A rank silent for `timeout_s` is recorded as the failure. On a
    failure of another rank this rank logs it and exits with status 1 after `grace_s` (its main thread
    may be blocked inside a collective that would otherwise only time out after recv_timeout_s).
    """

    def __init__(
        self,
        layout: RankLayout,
        side: SideChannel,
        log: Log,
        *,
        timeout_s: float,
        interval_s: float = 1.0,
        grace_s: float = 3.0,
        exit_process: Callable[[int], object] = os._exit,
    ) -> None:
        self.layout = layout
        self.side = side
        self.log = log
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.exit_process = exit_process
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=self.interval_s * 5)

    def _watched(self) -> list[int]:
        if self.layout.rank == 0:
            return [rank for rank in range(self.layout.world_size) if rank != 0]
        return [0]

    def _run(self) -> None:
        seen = {rank: (0, time.monotonic()) for rank in self._watched()}
        store_lost_since: float | None = None
        while not self._stopped.wait(self.interval_s):
            try:
                self.side.beat(self.layout.rank)
                cause = self._check(seen)
                store_lost_since = None
            except Exception as error:  # the store itself is unreachable: its host is gone
                now = time.monotonic()
                store_lost_since = store_lost_since or now
                if now - store_lost_since < self.timeout_s:
                    continue
                cause = (
                    f"lost the rendezvous store for {self.timeout_s:.0f}s ({type(error).__name__}: {error})"
                )
            if cause is not None:
                self._bring_down(cause)
                return

    def _check(self, seen: dict[int, tuple[int, float]]) -> str | None:
        failure = self.side.failure()
        if failure is not None:
            if failure["rank"] == self.layout.rank:
                return None  # this rank's main thread posted it and is exiting with its own traceback
            return f"{describe_rank(self.layout, failure['rank'])} failed: {failure['cause']}"
        now = time.monotonic()
        for rank, (count, since) in seen.items():
            beats = self.side.beats(rank)
            if beats != count:
                seen[rank] = (beats, now)
            elif now - since > self.timeout_s and not self.side.has_left(rank):
                silent = f"no heartbeat for {now - since:.0f}s (killed, hung hard, or its node is gone)"
                first = self.side.post_failure(rank, silent)
                return f"{describe_rank(self.layout, first['rank'])} failed: {first['cause']}"
        return None

    def _bring_down(self, cause: str) -> None:
        self.log(f"dflash: {self.layout.name}: stopping the job: {cause}")
        if self._stopped.wait(self.grace_s):
            return  # the main thread got out by itself
        self.log(f"dflash: {self.layout.name}: exiting (status 1) without waiting for blocked communication")
        self.exit_process(1)
