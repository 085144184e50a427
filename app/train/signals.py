"""SIGTERM / SIGINT during training: a request to stop after the current step, checkpointed.

The handler only sets a flag (no print: a signal arriving during a print to the same stream would
raise a reentrant-call error); the loop looks at it after each step and says so then. Under torchrun every drafter rank
must stop at the same step (they are in lockstep through DDP), so the ranks agree on the host (gloo)
whether any of them was asked.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable

import torch
import torch.distributed as dist

from app.pipeline.distributed import Runtime
from app.signals import stop_signals


class StopRequest:
    """Installs the stop handlers for the length of a training loop (`install` ... `restore`)."""

    def __init__(self, note: Callable[[str], None]) -> None:
        self.requested = False
        self.received: str | None = None
        """The signal's name, until the loop has said it."""
        self._note = note
        self._installed = contextlib.ExitStack()

    def install(self) -> None:
        self._installed.enter_context(stop_signals(self._request))

    def restore(self) -> None:
        self._installed.close()

    def _request(self, sig: signal.Signals) -> None:
        self.requested, self.received = True, sig.name

    def agreed(self, runtime: Runtime | None) -> bool:
        """Stop after this step? True on every drafter rank when any of them was asked."""
        if self.received is not None:
            self._note(f"received {self.received}: checkpointing after this step")
            self.received = None
        if runtime is None or runtime.drafter_control is None or runtime.layout.num_drafters == 1:
            return self.requested
        flag = torch.tensor([int(self.requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=runtime.drafter_control)
        return bool(flag.item())
