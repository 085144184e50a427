"""SIGTERM / SIGINT during training: a request to stop after the current step, checkpointed.

The handler only sets a flag; the loop looks at it after each step. Under torchrun every drafter rank
must stop at the same step (they are in lockstep through DDP), so the ranks agree on the host (gloo)
whether any of them was asked.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from app.pipeline.distributed import Runtime

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Installs the stop handlers for the length of a training loop (`install` ... `restore`)."""

    def __init__(self, note: Callable[[str], None]) -> None:
        self.requested = False
        self._note = note
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        def request_stop(signum: int, frame: Any) -> None:
            self._note(f"received {signal.Signals(signum).name}: checkpointing after this step")
            self.requested = True

        self._previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def agreed(self, runtime: Runtime | None) -> bool:
        """Stop after this step? True on every drafter rank when any of them was asked."""
        if runtime is None or runtime.drafter_control is None or runtime.layout.num_drafters == 1:
            return self.requested
        flag = torch.tensor([int(self.requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=runtime.drafter_control)
        return bool(flag.item())
