"""The target's forward for features replayed from CUDA graphs: one graph per batch shape of the run.

A small target is launch-bound: its eager forward queues kernels from Python for several times as
long as the GPU takes to run them, half of a colocated training step on an H200 (BENCHMARKS.md,
2026-12-04, the training loop's parts). Replayed from a graph, the host queues one launch. Every (rows, length) shape a run can produce is known before it starts
(`app.data.shapes`), so each gets its graph at warm-up, on the main thread, and none is captured later.

A graph holds the whole of a producer's work on the device: the forward (`TargetModel.features`, the
compiled norms, MLPs and RoPE included) and the gather of the packed row's tokens
(`app.data.packing.packed_features`). Inputs are copied into the graph's own buffers; the shared
output buffer is cloned out, so a caller may hold several results (micro-batches of one step).
The graphs share one memory pool: they run one at a time, and nothing of one outlives its replay
but the output copied out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from app.compile.apply import require_main_thread
from app.data.packing import packed_features
from app.model.target import TargetModel


class GraphedTargetFeatures:
    """`packed_features(target.features(input_ids), index, document_ids)` for the shapes given, each
    replayed from its CUDA graph; a shape outside them is refused (it would be a silent eager path)."""

    def __init__(
        self,
        target: TargetModel,
        shapes: Sequence[tuple[int, int]],
        token_budget: int,
        final_hidden: bool = False,
    ) -> None:
        """`final_hidden`: the target's final hidden states come after the features (`train.soft_targets`)."""
        if target.device.type != "cuda":
            raise RuntimeError("GraphedTargetFeatures: only on CUDA")
        require_main_thread("the target's CUDA graphs")
        started = time.perf_counter()
        device = target.device
        self.target = target
        self.final_hidden = final_hidden
        self._index = torch.zeros(token_budget, dtype=torch.int64, device=device)
        self._documents = torch.full((token_budget,), -1, dtype=torch.int32, device=device)
        width = (len(target.layer_ids) + int(final_hidden)) * target.hidden_size
        self._output = torch.empty(token_budget, width, dtype=target.dtype, device=device)
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.cuda.CUDAGraph]] = {}
        for rows, length in shapes:
            self._graphs[(rows, length)] = self._capture(rows, length)
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - started

    def _capture(self, rows: int, length: int) -> tuple[torch.Tensor, torch.cuda.CUDAGraph]:
        input_ids = torch.zeros(rows, length, dtype=torch.int64, device=self.target.device)

        def forward() -> None:
            features = self.target.features(input_ids, self.final_hidden)
            self._output.copy_(packed_features(features, self._index, self._documents))

        # one eager call first, on a side stream as capture needs: library JIT, autotuning and lazy
        # initialisation happen there, outside the graph
        side = torch.cuda.Stream(self.target.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            forward()
        return input_ids, graph

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return list(self._graphs)

    def __call__(
        self, input_ids: torch.Tensor, index: torch.Tensor, document_ids: torch.Tensor
    ) -> torch.Tensor:
        shape = (int(input_ids.shape[0]), int(input_ids.shape[1]))
        if shape not in self._graphs:
            raise RuntimeError(
                f"target batch shape {shape[0]}x{shape[1]} has no CUDA graph: it is not one of the run's "
                f"{len(self._graphs)} target shapes (data.token_budget, data.max_length)"
            )
        static_ids, graph = self._graphs[shape]
        static_ids.copy_(input_ids)
        self._index.copy_(index)
        self._documents.copy_(document_ids)
        graph.replay()
        return self._output.clone()

    def describe(self) -> str:
        return f"target CUDA graphs: {len(self._graphs)} batch shapes captured in {self.capture_s:.1f}s"
