"""The hybrid target's Gated DeltaNet layers (Qwen3.5/3.6) without the copies of their fused layout.

transformers projects q, k and v with one matmul, convolves the fused channels, then splits them:
q, k and v arrive at the chunked delta-rule kernel as strided views of one `[B, T, 2 x key + value]`
tensor, and flash-linear-attention's kernel copies each into a contiguous tensor first. In a
64-layer Qwen3.6-27B forward that is three copies of every linear-attention layer's q, k and v, the
largest cost outside matmuls, attention and library kernels in the compiled target's profile
(BENCHMARKS.md, 2026-12-01, sixth session). The conv is depthwise and the projection's output rows
are independent, so projecting and convolving q, k and v apart computes the same values, each in its
own contiguous tensor: `copy_free_forward`, for the calls that carry no cache and no mask (the target's feature
passes). Eval's cached decoding and masked calls keep transformers' forward.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from torch import nn

# What routes a call to transformers' forward: cached decoding's state, a padding mask, packed rows.
_STATEFUL_ARGUMENTS = ("cache", "cache_params", "attention_mask", "cu_seq_lens_q", "seq_idx")


def use_copy_free_gated_deltanet(model: nn.Module) -> None:
    """Give every Qwen3.5-style Gated DeltaNet layer of `model` (a fused `in_proj_qkv` and a
    depthwise `conv1d`) the copy-free feature forward. q and k reach the delta rule with their own
    head count (grouped value heads), which flash-linear-attention's kernel and transformers >= 5.24's
    reference take; an older transformers without flash-linear-attention repeats the heads itself, so
    its layers are left as they are."""
    if not _grouped_heads_supported():
        return
    for layer in [module for module in model.modules() if _is_fused_qkv_layer(module)]:
        layer.forward = functools.partial(copy_free_forward, layer, layer.forward)


def _is_fused_qkv_layer(module: nn.Module) -> bool:
    return (
        isinstance(getattr(module, "in_proj_qkv", None), nn.Linear)
        and isinstance(getattr(module, "conv1d", None), nn.Conv1d)
        and hasattr(sys.modules[type(module).__module__], "torch_chunk_gated_delta_rule")
    )


def _grouped_heads_supported() -> bool:
    return importlib.util.find_spec("fla") is not None or Version(transformers.__version__) >= Version("5.24")


def copy_free_forward(
    layer: nn.Module, transformers_forward: Callable[..., torch.Tensor], hidden_states: torch.Tensor, **kwargs
) -> torch.Tensor:
    """`layer`'s forward with q, k and v projected and convolved apart, each contiguous; the same
    kernels as transformers' (the conv and delta rule its modeling module holds, so a fast conv
    installed there is used). A call with a cache, a mask or packed rows goes to
    `transformers_forward`."""
    if any(kwargs.get(name) is not None for name in _STATEFUL_ARGUMENTS):
        return transformers_forward(hidden_states, **kwargs)
    modeling = sys.modules[type(layer).__module__]
    batch, length, _ = hidden_states.shape
    sizes = [layer.key_dim, layer.key_dim, layer.value_dim]
    conv_weights = layer.conv1d.weight.squeeze(1).split(sizes)
    conv_biases = layer.conv1d.bias.split(sizes) if layer.conv1d.bias is not None else [None] * 3
    query, key, value = (
        # [B, T, C] -> the conv's [B, C, T] view and back; contiguous already on the fast kernels
        modeling.causal_conv1d_fn(
            F.linear(hidden_states, weight).transpose(1, 2),
            conv_weight,
            conv_bias,
            activation=layer.activation,
        )
        .transpose(1, 2)
        .contiguous()
        for weight, conv_weight, conv_bias in zip(
            layer.in_proj_qkv.weight.split(sizes), conv_weights, conv_biases, strict=True
        )
    )
    # a and b in one matmul: each is a few columns, and a matmul that narrow costs a full read of the
    # hidden states (0.14 ms at 3 x 16384 tokens on an H200, per layer)
    a, b = F.linear(hidden_states, torch.cat([layer.in_proj_a.weight, layer.in_proj_b.weight])).chunk(
        2, dim=-1
    )
    core, _ = modeling.torch_chunk_gated_delta_rule(
        query.view(batch, length, -1, layer.head_k_dim),
        key.view(batch, length, -1, layer.head_k_dim),
        value.view(batch, length, -1, layer.head_v_dim),
        g=-layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias),
        beta=b.sigmoid(),
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
    )
    gate = layer.in_proj_z(hidden_states).reshape(-1, layer.head_v_dim)
    core = layer.norm(core.reshape(-1, layer.head_v_dim), gate)
    return layer.out_proj(core.reshape(batch, length, -1))
