"""Fast direct tests of where a decoder is made (`app.generate.build`): the eager batched decoder and
its settings, `generate` for a target a static cache cannot hold, the compiled step refused off CUDA,
and the local datagen engine's decoder at the run's shape, temperature, pad and stop tokens. A
one-layer random target and the built-in tiny-lm on the CPU: seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.generate.build import batch_decoder, greedy_decoder, local_decoder
from app.generate.decoder import BatchDecoder, GenerateDecoder
from app.generate.step import DecodeShape
from tests.test_generate_units import PROMPTS, model, plain_decode  # noqa: F401 (a fixture)
from tests.test_local_datagen import config
from tests.test_speculative import HYBRID_LINEAR, random_target_config, target_and_drafter

SHAPE = DecodeShape(rows=2, max_prompt_tokens=5, max_new_tokens=4)


def test_the_batch_decoder_s_settings_and_defaults(model):  # noqa: F811
    made = batch_decoder(model, SHAPE, [9, 3], compiled=False, temperature=0.5, pad_token_id=7)
    assert isinstance(made, BatchDecoder) and made.model is model and made.shape == SHAPE
    assert (made.ring.temperature, made.pad_token_id, made.stop_ids.tolist()) == (0.5, 7, [3, 9])
    assert not made.ring.block_sparse
    plain = batch_decoder(model, SHAPE, [], compiled=False)
    assert (plain.ring.temperature, plain.pad_token_id) == (0.0, 0)
    assert plain.decode(PROMPTS[:3]) == [plain_decode(model, p, 4) for p in PROMPTS[:3]]


def test_the_compiled_step_is_cuda_s_only(model):  # noqa: F811
    with pytest.raises(RuntimeError, match=r"^compile_decode_step: only on CUDA \(CUDA graphs\)$"):
        batch_decoder(model, SHAPE, [], compiled=True)


def test_eval_s_greedy_decoder_batches_where_the_cache_allows_and_generates_else(model):  # noqa: F811
    stop = plain_decode(model, PROMPTS[0], 4)[1]
    batched = greedy_decoder(model, SHAPE, [stop], pad_token_id=6)
    assert isinstance(batched, BatchDecoder) and not batched.ring.block_sparse
    assert (batched.shape, batched.pad_token_id, batched.stop_ids.tolist()) == (SHAPE, 6, [stop])
    assert batched.decode(PROMPTS[:3]) == [plain_decode(model, p, 4, {stop}) for p in PROMPTS[:3]]
    assert greedy_decoder(model, SHAPE, []).pad_token_id == 0
    hybrid = target_and_drafter(random_target_config("qwen3_5_text", **HYBRID_LINEAR))[0].model
    generated = greedy_decoder(hybrid, SHAPE, [stop], pad_token_id=6)
    assert isinstance(generated, GenerateDecoder) and generated.model is hybrid
    assert (generated.shape, generated.pad_token_id, generated.stop_ids.tolist()) == (SHAPE, 6, [stop])
    assert greedy_decoder(hybrid, SHAPE, []).pad_token_id == 0


def test_the_local_engine_s_decoder_takes_the_run_s_shape_and_sampling(tmp_path: Path, tiny_lm_dir: Path):
    from app.model.loading import load_tokenizer, stop_token_ids
    from app.model.target import load_target

    run = config(tmp_path, temperature=0.7)
    tokenizer = load_tokenizer(run)
    lines = []
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15], [16], [17, 18]]
    made = local_decoder(run, tokenizer, prompts, lines.append)
    assert isinstance(made, BatchDecoder) and lines == []  # eager on the CPU: nothing to say
    assert made.shape == DecodeShape(rows=4, max_prompt_tokens=5, max_new_tokens=12)
    assert made.ring.temperature == 0.7 and not made.ring.block_sparse
    assert made.model.device.type == "cpu"
    target = load_target(run, "cpu")
    assert made.stop_ids.tolist() == sorted(stop_token_ids(tokenizer, target))
    assert made.pad_token_id == (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    few = local_decoder(run, tokenizer, prompts[:2], lines.append)
    assert few.shape == DecodeShape(rows=2, max_prompt_tokens=3, max_new_tokens=12)
    tokenizer.pad_token_id = None
    assert local_decoder(run, tokenizer, prompts[:2], lines.append).pad_token_id == 0
    tokenizer.pad_token_id = 3
    assert local_decoder(run, tokenizer, prompts[:2], lines.append).pad_token_id == 3
