"""Feature batches from target ranks to drafter ranks: fixed-shape point-to-point messages.

Each batch travels as two messages, both the same shape for every batch of a run:
- `meta` (int64, host memory, over the gloo `meta` group): a header (epoch, plan index, a digest of
  the batch's sample ids, real tokens) and the packed drafter row, so the drafter knows on the host
  which batch arrived and checks it against its own copy of the plan before using it;
- `features` (`[token_budget, K*H]` in the target's dtype, over the `features` group: NCCL on GPU):
  the real tokens' features first, zeros after; the drafter trains on it as is.

Senders and receivers walk the same delivery order (`RoundPlanner.deliveries`), each filtering its
own, with one message in flight per direction and bounded queues on both sides: a drafter whose
queue (`topology.feature_queue`) is full stops receiving, which blocks the target sending to it,
whose send queue then fills and stops its forward. Every wait has a deadline.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from app.data.batch import DrafterRow, FeatureBatch
from app.data.batching import PlannedBatch
from app.pipeline.assignment import Delivery
from app.pipeline.distributed import Runtime

HEADER = ("version", "epoch", "index", "digest", "real_tokens")
VERSION = 1
POLL_S = (0.0005, 0.02)
"""First and longest interval between polls of an in-flight NCCL transfer: quick for the usual
millisecond transfer, backing off during long waits (a full drafter queue) so the polling thread
does not keep taking the GIL from the main thread's forward or step."""


class TransportError(RuntimeError):
    """A feature batch could not be sent or received: the message names the peer and the batch.

    `peer_rank` is the rank whose loss (death, hang) explains the error, when it does: the job's
    failure is then recorded under that rank, not under the rank that noticed it.
    """

    def __init__(self, message: str, peer_rank: int | None = None) -> None:
        super().__init__(message)
        self.peer_rank = peer_rank


def sample_digest(sample_ids: list[int]) -> int:
    """A 63-bit digest of a batch's sample ids: sender and receiver must agree on the batch's content."""
    data = ",".join(map(str, sample_ids)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def meta_length(token_budget: int, anchors: int) -> int:
    return len(HEADER) + 4 * token_budget + 2 * anchors


def encode_meta(batch: PlannedBatch, row: DrafterRow, real_tokens: int) -> torch.Tensor:
    """The header and the packed row of `batch` as one int64 host tensor."""
    header = torch.tensor(
        [VERSION, batch.epoch, batch.index, sample_digest(batch.sample_ids), real_tokens], dtype=torch.int64
    )
    parts = [
        row.input_ids,
        row.position_ids,
        row.document_ids,
        row.loss_mask,
        row.anchor_positions,
        row.anchor_valid,
    ]
    return torch.cat([header, *(part.cpu().to(torch.int64) for part in parts)])


def decode_meta(meta: torch.Tensor, token_budget: int, anchors: int) -> tuple[dict[str, int], DrafterRow]:
    """Inverse of `encode_meta`: the header fields and the packed row (host tensors)."""
    header = dict(zip(HEADER, meta[: len(HEADER)].tolist(), strict=True))
    body = meta[len(HEADER) :]
    t, a = token_budget, anchors
    row = DrafterRow(
        input_ids=body[:t].clone(),
        position_ids=body[t : 2 * t].clone(),
        document_ids=body[2 * t : 3 * t].to(torch.int32),
        loss_mask=body[3 * t : 4 * t].to(torch.bool),
        anchor_positions=body[4 * t : 4 * t + a].clone(),
        anchor_valid=body[4 * t + a : 4 * t + 2 * a].to(torch.bool),
    )
    return header, row


def _complete(work: dist.Work, device: torch.device, timeout_s: float) -> None:
    """Wait for a point-to-point transfer on the host, at most `timeout_s`.

    gloo's wait blocks (bounded by the group timeout). NCCL's wait only orders streams, so poll its
    completion: the host must know the data is there (queue depths, backpressure, deadlines).
    """
    if device.type != "cuda":
        work.wait()
        return
    deadline = time.monotonic() + timeout_s
    interval, longest = POLL_S
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"transfer not complete after {timeout_s:.0f}s (topology.recv_timeout_s)")
        time.sleep(interval)
        interval = min(2 * interval, longest)


@dataclass
class Outgoing:
    """One batch ready to send: where it goes, its meta, its padded features (on the target's device)."""

    delivery: Delivery
    meta: torch.Tensor
    features: torch.Tensor
    ready: torch.cuda.Event | None = None
    """CUDA: recorded after the features were written; the send waits for it and nothing else."""
    began: torch.cuda.Event | None = None
    """CUDA: recorded before the batch's forward; `began.elapsed_time(ready)` is its GPU time."""


class FeatureSender:
    """A target rank's send thread: one batch in flight, `depth` ready batches queued behind it."""

    def __init__(self, runtime: Runtime, on_sent: Callable[[Outgoing], None], depth: int = 2) -> None:
        self.runtime = runtime
        self.on_sent = on_sent
        self._queue: queue.Queue[Outgoing | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dflash-feature-sender", daemon=True)
        self._thread.start()

    def put(self, item: Outgoing, abandon: Callable[[], bool]) -> bool:
        """Queue `item`, waiting while the queue is full; False if `abandon()` says to stop waiting."""
        return self._offer(item, abandon)

    def finish(self, abandon: Callable[[], bool]) -> bool:
        """Send everything queued, then stop the thread; False if abandoned before that."""
        if not self._offer(None, abandon):
            return False
        while self._thread.is_alive():
            self._thread.join(timeout=0.2)
            self._raise_if_failed()
            if abandon():
                return False
        self._raise_if_failed()
        return True

    def _offer(self, item: Outgoing | None, abandon: Callable[[], bool]) -> bool:
        while True:
            self._raise_if_failed()
            if abandon():
                return False
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        runtime = self.runtime
        stream = None
        if runtime.device.type == "cuda":
            torch.cuda.set_device(runtime.device)
            stream = torch.cuda.Stream(runtime.device)  # waits for its batch only, not the next forward
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            while (item := self._queue.get()) is not None:
                delivery = item.delivery
                peer = runtime.layout.drafter_ranks[delivery.drafter]
                try:
                    if stream is not None and item.ready is not None:
                        stream.wait_event(item.ready)
                    dist.send(item.meta, peer, group=runtime.meta)
                    work = dist.isend(item.features, peer, group=runtime.features)
                    _complete(work, runtime.device, runtime.recv_timeout_s)
                except Exception as error:
                    self._error = TransportError(
                        f"{runtime.layout.name}: sending epoch {delivery.batch.epoch} batch "
                        f"{delivery.batch.index} to drafter {delivery.drafter} (rank {peer}) failed: "
                        f"{type(error).__name__}: {_first_line(error)}",
                        peer_rank=peer,
                    )
                    return
                self.on_sent(item)


@dataclass
class _Received:
    delivery: Delivery
    row: DrafterRow
    real_tokens: int
    features: torch.Tensor
    stream_order: dist.Work | None
    """NCCL: the transfer, for the consuming stream to wait on. gloo: None (complete; a second wait
    on a finished gloo receive would block until the timeout)."""


class FeatureReceiver:
    """A drafter rank's receive thread: receives its deliveries in order into a bounded queue."""

    def __init__(
        self,
        runtime: Runtime,
        deliveries: Iterator[Delivery],
        *,
        token_budget: int,
        anchors: int,
        feature_size: int,
        dtype: torch.dtype,
        capacity: int,
    ) -> None:
        self.runtime = runtime
        self.token_budget = token_budget
        self.anchors = anchors
        self.feature_size = feature_size
        self.dtype = dtype
        self._deliveries = deliveries
        self._queue: queue.Queue[_Received | BaseException] = queue.Queue(maxsize=capacity)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-feature-receiver", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """`q_hs`: batches received and waiting for the trainer."""
        return self._queue.qsize()

    def get(self, delivery: Delivery) -> tuple[FeatureBatch, int]:
        """The next batch (it must be `delivery`) as a FeatureBatch on this rank's device, and its real tokens."""
        runtime = self.runtime
        peer = runtime.layout.target_ranks[delivery.target]
        try:
            item = self._queue.get(timeout=runtime.recv_timeout_s)
        except queue.Empty:
            raise TransportError(
                f"{runtime.layout.name}: no feature batch within topology.recv_timeout_s="
                f"{runtime.recv_timeout_s:.0f}s (waiting for epoch {delivery.batch.epoch} batch "
                f"{delivery.batch.index} from target {delivery.target} (rank {peer}))",
                peer_rank=peer,
            ) from None
        if isinstance(item, BaseException):
            raise item
        assert item.delivery == delivery, f"received {item.delivery}, expected {delivery}"
        features = item.features
        if item.stream_order is not None:
            item.stream_order.wait()  # NCCL: this thread's stream waits for the transfer
            # Allocated on the receive stream, used on this one: keep the allocator from reusing it early.
            features.record_stream(torch.cuda.current_stream(features.device))
        return FeatureBatch(row=item.row.to(features.device), features=features), item.real_tokens

    def close(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        runtime = self.runtime
        stream = None
        if runtime.device.type == "cuda":
            torch.cuda.set_device(runtime.device)
            stream = torch.cuda.Stream(runtime.device)  # never waits behind the training step's kernels
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for delivery in self._deliveries:
                if self._stopped.is_set():
                    return
                try:
                    item = self._receive(delivery)
                except Exception as error:
                    peer = runtime.layout.target_ranks[delivery.target]
                    self._put(
                        TransportError(
                            f"{runtime.layout.name}: receiving epoch {delivery.batch.epoch} batch "
                            f"{delivery.batch.index} from target {delivery.target} (rank {peer}) failed: "
                            f"{type(error).__name__}: {_first_line(error)}",
                            peer_rank=None if isinstance(error, TransportError) else peer,
                        )
                    )
                    return
                if not self._put(item):
                    return

    def _receive(self, delivery: Delivery) -> _Received:
        runtime = self.runtime
        peer = runtime.layout.target_ranks[delivery.target]
        meta = torch.empty(meta_length(self.token_budget, self.anchors), dtype=torch.int64)
        dist.recv(meta, peer, group=runtime.meta)
        header, row = decode_meta(meta, self.token_budget, self.anchors)
        expected = {
            "version": VERSION,
            "epoch": delivery.batch.epoch,
            "index": delivery.batch.index,
            "digest": sample_digest(delivery.batch.sample_ids),
        }
        wrong = {key: header[key] for key, value in expected.items() if header[key] != value}
        if wrong:
            raise TransportError(
                f"received {wrong} where the plan says {expected}: the ranks disagree on the batch plan "
                "(different data, config or code on some rank?)"
            )
        features = torch.empty(self.token_budget, self.feature_size, dtype=self.dtype, device=runtime.device)
        work = dist.irecv(features, peer, group=runtime.features)
        _complete(work, runtime.device, runtime.recv_timeout_s)
        return _Received(delivery, row, header["real_tokens"], features, work if features.is_cuda else None)

    def _put(self, item: _Received | BaseException) -> bool:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False


# ---- the borrowed heads -------------------------------------------------------------------------------


def send_heads(runtime: Runtime, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
    """Target 0 -> every drafter: the target's frozen embedding and LM head, bit for bit."""
    tied = lm_head.weight.data_ptr() == embed_tokens.weight.data_ptr()
    vocab, hidden = embed_tokens.weight.shape
    header = torch.tensor([vocab, hidden, int(tied), int(lm_head.bias is not None)], dtype=torch.int64)
    tensors = [embed_tokens.weight.detach()]
    if not tied:
        tensors.append(lm_head.weight.detach())
    if lm_head.bias is not None:
        tensors.append(lm_head.bias.detach())
    for drafter in runtime.layout.drafter_ranks:
        dist.send(header, drafter, group=runtime.meta)
        for tensor in tensors:
            dist.send(tensor.contiguous(), drafter, group=runtime.features)


def receive_heads(runtime: Runtime, dtype: torch.dtype) -> tuple[nn.Embedding, nn.Linear]:
    """A drafter rank's copy of the target's embedding and LM head (frozen; tied if the target's are)."""
    source = runtime.layout.target_ranks[0]
    header = torch.empty(4, dtype=torch.int64)
    dist.recv(header, source, group=runtime.meta)
    vocab, hidden, tied, has_bias = header.tolist()

    def receive(*shape: int) -> torch.Tensor:
        tensor = torch.empty(*shape, dtype=dtype, device=runtime.device)
        dist.recv(tensor, source, group=runtime.features)
        return tensor

    embed = nn.Embedding(vocab, hidden, device="meta")
    embed.weight = nn.Parameter(receive(vocab, hidden), requires_grad=False)
    lm_head = nn.Linear(hidden, vocab, bias=bool(has_bias), device="meta")
    lm_head.weight = embed.weight if tied else nn.Parameter(receive(vocab, hidden), requires_grad=False)
    if has_bias:
        lm_head.bias = nn.Parameter(receive(vocab), requires_grad=False)
    return embed, lm_head


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
