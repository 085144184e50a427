"""Fast direct tests of the batched decoder (`app.generate.decoder`): a one-layer random target on the
CPU, a few rows and tokens, each answer checked against plain greedy decoding (or Gumbel-max sampling
with the same draws) by the model's own forward over the whole sequence, and the decoder's figures
against what the calls did. Seconds in all, for mutation testing (tests/test_generate.py holds the
slower end-to-end cases)."""

from __future__ import annotations

import math

import pytest
import torch

from app.errors import UserError
from app.generate.decoder import (
    STOP_CHECK_EVERY,
    BatchDecoder,
    DecodeStats,
    GenerateDecoder,
    _Row,
    cut_at_stop,
)
from app.generate.step import DecodeShape, RingStep
from tests.test_speculative import random_target_config, target_and_drafter

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    raw = random_target_config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1, head_dim=8
    )
    raw["drafter"]["target_layer_ids"] = [0]
    return target_and_drafter(raw)[0].model


@torch.inference_mode()
def plain_decode(model, prompt, limit, stops=(), temperature=0.0, draws=None):
    """The answer by the model's forward over the whole sequence, one token at a time; `draws` (a
    generator): Gumbel-max sampling with one `[1, vocab]` draw per token."""
    tokens, answer = list(prompt), []
    while len(answer) < limit:
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
        if draws is None:
            token = int(logits.argmax())
        else:
            uniform = torch.rand(1, VOCAB, generator=draws).clamp_(min=1e-20)
            token = int((logits.float() / temperature - torch.log(-torch.log(uniform)))[0].argmax())
        tokens.append(token)
        answer.append(token)
        if token in stops:
            break
    return answer


class Counted:
    """The real ring step, counting its calls and keeping each call's step and noise."""

    def __init__(self, ring):
        self.ring, self.steps, self.noises, self.lasts, self.chosen = ring, [], [], [], []

    def __call__(self, last, prompts, lengths, first_step, step, noise):
        self.steps.append(None if step.is_meta else int(step))
        self.noises.append(noise)
        self.lasts.append(last.clone())
        self.chosen.append(self.ring(last, prompts, lengths, first_step, step, noise))
        return self.chosen[-1]


def decoder(model, rows, prompt_tokens, new_tokens, stops=(), temperature=0.0, pad=0):
    ring = RingStep(
        model,
        DecodeShape(rows=rows, max_prompt_tokens=prompt_tokens, max_new_tokens=new_tokens, ring_block=4),
        temperature=temperature,
        block_sparse=False,
    )
    counted = Counted(ring)
    return BatchDecoder(ring, stops, compiled=counted, pad_token_id=pad), counted


PROMPTS = [[5, 17, 42], [8], [60, 61, 62, 63, 9], [20, 21], [33], [1, 2, 3, 4]]


def test_rows_refilled_mid_call_give_each_prompt_its_plain_greedy_decode(model):
    """6 prompts through 2 rows over a ring of 12 slots: the first two in the prefill, the others
    read one token per step into the rows the earlier answers free; every answer is the prompt's own."""
    batch, counted = decoder(model, rows=2, prompt_tokens=5, new_tokens=6)
    assert batch.shape.cache_length == 12
    streamed = list(batch.stream(PROMPTS))
    assert sorted(index for index, _ in streamed) == list(range(len(PROMPTS)))
    assert dict(streamed) == {i: plain_decode(model, p, 6) for i, p in enumerate(PROMPTS)}
    assert batch.decode(PROMPTS) == [plain_decode(model, p, 6) for p in PROMPTS]
    stats = batch.stats
    assert (stats.rows, stats.answer_tokens) == (2, 6 * len(PROMPTS))
    assert stats.steps == len(counted.steps) // 2 and stats.steps % STOP_CHECK_EVERY == 0
    assert counted.steps[: stats.steps] == list(range(3, 3 + stats.steps))  # after a prefill of 3
    assert all(noise is None for noise in counted.noises)
    assert 0 < stats.prefill_s <= stats.seconds


def test_a_stop_token_ends_an_answer_and_frees_its_row(model):
    free = [plain_decode(model, p, 10) for p in PROMPTS]
    stop = free[0][2]
    batch, _ = decoder(model, rows=3, prompt_tokens=5, new_tokens=10, stops=[stop, VOCAB + 5])
    answers = batch.decode(PROMPTS)
    assert answers == [plain_decode(model, p, 10, {stop}) for p in PROMPTS]
    assert answers[0] == free[0][: free[0].index(stop) + 1]
    assert batch.stats.answer_tokens == sum(map(len, answers))


def test_a_prompt_ending_its_answer_in_the_prefill_is_yielded_first(model):
    """A stop token chosen by the prefill (or a limit of one token) ends the answer there."""
    first = [plain_decode(model, p, 1)[0] for p in PROMPTS[:2]]
    batch, counted = decoder(model, rows=2, prompt_tokens=5, new_tokens=4, stops=[first[1]])
    stream = batch.stream(PROMPTS[:2])
    assert next(stream) == (1, [first[1]])
    assert counted.steps == [] and batch.stats.answer_tokens == 1
    assert list(stream) == [(0, plain_decode(model, PROMPTS[0], 4, {first[1]}))]
    one, _ = decoder(model, rows=3, prompt_tokens=5, new_tokens=1)
    assert one.decode(PROMPTS) == [[token] for token in (plain_decode(model, p, 1)[0] for p in PROMPTS)]


def test_the_pad_token_never_shows_in_an_answer(model):
    """Left padding of the prefill and right padding of refilled prompts are never attended: the
    answers are the same whatever the pad id."""
    reference = [plain_decode(model, p, 5) for p in PROMPTS]
    for pad in (0, 9, 63):
        assert decoder(model, rows=2, prompt_tokens=5, new_tokens=5, pad=pad)[0].decode(PROMPTS) == reference


def test_sampling_is_gumbel_max_over_the_call_s_own_seeded_draws(model):
    """One row: the prefill draws the first token's noise, each step the next one's, from a generator
    seeded by `seed`, at the ring's temperature."""
    for temperature, seed in ((0.7, 3), (1.5, 11)):
        batch, counted = decoder(model, rows=1, prompt_tokens=5, new_tokens=8, temperature=temperature)
        answers = batch.decode([[5, 17, 42], [8, 1]], seed=seed)
        draws = torch.Generator().manual_seed(seed)
        first = plain_decode(model, [5, 17, 42], 8, temperature=temperature, draws=draws)
        assert answers[0] == first
        assert all(noise.shape == (1, VOCAB) for noise in counted.noises)


def test_calls_outside_the_shape_are_one_line_errors(model):
    batch, _ = decoder(model, rows=2, prompt_tokens=4, new_tokens=3)
    with pytest.raises(UserError, match=r"^decode: prompts must have 1 to 4 tokens, got up to 5$"):
        batch.decode([[1], [1, 2, 3, 4, 5]])
    with pytest.raises(UserError, match=r"^decode: prompts must have 1 to 4 tokens, got up to 2$"):
        batch.decode([[1, 2], []])
    assert batch.decode([[1, 2, 3, 4]]) == [plain_decode(model, [1, 2, 3, 4], 3)]
    assert batch.decode([]) == [] and list(batch.stream([])) == []


def test_the_warm_up_and_replayed_steps_run_the_stream_s_step(model):
    batch, counted = decoder(model, rows=2, prompt_tokens=5, new_tokens=4, pad=9)
    seconds = batch.warm_up()
    assert 0 < seconds < 60 and counted.steps == [1] and counted.noises == [None]
    # the step reads the prefill's pad token and a 0 as the last token chosen (the replay's first input)
    assert counted.lasts[0].tolist() == [0, 0] and counted.chosen[0][0] == plain_decode(model, [9, 0], 1)[0]
    assert batch.first_step.tolist() == [0, 1]  # one prompt token in the first row, the other row after
    assert batch.lengths.tolist() == [1, 0]
    assert batch.decode(PROMPTS[:3]) == [plain_decode(model, p, 4) for p in PROMPTS[:3]]
    steps_before = batch.first_step.max().item()
    counted.steps.clear(), counted.noises.clear()
    batch.replayed_steps(3)()
    assert counted.steps == [steps_before, steps_before + 1, steps_before + 2]
    assert counted.noises == [None] * 3

    hot, counted = decoder(model, rows=2, prompt_tokens=5, new_tokens=4, temperature=1.0)
    hot.replayed_steps(2)()
    assert [noise.tolist() for noise in counted.noises] == [[[0.0] * VOCAB] * 2] * 2


def test_a_refilled_row_s_prompt_and_start_are_written_for_the_step(model):
    """`_refill` writes the next prompt, right-padded, its length and first step into a free row; a
    row left without a prompt starts its count at the step too, with no prompt."""
    batch, _ = decoder(model, rows=3, prompt_tokens=4, new_tokens=3, pad=7)
    held = [_Row(0, 0, []), None, None]
    queue = [[11, 12], [13, 14, 15]]
    from collections import deque

    batch._refill(queue, deque([1]), held, 40)
    assert batch.prompts[1].tolist() == [13, 14, 15, 7] and batch.prompts[2].tolist() == [7] * 4
    assert batch.lengths.tolist() == [0, 3, 0] and batch.first_step.tolist() == [0, 40, 40]
    assert held[1] == _Row(1, 42, []) and held[2] is None


def test_collect_takes_each_row_s_tokens_from_its_answer_s_first_step(model):
    batch, _ = decoder(model, rows=3, prompt_tokens=4, new_tokens=4, stops=[50])
    held = [_Row(0, 18, [1]), _Row(1, 12, []), None]
    chosen = [[9, 9, 5, 6, 50, 8], [1, 2, 3, 4, 5, 6], [0] * 6]
    got = list(batch._collect(chosen, held, 16, {50}))
    assert got == [(0, [1, 5, 6, 50]), (1, [1, 2, 3, 4])]
    assert held == [None, None, None]
    held = [_Row(2, 30, [])]
    assert list(batch._collect([[1, 2]], held, 16, {50})) == [] and held[0].answer == []
    # a free row before a held one (its answer ended earlier, the queue is empty): the rows after it
    # are still read, else their answers would never end
    held = [None, _Row(3, 16, [])]
    assert list(batch._collect([[0] * 6, [7, 50, 1, 1, 1, 1]], held, 16, {50})) == [(3, [7, 50])]
    assert held == [None, None]


def test_a_row_s_answer_ends_at_a_stop_token_or_the_limit():
    row = _Row(prompt=3, answer_from=0, answer=[])
    assert not row.take(4, {9}, 3) and not row.take(5, {9}, 3) and row.take(6, {9}, 3)
    assert _Row(0, 0, []).take(9, {9}, 3) and row.answer == [4, 5, 6]


def test_decode_stats_figures():
    stats = DecodeStats(rows=4, steps=32, answer_tokens=96, prefill_s=0.5, seconds=2.5)
    assert stats.fill == 96 / 128 and math.isclose(stats.step_ms, 2000 / 32)
    assert stats.describe() == (
        "decode: 96 answer tokens in 2.5 s (38 tok/s); prefill 0.5 s, then 32 steps of 4 rows, "
        "62.50 ms a step; answers filled 75% of the row-steps (the rest read prompts or idled)"
    )
    empty = DecodeStats()
    assert (empty.fill, empty.step_ms) == (0.0, 0.0)
    assert empty.describe().startswith("decode: 0 answer tokens in 0.0 s (0 tok/s)")
    assert (
        DecodeStats(rows=1, steps=1, answer_tokens=3, seconds=1e-12)
        .describe()
        .startswith("decode: 3 answer tokens in 0.0 s (3000000000 tok/s)")
    )
    assert DecodeStats(rows=2, answer_tokens=5, prefill_s=1, seconds=3).step_ms == 2000.0
    assert DecodeStats(rows=0, steps=3, answer_tokens=5).fill == 5.0
    # every answer ended at its first token, which the prefill chose: no step, nothing filled (not 600%)
    assert DecodeStats(rows=6, answer_tokens=6, prefill_tokens=6).fill == 0.0
    assert DecodeStats(rows=2, steps=16, answer_tokens=18, prefill_tokens=2).fill == 0.5


def test_cut_at_stop():
    stops = torch.tensor([4, 7])
    assert cut_at_stop([1, 7, 2, 4], stops) == [1, 7]
    assert cut_at_stop([4], stops) == [4]
    assert cut_at_stop([1, 2], stops) == [1, 2] and cut_at_stop([1], torch.tensor([], dtype=torch.long)) == [
        1
    ]


def test_generate_decoder_answers_in_batches_of_rows(model):
    shape = DecodeShape(rows=2, max_prompt_tokens=5, max_new_tokens=5)
    free = [plain_decode(model, p, 5) for p in PROMPTS[:3]]
    stop = free[0][1]
    generate = GenerateDecoder(model, shape, [stop], pad_token_id=3)
    assert generate.decode(PROMPTS[:3]) == [plain_decode(model, p, 5, {stop}) for p in PROMPTS[:3]]
    assert GenerateDecoder(model, shape, []).decode(PROMPTS[:3]) == free
    # the defaults: pad 0, and an empty stop list still a long tensor (`torch.tensor([])` alone is
    # float, which a caller comparing it with token ids would have to convert)
    plain = GenerateDecoder(model, shape, [])
    assert plain.pad_token_id == 0
    assert (plain.stop_ids.dtype, plain.stop_ids.tolist()) == (torch.long, [])


def test_the_warm_up_reads_the_default_pad_token_0_and_decodes_eagerly_without_a_compiled_step(model):
    ring = RingStep(
        model, DecodeShape(rows=2, max_prompt_tokens=5, max_new_tokens=4), temperature=0.0, block_sparse=False
    )
    eager = BatchDecoder(ring, [])
    assert eager.pad_token_id == 0 and eager.step is not ring  # the ring under `eagerly`
    # before any stream: empty figures, and no stop token, still as token ids (long, not float)
    assert eager.stats == DecodeStats() and eager.stats.describe().startswith("decode: 0 answer tokens")
    assert (eager.stop_ids.dtype, eager.stop_ids.tolist()) == (torch.long, [])
    eager.warm_up()
    assert eager.decode(PROMPTS[:3]) == [plain_decode(model, p, 4) for p in PROMPTS[:3]]
    counted = Counted(ring)
    BatchDecoder(ring, [], compiled=counted).warm_up()
    assert counted.chosen[0][0] == plain_decode(model, [0, 0], 1)[0]


def test_a_sampling_warm_up_draws_from_its_own_generator_not_torch_s_global_one(model):
    """The warm-up's prefill draws sampling noise; from a generator of its own, so that warming a
    decoder up leaves the process's seeded random stream (a training run's, a test's) where it was."""
    hot, counted = decoder(model, rows=2, prompt_tokens=5, new_tokens=4, temperature=1.0)
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    hot.warm_up()
    assert len(counted.steps) == 1 and torch.equal(torch.random.get_rng_state(), before)


def test_the_default_seed_is_0(model):
    hot, _ = decoder(model, rows=2, prompt_tokens=5, new_tokens=6, temperature=1.0)
    by_seed = hot.decode(PROMPTS, seed=0)
    assert hot.decode(PROMPTS) == by_seed and dict(hot.stream(PROMPTS)) == dict(enumerate(by_seed))
    assert hot.decode(PROMPTS, seed=1) != by_seed


def test_the_decoder_s_tensors_live_on_the_target_s_device(model):
    """On the meta device (it stands for CUDA here): the rows' state, the stop ids, the replayed
    steps' inputs and the sampling noise are made on the target's device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config)
    ring = RingStep(
        meta, DecodeShape(rows=2, max_prompt_tokens=4, max_new_tokens=3), temperature=1.0, block_sparse=False
    )
    counted = Counted(ring)
    batch = BatchDecoder(ring, [3, 1], compiled=counted)
    state = (batch.prompts, batch.lengths, batch.first_step, batch.stop_ids)
    assert [(t.device.type, t.dtype) for t in state] == [("meta", torch.long)] * 4
    assert batch.prompts.shape == (2, 4) and batch.lengths.shape == batch.first_step.shape == (2,)
    batch.replayed_steps(1)()
    assert (counted.lasts[0].device.type, counted.noises[0].device.type) == ("meta", "meta")
    noise = batch._noise(torch.Generator().manual_seed(0))
    assert noise.device.type == "meta" and noise.shape == (2, VOCAB)
    generate = GenerateDecoder(meta, batch.shape, [3, 1])
    assert (generate.stop_ids.device.type, generate.stop_ids.dtype, generate.stop_ids.shape) == (
        "meta",
        torch.long,
        (2,),
    )
