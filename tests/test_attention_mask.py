"""The training mask: BlockMask and dense mask against a brute-force rule, flex against SDPA (the uncompiled-on-CUDA refusal: tests/test_gpu.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from app.data.batch import DrafterRow
from app.data.synthetic import synthetic_row
from app.model.attention import (
    _query_intervals,
    _training_mask_mod,
    dense_training_mask,
    eager_flex_attention,
    training_attention,
    training_block_mask,
)
from app.model.flops import visible_pairs

BLOCK = 4


def brute_force_mask(row, block_size, window=None):
    """The mask rule of docs/architecture.md (DFlash model and objective), one (query, key) pair at a time."""
    context_len = row.input_ids.shape[0]
    anchors = row.anchor_positions.tolist()
    valid = row.anchor_valid.tolist()
    documents = row.document_ids.tolist()
    query_len = len(anchors) * block_size
    mask = torch.zeros(query_len, context_len + query_len, dtype=torch.bool)
    for query in range(query_len):
        block, slot = divmod(query, block_size)
        if not valid[block]:
            continue
        anchor = anchors[block]
        # a sliding window is per query: block slot s at position anchor + s sees [anchor + s - (window - 1), anchor + s]
        window_start = anchor + slot - (window - 1) if window is not None else 0
        for key in range(context_len):
            in_window = key >= window_start
            mask[query, key] = key < anchor and documents[key] == documents[anchor] and in_window
        for key_slot in range(block_size):
            in_window = window is None or anchor + slot - (window - 1) <= anchor + key_slot <= anchor + slot
            mask[query, context_len + block * block_size + key_slot] = in_window
    return mask


def blocks_of(block_mask, num_indices, indices):
    """Decode a BlockMask's (num_blocks, indices) pair into a set of (q_block, kv_block)."""
    found = set()
    for q_block in range(num_indices.shape[-1]):
        for position in range(int(num_indices[0, 0, q_block])):
            found.add((q_block, int(indices[0, 0, q_block, position])))
    return found


def tile_summary(dense, tile=128):
    """Per 128x128 tile of a dense mask: 'any' and 'all' (tiles past the end are padded with False)."""
    rows, cols = dense.shape
    padded = torch.zeros(-(-rows // tile) * tile, -(-cols // tile) * tile, dtype=torch.bool)
    padded[:rows, :cols] = dense
    tiles = padded.view(padded.shape[0] // tile, tile, padded.shape[1] // tile, tile).transpose(1, 2)
    any_true = {tuple(index) for index in tiles.any(-1).any(-1).nonzero().tolist()}
    # a tile straddling the end is never "full": its padding is masked
    valid = torch.zeros_like(padded)
    valid[:rows, :cols] = True
    valid_tiles = valid.view_as(padded).view(tiles.shape[0], tile, tiles.shape[1], tile).transpose(1, 2)
    all_true = {tuple(index) for index in (tiles | ~valid_tiles).all(-1).all(-1).nonzero().tolist()}
    return any_true, all_true & any_true


def test_a_sliding_window_is_per_query_as_the_serving_engines_apply_it():
    """Written out by hand: one document of 8 tokens, one block at anchor 5, block 3, window 3. Slot o
    (position 5 + o) sees positions [5 + o - 2, 5 + o]: context 3, 4 and slot 0; context 4 and slots
    0-1; slots 0-2 (the anchor-relative rule would give every slot context 2, 3, 4)."""
    row = DrafterRow(
        input_ids=torch.arange(8), position_ids=torch.arange(8), document_ids=torch.zeros(8, dtype=torch.int32),
        loss_mask=torch.ones(8, dtype=torch.bool), anchor_positions=torch.tensor([5]),
        anchor_valid=torch.tensor([True]),
    )  # fmt: skip
    #           context 0-7               block slots 0-2
    expected = [
        [0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
    ]
    assert dense_training_mask(row, 3, sliding_window=3).int().tolist() == expected
    assert brute_force_mask(row, 3, window=3).int().tolist() == expected


ROWS = {
    # name: (token_budget, anchors, documents, padding, valid anchors)
    "several documents, padding, dead slots": (256, 40, 4, 30, 29),
    "one document, all slots used": (128, 24, 1, 0, None),
    "many short documents": (384, 64, 12, 5, 50),
}


@pytest.fixture(params=list(ROWS), ids=list(ROWS))
def row(request):
    token_budget, anchors, documents, padding, valid = ROWS[request.param]
    generator = torch.Generator().manual_seed(len(request.param))
    return synthetic_row(
        token_budget,
        anchors,
        97,
        num_documents=documents,
        padding=padding,
        valid_anchors=valid,
        generator=generator,
    )


@pytest.mark.parametrize("window", [None, 9, 2])  # 2 < BLOCK: early block slots leave the window
def test_dense_mask_equals_brute_force(row, window):
    assert torch.equal(dense_training_mask(row, BLOCK, window), brute_force_mask(row, BLOCK, window))


@pytest.mark.parametrize("window", [None, 9, 2, 1])  # 2 and 1 < BLOCK: late slots see no context
def test_the_flop_counts_attention_pairs_are_the_masks_even_with_a_window_smaller_than_the_block(row, window):
    """The MFU's attention term counts what the mask lets through: with a window under the block size
    a late slot sees no context at all (not a negative count) and only the last `window` block slots."""
    assert int(visible_pairs(row, BLOCK, window)) == int(brute_force_mask(row, BLOCK, window).sum())


@pytest.mark.parametrize("window", [None, 9, 2])
def test_block_mask_tiles_match_brute_force(row, window):
    block_mask = training_block_mask(row, BLOCK, window)
    expected = brute_force_mask(row, BLOCK, window)
    assert block_mask.shape[-2:] == expected.shape
    any_true, all_true = tile_summary(expected)
    partial = blocks_of(block_mask, block_mask.kv_num_blocks, block_mask.kv_indices)
    full = blocks_of(block_mask, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    assert full == all_true  # full tiles skip mask_mod: they must be exactly the all-visible ones
    assert partial | full == any_true  # and no visible pair may sit in a skipped tile
    assert not partial & full


BLOCK_MASK_TENSORS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


@pytest.mark.parametrize("block_size", [4, 16, 12])  # 12 does not divide flex's 128-wide tiles
@pytest.mark.parametrize("window", [None, 9, 200, 2])
def test_block_mask_is_the_one_create_block_mask_makes_from_the_rule(row, block_size, window):
    """The tiles classified from the rule's intervals are the ones create_block_mask finds by
    evaluating the mask_mod at every pair: the BlockMask is its, tensor for tensor."""
    mask_mod = _training_mask_mod(*_query_intervals(row, block_size, window))
    query_len = row.anchor_positions.shape[0] * block_size
    key_len = row.input_ids.shape[0] + query_len
    expected = create_block_mask(mask_mod, None, None, query_len, key_len, device="cpu")
    built = training_block_mask(row, block_size, window)
    assert built.seq_lengths == expected.seq_lengths and built.BLOCK_SIZE == expected.BLOCK_SIZE
    for name in BLOCK_MASK_TENSORS:
        assert torch.equal(getattr(built, name), getattr(expected, name)), name
        assert getattr(built, name).dtype == torch.int32


def qkv(query_len, key_len, generator, heads=4, kv_heads=2, head_dim=16):
    def make(length, count):
        return torch.randn(1, count, length, head_dim, generator=generator, requires_grad=True)

    return make(query_len, heads), make(key_len, kv_heads), make(key_len, kv_heads)


@pytest.mark.parametrize("window", [None, 9])
def test_flex_equals_sdpa_with_dense_mask(row, window):
    generator = torch.Generator().manual_seed(0)
    dense = brute_force_mask(row, BLOCK, window)
    query, key, value = qkv(*dense.shape, generator)
    flex = eager_flex_attention(
        query, key, value, block_mask=training_block_mask(row, BLOCK, window), enable_gqa=True
    )
    reference = F.scaled_dot_product_attention(query, key, value, attn_mask=dense, enable_gqa=True)
    visible = dense.any(dim=1)  # SDPA's rows without any key are not part of the contract
    torch.testing.assert_close(flex[0][:, visible], reference[0][:, visible], rtol=1e-5, atol=1e-5)
    # the CPU training path (dense backend) computes the same attention
    dense_attend = training_attention(row, BLOCK, {window}, backend="dense")[window]
    torch.testing.assert_close(dense_attend(query, key, value)[0][:, visible], reference[0][:, visible])


@pytest.mark.parametrize("backend", ["flex", "dense"])
def test_rows_that_see_nothing_give_zeros_and_finite_gradients(backend):
    generator = torch.Generator().manual_seed(1)
    row = synthetic_row(128, 32, 97, num_documents=2, valid_anchors=20, generator=generator)
    attend = training_attention(row, BLOCK, {None}, backend=backend)[None]
    query, key, value = qkv(32 * BLOCK, 128 + 32 * BLOCK, generator)
    output = attend(query, key, value)
    (output.square().sum() + output.sum()).backward()
    dead_queries = slice(20 * BLOCK, None)
    assert torch.isfinite(output).all()
    assert torch.equal(output[0, :, dead_queries], torch.zeros_like(output[0, :, dead_queries]))
    for tensor in (query, key, value):
        assert torch.isfinite(tensor.grad).all()
    assert not query.grad[0, :, dead_queries].any()
    # keys of dead blocks are seen by nobody: no gradient reaches them
    assert not key.grad[0, :, 128 + 20 * BLOCK :].any()
