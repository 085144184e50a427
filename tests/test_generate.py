"""Batched decoding of the target (`app.generate`): a prefill of left-padded prompts, then rows
refilled with the next prompt as their answers end, over a ring of cache slots, give each prompt exactly
its own greedy decode, stop where a serving engine stops, and sample reproducibly; hybrid targets take
`generate` and give the same."""

from __future__ import annotations

import functools

import pytest
import torch

from app.errors import UserError
from app.generate import attention
from app.generate.build import batch_decoder, greedy_decoder
from app.generate.decoder import STOP_CHECK_EVERY, BatchDecoder, GenerateDecoder
from app.generate.step import DecodeShape, RingStep
from tests.test_speculative import HYBRID_LINEAR, greedy_reference, random_target_config, target_and_drafter

PROMPTS = [[5, 17, 42, 99, 3, 250, 11], [8], list(range(60, 77)), [200, 201, 202]]
MORE = [
    *PROMPTS,
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 9],
    [31, 2],
    list(range(90, 84, -1)),
]
"""More prompts than rows: rows take new prompts mid-call, reading them one token per step."""


@pytest.fixture(scope="module")
def target():
    return target_and_drafter(random_target_config())[0]


def test_each_prompt_of_a_padded_batch_gets_its_own_greedy_decode(target):
    eager = greedy_decoder(target.model, DecodeShape(rows=6, max_prompt_tokens=20, max_new_tokens=15), [])
    assert isinstance(eager, BatchDecoder)
    answers = eager.decode(PROMPTS)  # 4 prompts in 6 rows: two rows idle
    assert answers == [greedy_reference(target, prompt, 15, None) for prompt in PROMPTS]
    assert eager.decode(PROMPTS[1:3]) == answers[1:3]  # the cache of the last call leaves no trace


def test_rows_refilled_over_a_ring_of_slots_give_each_prompt_its_own_greedy_decode(target):
    """7 prompts through 2 rows over 20 + 15 slots: rows take prompts at different steps, read them one
    token per step, and wrap the ring several times; every answer is still the prompt's own."""
    decoder = batch_decoder(
        target.model, DecodeShape(rows=2, max_prompt_tokens=20, max_new_tokens=15), [], compiled=False
    )
    streamed = list(decoder.stream(MORE))
    assert sorted(index for index, _ in streamed) == list(range(len(MORE)))
    answers = dict(streamed)
    assert [answers[i] for i in range(len(MORE))] == [greedy_reference(target, p, 15, None) for p in MORE]
    stats = decoder.stats  # every answer runs to 15 tokens here: the first 2 start in the prefill
    assert (stats.rows, stats.answer_tokens) == (
        2,
        15 * len(MORE),
    ) and stats.steps % STOP_CHECK_EVERY == 0
    prompt_steps = sum(map(len, MORE[2:]))  # the refilled rows read their prompts one token per step
    assert stats.answer_tokens - 2 + prompt_steps <= stats.rows * stats.steps  # 2: chosen by the prefill
    assert stats.prefill_tokens == 2 and stats.fill == (stats.answer_tokens - 2) / (stats.rows * stats.steps)
    assert (
        f"{stats.answer_tokens} answer tokens in" in stats.describe()
        and f"{stats.steps} steps of 2 rows" in stats.describe()
    )
    assert decoder.decode([]) == []


def test_the_block_sparse_step_answers_as_the_dense_mask(target):
    """The compiled step's attention (flex over the ring blocks a row's arc covers, `ring_blocks`)
    over 7 prompts in 2 rows and a ring of 5 blocks of 8 slots that wraps several times: every
    answer is the prompt's own greedy decode. (Eager flex on a CPU applies the mask to every slot:
    which blocks are read is pinned by the next test, and on the GPU by the compiled step's test.)"""
    shape = DecodeShape(rows=2, max_prompt_tokens=20, max_new_tokens=15, ring_block=8)
    assert shape.cache_length == 40
    sparse = BatchDecoder(RingStep(target.model, shape, temperature=0.0, block_sparse=True), [])
    assert sparse.decode(MORE) == [greedy_reference(target, p, 15, None) for p in MORE]
    assert sparse.stats.steps + 20 > 2 * shape.cache_length  # the ring wrapped


def test_ring_blocks_list_each_row_s_arc_once_and_nothing_else():
    """A row's blocks are those its arc of slots covers, from the block of its first slot on, each
    once, wrapping at the end of the ring; the arc's end in a later block counts that block. Every
    first step up to the step, at steps that end the arc at each offset of a block. (A row's first
    step is never after the step: a refilled row starts at the next one.)"""
    ring, block = 40, 8
    for end in range(70, 70 + block):
        first_step, step = torch.arange(end + 1), torch.tensor(end)
        mask = attention.ring_blocks(first_step, step, ring, block, lambda row, slot: slot >= 0)
        counts = mask.kv_num_blocks.view(-1).tolist()
        order = mask.kv_indices.view(len(first_step), -1).tolist()
        for first in range(end + 1):
            arc = {(t % ring) // block for t in range(max(first, end - ring + 1), end + 1)}
            assert set(order[first][: counts[first]]) == arc and counts[first] == len(arc), (first, end)


def test_every_answer_ends_after_its_first_stop_token(target):
    free = [greedy_reference(target, prompt, 24, None) for prompt in MORE]
    stop = free[0][4]  # a token the first prompt's answer emits early; others run on or stop elsewhere
    decoder = batch_decoder(
        target.model, DecodeShape(rows=3, max_prompt_tokens=20, max_new_tokens=24), [stop], compiled=False
    )
    answers = decoder.decode(MORE)
    assert answers == [greedy_reference(target, prompt, 24, stop) for prompt in MORE]
    assert answers[0] == free[0][: free[0].index(stop) + 1] and len(answers[0]) < 24
    assert any(len(answer) == 24 for answer in answers)  # a row that never stops runs to the budget


def test_sampling_follows_its_seed(target):
    shape = DecodeShape(rows=4, max_prompt_tokens=20, max_new_tokens=12)
    hot = batch_decoder(target.model, shape, [], compiled=False, temperature=1.0)
    first = hot.decode(MORE, seed=3)
    assert hot.decode(MORE, seed=3) == first
    assert hot.decode(MORE, seed=4) != first
    greedy = batch_decoder(target.model, shape, [], compiled=False).decode(MORE)
    assert first != greedy  # a temperature of 1 over a random model departs from the argmax
    cold = batch_decoder(target.model, shape, [], compiled=False, temperature=1e-6).decode(MORE, seed=3)
    assert cold == greedy


def test_a_hybrid_target_decodes_through_generate_with_the_same_answers():
    hybrid = target_and_drafter(random_target_config("qwen3_5_text", **HYBRID_LINEAR))[0]
    decoder = greedy_decoder(hybrid.model, DecodeShape(rows=2, max_prompt_tokens=20, max_new_tokens=6), [])
    assert isinstance(decoder, GenerateDecoder)
    prompts = PROMPTS[:1] + PROMPTS[3:]  # equal-length-ish prompts: padding in a linear-attention layer
    assert decoder.decode(prompts) == [greedy_reference(hybrid, prompt, 6, None) for prompt in prompts]
    with pytest.raises(UserError, match="a static attention cache cannot hold"):
        batch_decoder(
            hybrid.model, DecodeShape(rows=2, max_prompt_tokens=20, max_new_tokens=6), [], compiled=False
        )


def test_calls_outside_the_shape_are_one_line_errors(target):
    decoder = batch_decoder(
        target.model, DecodeShape(rows=2, max_prompt_tokens=8, max_new_tokens=4), [], compiled=False
    )
    with pytest.raises(UserError, match=r"prompts must have 1 to 8 tokens, got up to 9"):
        decoder.decode([list(range(9))])
    with pytest.raises(UserError, match=r"prompts must have 1 to 8 tokens"):
        decoder.decode([[]])


def test_a_decode_step_reads_each_kv_head_once_with_sdpa_s_result(target, monkeypatch):
    """The decode's attention (`packed_decode_attention`): query heads grouped by their KV head, no
    copy of the cache per query head; equal to transformers' SDPA, used by every decode step, and the
    target's own implementation back once the call returns."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = target.model.get_decoder().layers[0].self_attn
    generator = torch.Generator().manual_seed(0)
    query, key, value = (
        torch.randn(3, heads, length, 16, generator=generator) for heads, length in ((4, 1), (2, 9), (2, 9))
    )
    mask = torch.rand(3, 1, 1, 9, generator=generator) > 0.3
    mask[:, :, :, 0] = True
    packed, _ = attention.packed_decode_attention(module, query, key, value, mask, scaling=0.25)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(packed, reference)

    calls = []

    def counted(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return attention.sdpa_attention_forward(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "packed_decode_attention", counted)
    decoder = batch_decoder(
        target.model, DecodeShape(rows=2, max_prompt_tokens=8, max_new_tokens=3), [], compiled=False
    )
    decoder.decode([[5, 6, 7], [8]])
    layers = target.text_config.num_hidden_layers
    steps = STOP_CHECK_EVERY  # the answers end within the first steps the host reads
    assert calls.count(1) == steps * layers and calls.count(3) == layers  # one prefill, then steps
    assert target.model.config._attn_implementation == "sdpa"


def test_the_warm_up_and_bench_decode_s_replays_run_the_stream_s_graph(target):
    """`warm_up` compiles the step before a stream (datagen's figures are then the stream's own), and
    `dflash bench decode` times and profiles replayed steps: both must be the stream's compiled graph
    (its packed attention, inference tensors), not a second one compiled for the occasion. Dynamo's
    tracing and guards are real (backend eager)."""
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    ring = RingStep(
        target.model,
        DecodeShape(rows=2, max_prompt_tokens=20, max_new_tokens=4),
        temperature=0.0,
        block_sparse=False,
    )
    decoder = BatchDecoder(
        ring, [], compiled=torch.compile(ring, backend="eager", dynamic=False, fullgraph=True)
    )
    try:
        graphs = counters["stats"]["unique_graphs"]
        decoder.warm_up()
        assert counters["stats"]["unique_graphs"] == graphs + 1
        assert decoder.decode(MORE) == [greedy_reference(target, p, 4, None) for p in MORE]
        decoder.replayed_steps(3)()
        assert counters["stats"]["unique_graphs"] == graphs + 1
    finally:
        torch.compiler.reset()


def test_the_prefill_compiles_nothing_where_compile_target_ran(monkeypatch):
    """`compile_target` (a training run's target) replaces transformers' RoPE for the whole process;
    a decoder's eager prefill in that process must not compile it again for its inference tensors
    (on the GPU tier that was a recompile after another test's warm-up): the stream compiles its
    step and nothing else."""
    from torch._dynamo.utils import counters

    from app.compile.apply import compile_target

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    fresh = target_and_drafter(random_target_config())[0]  # compile_target changes its modules
    for modeling in fresh.rotary_modeling_modules():  # and the module-level RoPE: restored after
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)
    references = [greedy_reference(fresh, p, 4, None) for p in MORE]  # eager, before compile_target
    torch.compiler.reset()
    try:
        assert compile_target(fresh) > 0
        ring = RingStep(
            fresh.model,
            DecodeShape(rows=2, max_prompt_tokens=20, max_new_tokens=4),
            temperature=0.0,
            block_sparse=False,
        )
        decoder = BatchDecoder(ring, [], compiled=torch.compile(ring, dynamic=False, fullgraph=True))
        graphs = counters["stats"]["unique_graphs"]
        assert decoder.decode(MORE) == references
        assert counters["stats"]["unique_graphs"] == graphs + 1
    finally:
        torch.compiler.reset()
