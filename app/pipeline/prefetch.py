"""The host side of a target batch, and the data thread that does it ahead of the GPU.

Both producers of features (a colocated rank, a target rank) turn a planned batch into the same
host tensors: the padded target batch, its packed drafter row and the row's token index
(`app.data.packing`). A data thread prepares them a few batches ahead, so that the main thread
only copies them to the device and queues the target's forward: measured on an H200, collating and
packing a 16K-token batch on the main thread held a small target's training step for 16 ms of its
105 (BENCHMARKS.md, 2026-12-04, the training loop's parts).

The thread compiles nothing (compilation belongs to the main thread, `app.compile.apply`) and
decides nothing: what a batch holds is a function of (seed, epoch, index) whichever thread builds it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from app.data.batch import DrafterRow, TargetBatch
from app.data.batching import PlannedBatch, collate
from app.data.dataset import TokenizedDataset
from app.data.packing import pack_row, token_index
from app.data.shapes import TargetShapes

Item = TypeVar("Item")
Prepared = TypeVar("Prepared")

POLL_S = 0.2
"""How often a waiting side looks up from its queue (the consumer's `poll`, the producer's stop)."""


@dataclass
class PreparedBatch:
    """One planned batch on the host, ready to copy to the device (pinned there when it is CUDA)."""

    planned: PlannedBatch
    batch: TargetBatch
    row: DrafterRow
    token_index: torch.Tensor
    """`[token_budget]`: each packed position's place in the batch's flattened tokens (`packing.token_index`)."""
    real_tokens: int


class BatchPreparer:
    """collate -> pack_row -> token index for one run's data and shapes (pinned for a CUDA device)."""

    def __init__(
        self,
        dataset: TokenizedDataset,
        shapes: TargetShapes,
        *,
        token_budget: int,
        anchors: int,
        pad_token_id: int,
        seed: int,
        device: torch.device,
    ) -> None:
        self.dataset = dataset
        self.shapes = shapes
        self.token_budget = token_budget
        self.anchors = anchors
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.pin = device.type == "cuda"

    def __call__(self, planned: PlannedBatch) -> PreparedBatch:
        batch = collate(self.dataset, planned.sample_ids, self.pad_token_id, self.shapes)
        row = pack_row(
            batch,
            token_budget=self.token_budget,
            anchors=self.anchors,
            pad_token_id=self.pad_token_id,
            seed=self.seed,
            epoch=planned.epoch,
            index=planned.index,
        )
        index = token_index(batch, self.token_budget)
        real_tokens = int(batch.attention_mask.sum())
        if self.pin:  # pinned: the copies to the GPU are queued, not waited for
            batch = TargetBatch(**{name: t.pin_memory() for name, t in vars(batch).items()})
            row = DrafterRow(**{name: t.pin_memory() for name, t in vars(row).items()})
            index = index.pin_memory()
        return PreparedBatch(planned, batch, row, index, real_tokens)


class Prefetcher(Generic[Prepared]):
    """A data thread applying `prepare` to `items` in order, at most `depth` results waiting.

    `next()` returns them in order and None after the last; an error in the thread is raised there.
    `close()` stops the thread (it ends at its next look, within `POLL_S`)."""

    def __init__(
        self,
        items: Iterator[Item],
        prepare: Callable[[Item], Prepared],
        *,
        depth: int,
        device: torch.device,
        name: str = "dflash-prepare",
    ) -> None:
        self._queue: queue.Queue[Prepared | BaseException | None] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._device = device
        self._thread = threading.Thread(target=self._run, args=(items, prepare), name=name, daemon=True)
        self._thread.start()

    def next(self, poll: Callable[[], None] | None = None) -> Prepared | None:
        """The next result; `poll` is called every `POLL_S` while waiting (it may raise to give up)."""
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if poll is not None:
                    poll()
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def waiting(self) -> int:
        """Results prepared and not yet taken (the log line's `q_pre`)."""
        return self._queue.qsize()

    def close(self) -> None:
        self._stop.set()

    def _run(self, items: Iterator[Item], prepare: Callable[[Item], Prepared]) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # pinning must not open a context on GPU 0
        try:
            for item in items:
                if not self._put(prepare(item)):
                    return
            self._put(None)
        except BaseException as error:  # raised to the consumer at its next `next()`
            self._put(error)

    def _put(self, value: Prepared | BaseException | None) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(value, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False
