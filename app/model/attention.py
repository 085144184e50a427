"""The drafter's training attention: the block mask and the kernel it runs with.

Queries are the `A x B` block tokens of a packed row (anchor j's block is queries j*B .. j*B+B-1);
keys are the row's `T` context tokens followed by the same `A x B` block tokens. A query of block j
sees the context of its own document strictly before anchor j, and every key of its own block
(bidirectional); nothing else. Unused anchor slots see nothing (flex returns zeros for such rows,
with zero gradients). Sliding-window layers use the serving engines' per-query window (SGLang, vLLM,
Hugging Face): block slot o, at position anchor + o, sees the keys at positions
[anchor + o - (window - 1), anchor + o], so the context it sees shrinks by one per slot and the block
is causal (the drafter is trained and evaluated with the mask it is served with).

Kernels (the incident: uncompiled flex on CUDA ran 4-5x slower with volatile memory, silently):
compiled flex_attention with a BlockMask on CUDA, always; it is compiled outside the model code
(`app.compile.apply`) and handed in, and CUDA without it is an error. On CPU the compiled flex backward fails
(torch 2.10) and eager flex costs ~1 s per call even at the tiny demo's shapes (measured on 2 cores:
20x SDPA), so CPU runs SDPA with the same rule evaluated as a dense boolean mask; eager flex on
CPU stays available (`backend="flex"`) and the tests check both agree.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from app.data.batch import DrafterRow

FlexKernel = Callable[..., torch.Tensor]
"""`kernel(query, key, value, block_mask=..., enable_gqa=True) -> output`, like `flex_attention`."""

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""`attend(query [1, heads, Q, d], key [1, kv_heads, S, d], value) -> [1, heads, Q, d]`."""

Backend = Literal["flex", "dense"]


class UncompiledKernelOnCudaError(RuntimeError):
    """A training kernel on CUDA is not compiled: eager flex_attention materialises the full score
    matrix (the incident's 4-5x slower, volatile-memory run), so it is refused, never run quietly."""


def eager_flex_attention(*args, **kwargs) -> torch.Tensor:
    """flex_attention uncompiled: CPU parity checks at tiny shapes (training on CPU uses SDPA)."""
    # Intended off CUDA: silence flex's "use torch.compile" advice.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def training_attention(
    row: DrafterRow,
    block_size: int,
    windows: set[int | None],
    backend: Backend | None = None,
    flex_kernel: FlexKernel | None = None,
) -> dict[int | None, Attend]:
    """Per context window (None = full context), the attention of one packed row's block queries.

    `backend` None picks the device's: "flex" (BlockMask) on CUDA, "dense" (SDPA with a boolean mask)
    elsewhere. `flex_kernel` is the compiled flex_attention (`app.compile.apply`); on CUDA it is
    required, off CUDA None runs flex eagerly. Masks are built once per row and shared by the layers.
    """
    device = row.input_ids.device
    backend = backend or ("flex" if device.type == "cuda" else "dense")
    if backend == "dense":
        return {window: _dense_attend(dense_training_mask(row, block_size, window)) for window in windows}
    if flex_kernel is None:
        if device.type == "cuda":
            raise UncompiledKernelOnCudaError(
                "flex_attention is not compiled: eager flex on CUDA materialises the full score matrix "
                "(4-5x slower, volatile memory); compile the drafter first (app.compile.apply.compile_drafter)"
            )
        flex_kernel = eager_flex_attention
    return {
        window: _flex_attend(flex_kernel, training_block_mask(row, block_size, window)) for window in windows
    }


def _flex_attend(kernel: FlexKernel, block_mask: BlockMask) -> Attend:
    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return kernel(query, key, value, block_mask=block_mask, enable_gqa=True)

    return attend


def _dense_attend(mask: torch.Tensor) -> Attend:
    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # Rows with no visible key (unused anchor slots) come out as zeros, with zero gradients.
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)

    return attend


def dense_training_mask(row: DrafterRow, block_size: int, sliding_window: int | None = None) -> torch.Tensor:
    """The training mask as a dense boolean `[A*B, T + A*B]` tensor (the BlockMask's rule, broadcast)."""
    query_len = row.anchor_positions.shape[0] * block_size
    device = row.input_ids.device
    queries = torch.arange(query_len, device=device)[:, None]
    keys = torch.arange(row.input_ids.shape[0] + query_len, device=device)[None, :]
    return _training_mask_mod(*_query_intervals(row, block_size, sliding_window))(0, 0, queries, keys)


FLEX_TILE = 128
"""flex_attention's tile: the BlockMask marks each 128 queries x 128 keys as empty, partial or full."""


def training_block_mask(row: DrafterRow, block_size: int, sliding_window: int | None = None) -> BlockMask:
    """The flex BlockMask of one packed row: queries `A*B` block tokens, keys `T` context + `A*B` block tokens.

    The same BlockMask `create_block_mask` makes from the rule, built from the rule's shape instead of
    by evaluating it at every (query, key) pair: each query sees one interval of context (its anchor's
    document up to the anchor, cut to the window; a row holds each document as one run, as packing
    lays them out) and one interval of its own block. So classifying the 128x128 tiles takes a few
    small tensor ops per row, eagerly, with nothing to compile: a compiled `create_block_mask` cost
    every warm start about 1 s on an H200 (Dynamo tracing its vmap, its kernel's tuning), and every
    cold start its compile.
    """
    context_len = row.input_ids.shape[0]
    query_len = row.anchor_positions.shape[0] * block_size
    key_len = context_len + query_len
    starts, ends = _query_intervals(row, block_size, sliding_window)
    seen, full = _visible_tiles(starts, ends, key_len)
    partial_tiles, full_tiles = _ordered_tiles(seen & ~full), _ordered_tiles(full)
    return BlockMask.from_kv_blocks(
        *partial_tiles,
        *full_tiles,
        BLOCK_SIZE=FLEX_TILE,
        mask_mod=_training_mask_mod(starts, ends),
        seq_lengths=(query_len, key_len),
    )


def _query_intervals(
    row: DrafterRow, block_size: int, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule, per query: the keys it sees are two intervals, context [context_start, anchor) and
    its own block's keys [block_start, block_end). Returns `starts` and `ends`, `[interval, query]`
    int32, the queries padded to whole 128-query tiles; padding queries and unused anchor slots see
    nothing (empty intervals)."""
    context_len = row.input_ids.shape[0]
    device = row.input_ids.device
    queries = torch.arange(row.anchor_positions.shape[0] * block_size, device=device)
    slot, offset = queries // block_size, queries % block_size
    anchor = row.anchor_positions[slot]
    context_start = _document_starts(row.document_ids)[anchor]
    block_start = context_len + slot * block_size
    block_end = block_start + block_size
    if sliding_window is not None:  # the per-query window: positions anchor + offset - (window - 1) on
        window_start = anchor + offset - (sliding_window - 1)
        context_start = torch.maximum(context_start, window_start)
        block_end = block_start + offset + 1
        block_start = block_start + (window_start - anchor).clamp(min=0)
    starts = torch.stack([context_start, block_start])
    ends = torch.stack([anchor, block_end]) * row.anchor_valid[slot]  # an unused slot's end 0: empty
    padding = -len(queries) % FLEX_TILE
    return tuple(F.pad(bounds, (0, padding)).to(torch.int32) for bounds in (starts, ends))


def _visible_tiles(
    starts: torch.Tensor, ends: torch.Tensor, key_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[query tiles, key tiles]` bools: some query of the tile sees some key of it; all see all.
    Tiles past the last query or key are padding, as in `create_block_mask`: they see nothing, so a
    tile holding any is never full."""
    tile_start = torch.arange(0, key_len, FLEX_TILE, device=starts.device, dtype=torch.int32)
    tile_end = tile_start + FLEX_TILE
    starts, ends = starts[:, :, None], ends[:, :, None]  # [interval, query, 1]
    sees_some = (torch.maximum(starts, tile_start) < torch.minimum(ends, tile_end)).any(0)
    sees_all = ((starts <= tile_start) & (tile_end <= ends)).any(0)
    sees_some, sees_all = (tiles.unflatten(0, (-1, FLEX_TILE)) for tiles in (sees_some, sees_all))
    return sees_some.any(1), sees_all.all(1)


def _document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """Per context token, the index where its document begins (documents are contiguous in a row)."""
    positions = torch.arange(document_ids.shape[0], device=document_ids.device)
    begins = torch.ones_like(document_ids, dtype=torch.bool)
    begins[1:] = document_ids[1:] != document_ids[:-1]
    return torch.where(begins, positions, 0).cummax(0).values


def _ordered_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[query tiles, key tiles]` bools as flex wants them: per query tile the count of marked key tiles
    and their indices first, in order (`[1, 1, ...]` int32: batch and head broadcast)."""
    marked = tiles.to(torch.int32)
    counts = marked.sum(-1, dtype=torch.int32)
    indices = torch.argsort(marked, dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None].contiguous(), indices[None, None].contiguous()


def _training_mask_mod(starts: torch.Tensor, ends: torch.Tensor) -> Callable:
    """The rule as flex evaluates it in partial tiles: a query's two key intervals looked up by its
    index (`_query_intervals`), four comparisons per (query, key) pair. The kernels evaluate this at
    every pair of a partial tile in the forward and twice in the backward, so it is kept to loads
    indexed by the query alone (one per tile row) and a few integer ops."""
    context_start, block_start = starts
    context_end, block_end = ends

    def mask_mod(batch, head, q_idx, kv_idx):
        sees_context = (context_start[q_idx] <= kv_idx) & (kv_idx < context_end[q_idx])
        return sees_context | ((block_start[q_idx] <= kv_idx) & (kv_idx < block_end[q_idx]))

    return mask_mod
