"""Useful FLOPs of one drafter training step on one packed row: the one count `dflash bench drafter`
reports and the training log line's MFU divides by the GPU's peak.

The row-dependent counts (unmasked attention pairs, supervised slots) stay tensors on the row's
device: the training loop sums them there and reads the sum once per log line, so counting adds no
host synchronisation to a step.
"""

from __future__ import annotations

import torch

from app.data.batch import DrafterRow
from app.model.drafter import DrafterArch
from app.model.objective import block_labels

TRAINABLE_MULTIPLIER = 3
"""forward + backward (input and weight gradients) of trainable parts."""
FROZEN_HEAD_MULTIPLIER = 2
"""the frozen LM head: forward + gradient w.r.t. its input only."""
FEATURE_PROJECTION_MULTIPLIER = 2
"""fc over the frozen target's features: forward + gradient w.r.t. its weight only (the features
need none, so autograd computes none)."""

FlopCount = float | torch.Tensor
"""A number for the row-independent terms, a 0-d int64 tensor on the row's device otherwise."""


def forward_flops(arch: DrafterArch, row: DrafterRow) -> dict[str, FlopCount]:
    """Useful forward FLOPs of one drafter step, term by term (a matmul of m x k by k x n is 2mkn).

    Attention counts only unmasked (query, key) pairs, 4 * heads * head_dim each (scores + weighted
    values); the LM head counts only supervised block slots. Everything else runs on all `T` context
    tokens and all `A x B` block tokens, as the kernels do.
    """
    context = row.input_ids.shape[0]
    queries = row.anchor_positions.shape[0] * arch.block_size
    hidden, layers = arch.hidden_size, arch.num_layers
    q_width = arch.num_attention_heads * arch.head_dim
    kv_width = arch.num_key_value_heads * arch.head_dim
    pairs = sum(visible_pairs(row, arch.block_size, arch.layer_window(i)) for i in range(layers))
    _, supervised = block_labels(row, arch.block_size)
    return {
        "fc (context features -> hidden)": 2 * context * arch.feature_size * hidden,
        "q_proj (block)": layers * 2 * queries * hidden * q_width,
        "k_proj + v_proj (block)": layers * 2 * 2 * queries * hidden * kv_width,
        "k_proj + v_proj (context)": layers * 2 * 2 * context * hidden * kv_width,
        "o_proj": layers * 2 * queries * q_width * hidden,
        "mlp (gate, up, down)": layers * 3 * 2 * queries * hidden * arch.intermediate_size,
        "attention (unmasked pairs)": 4 * arch.num_attention_heads * arch.head_dim * pairs,
        "lm_head (supervised slots)": 2 * supervised.sum() * hidden * arch.vocab_size,
    }


def multiplier(term: str) -> int:
    """How many times a forward term's FLOPs one training step spends (forward + backward)."""
    if term.startswith("lm_head"):
        return FROZEN_HEAD_MULTIPLIER
    if term.startswith("fc"):
        return FEATURE_PROJECTION_MULTIPLIER
    return TRAINABLE_MULTIPLIER


def step_flops(terms: dict[str, FlopCount]) -> FlopCount:
    """FLOPs of forward + backward: 3x the trainable terms, 2x the frozen LM head and the fc."""
    return sum(value * multiplier(name) for name, value in terms.items())


def visible_pairs(row: DrafterRow, block_size: int, window: int | None) -> torch.Tensor:
    """(query, key) pairs the training mask lets through for one layer (a 0-d tensor, no host sync:
    masking by `anchor_valid` instead of indexing with it, which would read its count)."""
    valid = row.anchor_valid
    # an anchor at position p sees the p earlier tokens of its document
    context = row.position_ids[row.anchor_positions]
    if window is None:
        return (context * valid).sum() * block_size + valid.sum() * block_size * block_size
    # the per-query window (app/model/attention.py): slot o sees [anchor + o - (W - 1), anchor + o]
    offsets = torch.arange(block_size, device=context.device)
    seen = torch.minimum(context[:, None], window - 1 - offsets[None, :]).clamp(min=0).sum(1)
    in_block = sum(min(offset + 1, window) for offset in range(block_size))
    return (seen * valid).sum() + valid.sum() * in_block
