"""The hybrid target's short causal convolution (Gated DeltaNet's conv over q, k and v) on a fast kernel.

transformers calls causal-conv1d's CUDA kernel when that package imports, and otherwise a reference
path: a depthwise `F.conv1d` per linear-attention layer, over ten times slower than
flash-linear-attention's Triton kernel (BENCHMARKS.md, 2026-12-01, fourth session). causal-conv1d
compiles with nvcc against the exact torch build; flash-linear-attention, which a hybrid target needs
anyway, ships the same operation as a Triton kernel. So where causal-conv1d is absent, `use_fast_causal_conv` puts flash-linear-attention's kernel
where transformers looks up `causal_conv1d_fn` (the modeling module of the target's layers), and the
reference path never runs on a GPU.
"""

from __future__ import annotations

import importlib.util
import sys

import torch
from torch import nn

CAUSAL_CONV1D = "causal-conv1d (CUDA)"
TRITON = "flash-linear-attention (Triton)"
REFERENCE = "transformers' reference F.conv1d"


def fast_causal_conv(present: dict[str, bool], cuda: bool) -> str | None:
    """The fast kernel a hybrid target's conv runs on, given which of `fla` and `causal_conv1d`
    import; None when neither does, or off CUDA (`cuda` False: both kernels are CUDA-only)."""
    if not cuda:
        return None
    if present.get("causal_conv1d"):
        return CAUSAL_CONV1D
    if present.get("fla"):
        return TRITON
    return None


def use_fast_causal_conv(model: nn.Module, device: torch.device) -> str | None:
    """Run `model`'s linear-attention convs on the fastest kernel this process has; returns which
    (None: the model has no such conv). On a CPU, or with neither package, the reference path stays.
    The kernel is set in the layers' modeling module, so it holds for every model of that module in
    the process (a target lives on one device per process)."""
    modules = {
        sys.modules[type(layer).__module__]
        for layer in model.modules()
        if isinstance(getattr(layer, "conv1d", None), nn.Conv1d)
        and hasattr(sys.modules[type(layer).__module__], "causal_conv1d_fn")
    }
    if not modules:
        return None
    present = {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}
    kernel = fast_causal_conv(present, cuda=device.type == "cuda")
    if kernel == TRITON:
        for module in modules:
            module.causal_conv1d_fn = triton_causal_conv1d_fn
    return kernel or REFERENCE


def triton_causal_conv1d_fn(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **unused: object,
) -> torch.Tensor:
    """transformers' `causal_conv1d_fn` on flash-linear-attention's kernel: `[B, D, T] -> [B, D, T]`
    with weight `[D, W]`. transformers hands over a transposed view of a `[B, T, D]` tensor, which is
    what the kernel reads, so neither side copies. Other keyword arguments are ignored, as the
    reference path ignores them."""
    from fla.modules.causal_conv1d import causal_conv1d

    output, _ = causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation)
    return output.transpose(1, 2)
