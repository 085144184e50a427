"""Identical drafter replicas on every drafter rank: DDP over the drafter group, one optimizer state.

Only drafter rank 0 reads a checkpoint (the run directory need not be shared between nodes): DDP's
construction broadcasts its weights, and `broadcast_optimizer_state` its optimizer state, so every
replica takes bit-identical steps from there on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from app.pipeline.distributed import Runtime


def wrap_for_drafter_group(drafter: nn.Module, runtime: Runtime) -> DistributedDataParallel:
    """DDP over the drafter group; call after the weights are final on drafter rank 0 (it broadcasts them).

    Inputs are already on the rank's device (no DDP input scatter); `gradient_as_bucket_view` saves
    one gradient-sized copy.
    """
    assert runtime.drafters is not None, "only drafter ranks hold a drafter"
    return DistributedDataParallel(
        drafter,
        process_group=runtime.drafters,
        broadcast_buffers=False,
        gradient_as_bucket_view=True,
    )


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, runtime: Runtime) -> None:
    """Give every drafter rank drafter rank 0's optimizer state (after a resume there)."""
    assert runtime.drafters is not None and runtime.drafter_control is not None
    source = runtime.layout.drafter_ranks[0]
    leader = runtime.layout.rank == source
    tensors: list[torch.Tensor] = []
    skeleton: list[Any] = [_strip_tensors(optimizer.state_dict(), tensors) if leader else None]
    dist.broadcast_object_list(skeleton, src=source, group=runtime.drafter_control)
    specs: list[tuple[tuple[int, ...], torch.dtype, str]] = []
    _collect_specs(skeleton[0], specs)
    if not leader:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in specs]
    for tensor in tensors:
        # device tensors over the device's backend, host ones (e.g. AdamW's `step`) over gloo
        group = runtime.drafters if tensor.device.type == runtime.device.type else runtime.drafter_control
        dist.broadcast(tensor, src=source, group=group)
    if not leader:
        optimizer.load_state_dict(_fill_tensors(skeleton[0], iter(tensors)))


class _TensorSlot:
    """Placeholder of a state tensor in the pickled skeleton: shape, dtype and device type only."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.device = tensor.device.type


def _strip_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value.contiguous())
        return _TensorSlot(value)
    if isinstance(value, dict):
        return {key: _strip_tensors(item, tensors) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_strip_tensors(item, tensors) for item in value)
    return value


def _collect_specs(value: Any, specs: list[tuple[tuple[int, ...], torch.dtype, str]]) -> None:
    if isinstance(value, _TensorSlot):
        specs.append((value.shape, value.dtype, value.device))
    elif isinstance(value, dict):
        for item in value.values():
            _collect_specs(item, specs)
    elif isinstance(value, list | tuple):
        for item in value:
            _collect_specs(item, specs)


def _fill_tensors(value: Any, tensors: Any) -> Any:
    if isinstance(value, _TensorSlot):
        return next(tensors)
    if isinstance(value, dict):
        return {key: _fill_tensors(item, tensors) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_fill_tensors(item, tensors) for item in value)
    return value
