"""Checkpoints written in the background: training pauses only to copy its state to host memory.

A synchronous save (write, checksum, fsync) held every rank's training for about half a minute at the
benchmark drafter's size (BENCHMARKS.md, 2026-11-30, checkpoint pause). Here the training thread copies
the state into host memory (`HostSnapshot`) and one writer thread runs `save_checkpoint` on the
copy: the same atomic, checksummed write, renamed into place only when complete.

At most one write is in flight, so host memory holds at most one copy: a save that finds the
previous write still running waits for it. A failed write is raised on the training thread at its
next look (`completed`), naming the checkpoint and the cause; when the OS refused it (a full disk) it
is a `UserError`, naming the earlier checkpoint that is kept.
"""

from __future__ import annotations

import errno
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.checkpoint.store import PREFIX, checkpoint_root, latest_checkpoint, save_checkpoint
from app.errors import UserError

SPACE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
"""Refusals that more room cures: a full disk, a full quota, a file size limit."""


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed (it left nothing behind; earlier checkpoints are intact)."""


class CheckpointStorageError(CheckpointWriteError, UserError):
    """The OS refused a checkpoint write (disk full, quota, permissions): a problem of the machine the
    run is given, not of the run, so it ends in one line and exit 2 like other bad input."""


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint that is now complete on disk."""

    path: Path
    step: int


class CheckpointWriter:
    """Writes one run's checkpoints from a background thread, one at a time."""

    def __init__(self, run_dir: Path, keep_last: int) -> None:
        self.run_dir = run_dir
        self.keep_last = keep_last
        self._thread: threading.Thread | None = None
        self._finished: list[SavedCheckpoint] = []
        self._failure: CheckpointWriteError | None = None
        self._lock = threading.Lock()
        self._snapshot = HostSnapshot()

    def save(
        self,
        step: int,
        model_state: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any],
        rng_state: dict[str, Any],
        state: dict[str, Any],
    ) -> Path:
        """Copy the state to host memory now and write it in the background; returns the path the
        checkpoint will have. Waits for a write still in flight first (and raises its failure)."""
        self._join()  # the write in flight reads the host buffers this save is about to overwrite
        self._raise_failure()
        snapshot = (*self._snapshot.copy((model_state, optimizer_state, rng_state)), dict(state))
        self._thread = threading.Thread(
            target=self._write, args=(step, *snapshot), name="dflash-checkpoint-writer", daemon=False
        )
        self._thread.start()
        return checkpoint_root(self.run_dir) / f"{PREFIX}{step:08d}"

    def completed(self, block: bool) -> list[SavedCheckpoint]:
        """Checkpoints completed since the last call (to report), after waiting for the write in
        flight when `block`. Raises CheckpointWriteError if a write failed."""
        if block:
            self._join()
        self._raise_failure()
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def _write(self, step: int, *snapshot: Any) -> None:
        try:
            path = save_checkpoint(self.run_dir, step, *snapshot, keep_last=self.keep_last)
        except Exception as error:  # reported on the training thread, which decides what it means
            failure = self._failure_of(step, error)
            with self._lock:
                self._failure = failure
            return
        with self._lock:
            self._finished.append(SavedCheckpoint(path, step))

    def _failure_of(self, step: int, error: Exception) -> CheckpointWriteError:
        root = checkpoint_root(self.run_dir)
        what = f"checkpoint of step {step} in {root} could not be written"
        if not isinstance(error, OSError):
            return CheckpointWriteError(f"{what} ({type(error).__name__}: {error})")
        try:
            kept = latest_checkpoint(root)
            previous = f"the previous checkpoint {kept.name} is kept" if kept else "there is no earlier one"
        except OSError:  # the directory that refused the write refuses the look too: still say what failed
            previous = "the earlier checkpoints are as they were"
        remedy = "free space (or raise the quota or file size limit)"
        if error.errno not in SPACE_ERRORS:
            remedy = f"make {root} writable"
        return CheckpointStorageError(
            f"{what} ({error.strerror or error}); {previous}: {remedy}, then continue with --resume"
        )

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _raise_failure(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure


class HostSnapshot:
    """Host buffers the training state is copied into at a save, reused by every later save.

    A run's checkpoint holds the same tensors at every save, so the buffers are allocated once, in
    page-locked memory for GPU tensors: the copies are queued back to back and run at the link's
    speed; a fresh pageable copy spends most of its time faulting in new host pages (BENCHMARKS.md,
    2026-11-30, checkpoint pause).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(self, value: Any) -> Any:
        """`value` with every tensor copied into this snapshot's buffers (nested dicts, lists and
        tuples, as optimizer state is). Training may change the originals the moment this returns;
        the copies stay valid until the next call."""
        gpus: set[torch.device] = set()
        copied = self._copy(value, (), gpus)
        for gpu in gpus:
            torch.cuda.synchronize(gpu)  # the queued device-to-host copies are complete
        return copied

    def _copy(self, value: Any, path: tuple[Any, ...], gpus: set[torch.device]) -> Any:
        if isinstance(value, torch.Tensor):
            if value.is_cuda:
                gpus.add(value.device)
            return self._buffer(value, path).copy_(value.detach(), non_blocking=value.is_cuda)
        if isinstance(value, dict):
            return {key: self._copy(item, (*path, key), gpus) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._copy(item, (*path, index), gpus) for index, item in enumerate(value))
        return value

    def _buffer(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[path] = buffer
        return buffer
