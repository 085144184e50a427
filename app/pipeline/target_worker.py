"""A target rank: prepare its batches, run the frozen target, send the features to their drafters.

Three stages, each bounded: a data thread collates and packs the rank's batches ahead of time
(`q_pre`, at most `topology.prefetch_batches`); the main thread runs the target forward and keeps
the real tokens' features, padded to the row's fixed shape; the send thread ships each batch to its
drafter (`transport.FeatureSender`). Target ranks hold no drafter and no optimizer. They produce
exactly the batches the drafters will train on (the same rounds, from the start point drafter
rank 0 publishes), so on a normal finish every send has been received.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.compile.guard import recompile_errors
from app.compile.library_jit import LibraryJitCounter
from app.compile.prepare import start_target_rank
from app.config import RunConfig
from app.data.batching import BatchPlanner
from app.data.dataset import TokenizedDataset
from app.model.target import TargetModel
from app.pipeline.assignment import Delivery, RoundPlanner
from app.pipeline.distributed import Runtime
from app.pipeline.features import eager_forward, features_on_device
from app.pipeline.prefetch import BatchPreparer, Prefetcher, PreparedBatch
from app.pipeline.sidechannel import SideChannel
from app.pipeline.transport import FeatureSender, Outgoing, TransportError, encode_meta, send_heads
from app.signals import stop_signals

Log = Callable[[str], None]


class TargetStopped(Exception):
    """The drafters stopped early (a signal): this target rank stops producing; pending sends are dropped."""

    def __init__(self) -> None:
        super().__init__(
            "stopped: the drafters stopped early (a signal); batches not yet received are dropped"
        )


@dataclass
class Prepared:
    """A batch prepared on the host, waiting for the target forward (`q_pre`), with its wire header."""

    delivery: Delivery
    batch: PreparedBatch
    meta: torch.Tensor


class TargetWorker:
    """The whole life of a target rank; `run()` returns when its last batch has been received."""

    def __init__(
        self,
        config: RunConfig,
        runtime: Runtime,
        train_data: TokenizedDataset,
        target: TargetModel,
        planner: BatchPlanner,
        pad_id: int,
        log: Log,
        *,
        cache_loaded: bool,
    ) -> None:
        """`cache_loaded`: `prepare_target_rank` loaded the run's compile-cache entry."""
        self.config = config
        self.runtime = runtime
        self.train_data = train_data
        self.planner = planner
        self.pad_id = pad_id
        self.log = log
        layout = runtime.layout
        self.index = layout.index
        self.rounds = RoundPlanner.for_layout(planner, layout, config.train.grad_accum)
        self.total_steps = self.rounds.total_steps(config.train.epochs)
        if config.train.max_steps is not None:
            self.total_steps = min(self.total_steps, config.train.max_steps)
        self.target = target
        self.prepare = BatchPreparer(
            train_data, planner.shapes, token_budget=config.data.token_budget, anchors=config.train.anchors,
            pad_token_id=pad_id, seed=config.train.seed, device=runtime.device,
        )  # fmt: skip
        self._prefetcher: Prefetcher[Prepared] | None = None
        self._stats_channel = SideChannel.connect(config.topology.recv_timeout_s)
        self.batches = 0
        self.forward_seconds = 0.0
        graphs = None
        if runtime.device.type == "cuda":  # on the main thread, before the preparer thread exists
            graphs = start_target_rank(config, self.target, cache_loaded, log)
        self.forward = graphs or eager_forward(target)
        # After the baked Triton files are in place and warm-up: what this rank's forwards add is library JIT.
        self.library_jit = LibraryJitCounter()

    def run(self) -> None:
        runtime, layout = self.runtime, self.runtime.layout
        if self.index == 0:
            send_heads(runtime, self.target.embed_tokens, self.target.lm_head)
        start = runtime.side.wait_start(runtime.recv_timeout_s)
        steps = self.total_steps - start.step
        mine = (
            delivery
            for delivery in self.rounds.deliveries(start.cursor, self.config.train.epochs, steps)
            if delivery.target == self.index
        )
        assert self.rounds.feeding is not None
        fed = sorted({drafter for target, drafter in self.rounds.feeding.pairs() if target == self.index})
        self.log(
            f"producing for {steps} steps from epoch {start.cursor.epoch} batch {start.cursor.batch} "
            f"on node {layout.node}, for drafter{'s' if len(fed) > 1 else ''} {','.join(map(str, fed))}"
        )
        self._prefetcher = Prefetcher(
            mine, self._prepared, depth=self.config.topology.prefetch_batches, device=runtime.device
        )
        sender = FeatureSender(runtime, self._sent)
        # SIGTERM/SIGINT (docker stop reaches every rank) do not stop a target: the drafters agree on the
        # step to stop after, and may still need batches for it; they publish "stopped" and this rank
        # then ends (`TargetStopped`). A dead drafter group brings it down through the watchdog instead.
        try:
            with stop_signals(
                lambda sig: self.log(f"received {sig.name}: feeding the drafters until they stop")
            ):
                while (prepared := self._next_prepared()) is not None:
                    if not sender.put(self._forward(prepared), abandon=self._drafters_stopped):
                        raise TargetStopped()
                if not sender.finish(abandon=self._drafters_stopped):
                    raise TargetStopped()
        except TransportError:
            if self._drafters_stopped():  # a drafter that stopped on purpose closed its connections
                raise TargetStopped() from None
            raise
        finally:
            self._prefetcher.close()
        self.log(f"done: {self.batches} batches sent, {self.forward_seconds:.0f}s in the target forward")

    def _next_prepared(self) -> Prepared | None:
        assert self._prefetcher is not None

        def give_up_if_stopped() -> None:
            if self._drafters_stopped():
                raise TargetStopped()

        return self._prefetcher.next(poll=give_up_if_stopped)

    def _prepared(self, delivery: Delivery) -> Prepared:
        """Data thread: the delivery's batch on the host (pinned on GPU) and its wire header."""
        prepared = self.prepare(delivery.batch)
        return Prepared(delivery, prepared, encode_meta(delivery.batch, prepared.row, prepared.real_tokens))

    def _forward(self, prepared: Prepared) -> Outgoing:
        device = self.runtime.device
        started = time.perf_counter()
        began = ready = None
        if device.type == "cuda":  # the host only queues the forward: time it on the GPU (in `_sent`)
            began, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
        with recompile_errors():
            # the real tokens' features padded to the row's fixed shape: every send is alike
            width = len(self.target.layer_ids) * self.target.hidden_size
            features = features_on_device(self.forward, prepared.batch, device, width).features
        if ready is not None:
            ready.record()
        else:
            self.forward_seconds += time.perf_counter() - started
        return Outgoing(prepared.delivery, prepared.meta, features, ready, began)

    def _sent(self, item: Outgoing) -> None:
        """Send thread, after each batch: counters for the drafters' log line."""
        if item.began is not None and item.ready is not None:
            item.ready.synchronize()  # long done: the send waited for it
            self.forward_seconds += item.began.elapsed_time(item.ready) / 1000
        self.batches += 1
        self._stats_channel.publish_target_stats(
            self.index,
            {
                "q_pre": self._prefetcher.waiting() if self._prefetcher is not None else 0,
                "forward_s": round(self.forward_seconds, 3),
                "library_jit": self.library_jit.new(),
            },
        )

    def _drafters_stopped(self) -> bool:
        """The drafters stopped before the end (a signal): nothing more will be received.

        A "completed" finish never abandons anything: the drafters received every batch first.
        """
        finished = self.runtime.side.finished()
        return finished is not None and finished["reason"] == "stopped"
