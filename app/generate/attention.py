"""A decode step's attention: grouped query heads read each KV head's cache once, and the compiled
step reads only the ring blocks a row's slots lie in (docs/architecture.md, Batched decoding)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from app.generate.transformers_internals import attention_implementation

PACKED_ATTENTION = "dflash_packed_decode"
"""The attention implementation a decode call runs the target with (`packed_decode_attention`)."""


def packed_attention(model: PreTrainedModel) -> contextlib.AbstractContextManager[None]:
    """The target's attention runs `packed_decode_attention` inside, its own implementation after."""
    return attention_implementation(model, PACKED_ATTENTION, packed_decode_attention)


def packed_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """A decode step's attention with grouped query heads read against each KV head as if they were
    that head's queries (`[rows, heads, 1, d] -> [rows, kv heads, heads / kv heads, d]`), so the cache
    is read once per KV head. transformers' SDPA path repeats the KV heads to the query heads first
    when compiled: a copy of the whole cache per layer and step, which reading it in place saves (BENCHMARKS.md,
    2026-12-03, second session). A prefill (several queries) is SDPA's."""
    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if isinstance(attention_mask, BlockMask):
        # packed as below, not flex's own GQA handling: 3.5x faster (BENCHMARKS.md, 2026-12-03, fifth session)
        packed = query.reshape(rows, kv_heads, heads // kv_heads, dim)
        out = flex_attention(packed, key, value, block_mask=attention_mask, scale=scaling)
        return out.reshape(rows, heads, 1, dim).transpose(1, 2), None
    if length != 1 or kv_heads == heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    packed = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None


def ring_blocks(
    first_step: torch.Tensor,
    step: torch.Tensor,
    ring: int,
    block: int,
    visible: Callable[..., torch.Tensor],
    queries: int = 1,
) -> BlockMask:
    """The flex block mask of one decode step: each row reads only the blocks of `block` slots its arc
    of the ring covers (the slots written from its `first_step` to `step`, wrapping at `ring`), and
    inside them the slots `visible(row, slot)` allows, for each of its `queries` (the query heads
    packed onto one KV head, `packed_decode_attention`). The arc starts in the block of slot
    `first_step % ring`; it covers its offset in that block plus `step - first_step + 1` slots, at
    most the ring."""
    rows, blocks = first_step.shape[0], ring // block
    start = torch.remainder(first_step, ring)
    count = torch.clamp((start % block + step - first_step + block) // block, max=blocks)
    order = torch.remainder(start[:, None] // block + torch.arange(blocks, device=step.device), blocks)

    def mask_mod(
        row: torch.Tensor, head: torch.Tensor, query: torch.Tensor, slot: torch.Tensor
    ) -> torch.Tensor:
        return visible(row, slot)

    return BlockMask.from_kv_blocks(
        count.to(torch.int32).view(rows, 1, 1),
        order.to(torch.int32).view(rows, 1, 1, blocks),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(queries, ring),
    )
