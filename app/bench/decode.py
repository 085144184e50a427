"""`dflash bench decode CONFIG`: the local engine's decoder (`datagen.engine = "local"`) at the config's
datagen shape, on the config's own prompts: answer tokens/s, how full its rows were, the time of a step
in the stream against the same step alone (the difference is what the stream adds around it), and where
a step's time goes. Nothing is written; `dflash datagen` prints the same decode line."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from app.bench.profile import profile_table
from app.compile.warmup import synchronize
from app.config import RunConfig
from app.datagen.local import local_decoder, render_prompt
from app.datagen.prompts import load_prompts
from app.errors import UserError
from app.model.decode import BatchDecoder, packed_attention


def run_decode_bench(config: RunConfig, count: int, profile_steps: int, log: Callable[[str], None]) -> None:
    """Decode the first `count` prompts of `datagen.prompts` (after one compiling call), then profile
    `profile_steps` decode steps."""
    from app.model.loading import load_tokenizer

    records = load_prompts(config.datagen.prompts).records[:count]
    tokenizer = load_tokenizer(config)
    rendered = [render_prompt(record, tokenizer, config) for record in records]
    prompts = sorted((ids for ids in rendered if not isinstance(ids, str)), key=len)  # as datagen orders them
    if not prompts:
        raise UserError(
            f"bench decode: no prompt in {', '.join(config.datagen.prompts)} the local engine answers"
        )
    decoder = local_decoder(config, tokenizer, prompts)
    started = time.monotonic()
    decoder.decode(prompts[:1])  # the step compiles on its first call (CUDA)
    log(f"bench decode: first call (compiles the step on CUDA) {time.monotonic() - started:.1f} s")
    log(f"bench decode: {len(prompts)} prompts of {len(records)}, shape {decoder.shape}")
    decoder.decode(prompts)
    log(decoder.stats.describe())
    if profile_steps:
        steps = replay_steps(decoder, profile_steps)
        steps()  # one untimed round first: a first call's costs stay out of the timing
        synchronize(decoder.model.device)
        started = time.monotonic()
        steps()
        synchronize(decoder.model.device)
        alone_ms = 1e3 * (time.monotonic() - started) / profile_steps
        stream_ms = decoder.stats.step_ms
        log(
            f"bench decode: a step alone (replayed back to back, the same rows) {alone_ms:.2f} ms, in the stream "
            f"{stream_ms:.2f} ms: {max(stream_ms - alone_ms, 0) / max(stream_ms, 1e-9):.0%} of the stream's step "
            "is not the step itself"
        )
        log(profile_table(steps, decoder.model.device, 15, f"{profile_steps} decode steps"))


def replay_steps(decoder: BatchDecoder, count: int) -> Callable[[], None]:
    """`count` decode steps from the rows' state as the last call left it (no position < 0), each
    step's token the next one's input, as the stream feeds them."""
    device = decoder.model.device
    vocab = decoder.model.config.get_text_config().vocab_size
    with torch.inference_mode():  # inference tensors, as the stream's: others would be a new graph
        step = decoder.first_step.max().clone()
        last = torch.zeros(decoder.shape.rows, dtype=torch.long, device=device)
        noise = torch.zeros(decoder.shape.rows, vocab, device=device) if decoder.temperature else None

    @torch.inference_mode()
    def steps() -> None:
        with packed_attention(decoder.model):  # the stream's attention: anything else is another graph
            for _ in range(count):
                last.copy_(
                    decoder.step(last, decoder.prompts, decoder.lengths, decoder.first_step, step, noise)
                )
                step.add_(1)

    return steps
