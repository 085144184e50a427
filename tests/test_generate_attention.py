"""Fast direct tests of a decode step's attention (`app.generate.attention`): the packed grouped-query
attention against transformers' SDPA (dense mask) and against itself over a flex block mask, SDPA's own
path for a prefill and for one KV head per query head, the implementation switched in for a call only,
and the ring's block mask against a brute-force rule. Small random tensors on the CPU: under a second."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from app.generate import attention
from tests.test_generate_units import model  # noqa: F401 (a fixture)


def tensors(rows, heads, kv_heads, length, keys, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, heads, length, 8, generator=generator)
    key, value = (torch.randn(rows, kv_heads, keys, 8, generator=generator) for _ in range(2))
    return query, key, value


def test_one_query_per_row_reads_each_kv_head_once_with_sdpa_s_result(model):  # noqa: F811
    module = model.get_decoder().layers[0].self_attn
    query, key, value = tensors(3, 4, 2, 1, 9)
    mask = torch.rand(3, 1, 1, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True
    for scaling in (0.25, None):
        packed, weights = attention.packed_decode_attention(module, query, key, value, mask, scaling=scaling)
        reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)
        assert packed.shape == (3, 1, 4, 8) and weights is None
        torch.testing.assert_close(packed, reference)


def test_a_prefill_and_one_kv_head_per_query_head_are_sdpa_s(model):  # noqa: F811
    grouped = model.get_decoder().layers[0].self_attn  # 2 query heads a KV head
    plain = torch.nn.Module()  # an attention layer with a KV head per query head, as SDPA reads one
    plain.num_key_value_groups, plain.is_causal = 1, False
    for module, heads, kv_heads, length in (
        (grouped, 4, 2, 2),
        (grouped, 4, 2, 3),
        (plain, 2, 2, 1),
        (plain, 2, 2, 5),
    ):
        query, key, value = tensors(2, heads, kv_heads, length, 6)
        causal = torch.ones(length, 6, dtype=torch.bool).tril(diagonal=6 - length)
        causal = causal[None, None].expand(2, 1, -1, -1)
        got, _ = attention.packed_decode_attention(module, query, key, value, causal, scaling=0.3)
        reference, _ = sdpa_attention_forward(module, query, key, value, causal, 0.0, 0.3)
        torch.testing.assert_close(got, reference)
        assert got.shape == (2, length, heads, 8)


def test_a_prefill_passes_sdpa_the_layer_s_other_arguments(model):  # noqa: F811
    """What the layer hands on besides the tensors (here `is_causal`) reaches SDPA: without a mask,
    is_causal=False reads every key, which the layer's own causal default would not."""
    module = model.get_decoder().layers[0].self_attn
    assert module.is_causal
    query, key, value = tensors(2, 4, 2, 3, 3)
    got, _ = attention.packed_decode_attention(module, query, key, value, None, scaling=0.3, is_causal=False)
    reference, _ = sdpa_attention_forward(module, query, key, value, None, 0.0, 0.3, is_causal=False)
    causal, _ = sdpa_attention_forward(module, query, key, value, None, 0.0, 0.3)
    torch.testing.assert_close(got, reference)
    assert not torch.allclose(got, causal)


def test_over_a_flex_block_mask_the_packed_queries_see_what_the_dense_mask_shows(model):  # noqa: F811
    """The compiled step's path: each KV head's query heads packed as its queries, flex attention over
    the block mask (eager here: the mask applied to every slot)."""
    module = model.get_decoder().layers[0].self_attn
    rows, heads, kv_heads, slots = 3, 4, 2, 16
    query, key, value = tensors(rows, heads, kv_heads, 1, slots)
    first = torch.tensor([0, 5, 11])

    def visible(row, head, q, slot):
        return slot >= first[row]

    block_mask = create_block_mask(visible, rows, 1, heads // kv_heads, slots, device="cpu", BLOCK_SIZE=8)
    flexed, weights = attention.packed_decode_attention(module, query, key, value, block_mask, scaling=0.4)
    dense = (torch.arange(slots)[None, :] >= first[:, None])[:, None, None, :]
    reference, _ = sdpa_attention_forward(module, query, key, value, dense, scaling=0.4)
    assert flexed.shape == (rows, 1, heads, 8) and weights is None
    torch.testing.assert_close(flexed, reference)


def test_the_packed_attention_runs_inside_the_call_only(model):  # noqa: F811
    before = model.config._attn_implementation
    with attention.packed_attention(model):
        assert model.config._attn_implementation == attention.PACKED_ATTENTION == "dflash_packed_decode"
        assert model.config.get_text_config()._attn_implementation == attention.PACKED_ATTENTION
    assert model.config._attn_implementation == before


def test_ring_blocks_list_each_row_s_arc_once_with_the_row_s_mask():
    """Every first step up to the step, at steps ending the arc at each offset of a block: the blocks
    are those the arc of slots covers, each once, from the block of its first slot on; the mask inside
    them is `visible(row, slot)`, for `queries` packed query heads."""
    ring, block = 40, 8
    for end in range(70, 70 + block):
        first_step, step = torch.arange(end + 1), torch.tensor(end)
        mask = attention.ring_blocks(first_step, step, ring, block, lambda row, slot: slot >= row % ring, 2)
        counts = mask.kv_num_blocks.view(-1).tolist()
        order = mask.kv_indices.view(len(first_step), -1).tolist()
        assert mask.seq_lengths == (2, ring) and (block, block) == mask.BLOCK_SIZE
        for first in range(end + 1):
            arc = {(t % ring) // block for t in range(max(first, end - ring + 1), end + 1)}
            assert set(order[first][: counts[first]]) == arc and counts[first] == len(arc), (first, end)
            assert order[first][0] == (first % ring) // block  # from the block of the row's first slot on
            assert sorted(order[first]) == list(range(ring // block))  # the rest: the other blocks
        slot = torch.arange(ring)
        for row in (0, 13, 45):
            shown = mask.mask_mod(torch.tensor(row), torch.tensor(0), torch.tensor(1), slot)
            assert shown.tolist() == (slot >= row % ring).tolist()


def test_ring_blocks_defaults_to_one_query_and_stays_on_the_step_s_device():
    """int32 block counts and indices (flex's own dtype), on the device of the rows' state (meta here,
    standing for CUDA)."""
    mask = attention.ring_blocks(torch.tensor([0, 9]), torch.tensor(12), 16, 4, lambda row, slot: slot >= 0)
    assert mask.seq_lengths == (1, 16)
    assert (mask.kv_num_blocks.dtype, mask.kv_indices.dtype) == (torch.int32, torch.int32)
    assert mask.kv_num_blocks.view(-1).tolist() == [4, 2]
    # flex's layout: [rows, heads, query blocks] and [rows, heads, query blocks, KV blocks], one head
    # and one query block (the packed queries), which a compiled step reads by position
    assert (mask.kv_num_blocks.shape, mask.kv_indices.shape) == ((2, 1, 1), (2, 1, 1, 4))
    meta = torch.device("meta")
    on_meta = attention.ring_blocks(
        torch.tensor([0, 9], device=meta), torch.tensor(12, device=meta), 16, 4, lambda row, slot: slot >= 0
    )
    assert on_meta.kv_num_blocks.is_meta and on_meta.kv_indices.is_meta
