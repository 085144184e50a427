"""Fast direct tests of the decoder's shape and its one step over a ring of cache slots
(`app.generate.step`): the shape's refusals and ring length against a brute-force rule, the query heads
per KV head, the block-sparse step answering as the dense mask, and the pick of a token (argmax, or
Gumbel-max at the temperature). A one-layer random target on the CPU: seconds."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask
from transformers import AutoModelForCausalLM, GPT2Config

from app.errors import UserError
from app.generate.attention import packed_decode_attention
from app.generate.decoder import BatchDecoder
from app.generate.step import DecodeShape, RingStep
from app.generate.transformers_internals import attention_implementation
from tests.test_generate_units import PROMPTS, VOCAB, model, plain_decode  # noqa: F401 (a fixture)
from tests.test_speculative import HYBRID_LINEAR, random_target_config, target_and_drafter


def test_a_shape_below_one_row_prompt_token_or_new_token_is_refused(model):  # noqa: F811
    for shape in (DecodeShape(0, 4, 3), DecodeShape(2, 0, 3), DecodeShape(2, 4, 0)):
        with pytest.raises(UserError) as refused:
            RingStep(model, shape, temperature=0.0, block_sparse=False)
        assert str(refused.value) == f"decode: rows, prompt and new-token limits must be >= 1, got {shape}"
    one = RingStep(model, DecodeShape(1, 1, 1, ring_block=4), temperature=0.0, block_sparse=False)
    assert BatchDecoder(one, []).decode([[5], [7]]) == [
        plain_decode(model, [5], 1),
        plain_decode(model, [7], 1),
    ]


def test_the_ring_is_a_prompt_and_its_answer_in_whole_blocks():
    for prompt in range(1, 12):
        for new in range(1, 12):
            for block in (1, 4, 8, 128):
                ring = DecodeShape(2, prompt, new, ring_block=block).cache_length
                assert ring == min(n for n in range(block, 10 * block + 128, block) if n >= prompt + new)
    assert DecodeShape(2, 3, 4).cache_length == 128


def test_a_target_a_static_attention_cache_cannot_hold_is_refused_by_name():
    hybrid = target_and_drafter(random_target_config("qwen3_5_text", **HYBRID_LINEAR))[0].model
    with pytest.raises(UserError) as refused:
        RingStep(hybrid, DecodeShape(2, 4, 3), temperature=0.0, block_sparse=False)
    assert str(refused.value) == (
        f"decode: {type(hybrid).__name__} has layers a static attention cache cannot hold"
    )


def test_query_heads_per_kv_head(model):  # noqa: F811
    """4 query heads over 2 KV heads: 2 a KV head; a config without `num_key_value_heads` (GPT-2) has
    one KV head per query head."""
    grouped = RingStep(model, DecodeShape(2, 4, 3), temperature=0.0, block_sparse=True).query_group
    # a count: the block mask's query length (`ring_blocks`), which a float would make a float shape
    assert grouped == 2 and type(grouped) is int
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=VOCAB))
    assert not hasattr(gpt2.config, "num_key_value_heads")
    step = RingStep(gpt2, DecodeShape(2, 4, 3, ring_block=4), temperature=0.0, block_sparse=False)
    assert step.query_group == 1 and step.key_slots.tolist() == list(range(8))
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config)
    assert RingStep(meta, DecodeShape(2, 4, 3), temperature=0.0, block_sparse=False).key_slots.is_meta


def test_the_block_sparse_step_answers_as_the_dense_mask(model):  # noqa: F811
    """Flex attention over the ring blocks each row's arc covers (eager on the CPU: the mask applied
    to every slot), 4 prompts through 2 rows over a ring of 3 blocks of 4 slots that wraps."""
    shape = DecodeShape(rows=2, max_prompt_tokens=5, max_new_tokens=6, ring_block=4)
    sparse = BatchDecoder(RingStep(model, shape, temperature=0.0, block_sparse=True), [])
    assert sparse.decode(PROMPTS[:4]) == [plain_decode(model, p, 6) for p in PROMPTS[:4]]
    assert sparse.stats.steps > shape.cache_length  # the ring wrapped


def test_a_block_sparse_step_hands_its_attention_a_flex_block_mask_and_a_dense_one_a_tensor(model):  # noqa: F811
    """Which mask each step builds, seen by the attention itself (the packed attention, wrapped): both
    answer alike, so only this tells that the block-sparse step does read the ring by blocks."""
    seen = []

    def recording(module, query, key, value, attention_mask, *args, **kwargs):
        seen.append(type(attention_mask))
        return packed_decode_attention(module, query, key, value, attention_mask, *args, **kwargs)

    shape = DecodeShape(rows=2, max_prompt_tokens=4, max_new_tokens=4, ring_block=4)
    prompts = torch.tensor([[5, 17, 42, 0], [8, 0, 0, 0]])
    for block_sparse, mask in ((True, BlockMask), (False, torch.Tensor)):
        ring = RingStep(model, shape, temperature=0.0, block_sparse=block_sparse)
        seen.clear()
        with torch.inference_mode(), attention_implementation(model, "recorded_decode", recording):
            zeros = torch.zeros(2, dtype=torch.long)
            ring(zeros, prompts, torch.tensor([3, 1]), zeros, torch.tensor(0), None)
        assert seen == [mask]


def test_pick_is_the_argmax_or_the_gumbel_max_at_the_temperature(model):  # noqa: F811
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]], dtype=torch.bfloat16)
    cold = RingStep(model, DecodeShape(2, 4, 3), temperature=0.0, block_sparse=False)
    assert cold.pick(logits, None).tolist() == [1, 0]
    hot = RingStep(model, DecodeShape(2, 4, 3), temperature=0.5, block_sparse=False)
    noise = torch.tensor([[0.0, 0.0, 4.5], [0.0, 3.0, 0.0]])
    # logits / 0.5 + noise: [0, 6, 6.5] and [4, 3, 2]; at * 0.5: [0, 1.5, 5] and [1, 3, 0.5]; - noise: [0, 6, -2.5]
    assert hot.pick(logits, noise).tolist() == [2, 0]
    assert hot.pick(logits, noise).dtype == torch.long
