"""A prepared batch's features on the device: the one step both producers (colocated, target rank) run.

The forward is either the target's eager one or its CUDA graphs (`app.compile.target_graphs`, with
`compile.target_cuda_graphs`); both return the packed row's features, `[token_budget, K*H]`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from app.data.batch import FeatureBatch
from app.data.packing import packed_features
from app.model.target import TargetModel
from app.pipeline.prefetch import PreparedBatch


class PackedForward(Protocol):
    def __call__(
        self, input_ids: torch.Tensor, index: torch.Tensor, document_ids: torch.Tensor
    ) -> torch.Tensor:
        """The target's features of `input_ids` `[rows, length]` gathered onto the packed row."""


def eager_forward(target: TargetModel, final_hidden: bool = False) -> PackedForward:
    """The target's own forward (with its final hidden states: `train.soft_targets`), then the gather."""

    def forward(input_ids: torch.Tensor, index: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
        return packed_features(target.features(input_ids, final_hidden), index, document_ids)

    return forward


def features_on_device(
    forward: PackedForward, prepared: PreparedBatch, device: torch.device, feature_size: int
) -> FeatureBatch:
    """Copy `prepared` to `device` (queued, from pinned memory on CUDA) and queue the forward: nothing
    here waits for the GPU. The forward's columns past `feature_size` are the target's final hidden
    states (`FeatureBatch.split`)."""
    row = prepared.row.to(device, non_blocking=True)
    input_ids = prepared.batch.input_ids.to(device, non_blocking=True)
    index = prepared.token_index.to(device, non_blocking=True)
    return FeatureBatch.split(row, forward(input_ids, index, row.document_ids), feature_size)
