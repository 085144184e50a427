"""`dflash bench decode CONFIG`: the local engine's decoder (`datagen.engine = "local"`) at the config's
datagen shape, on the config's own prompts: answer tokens/s, how full its rows were, the time of a step,
and where a step's time goes. Nothing is written; `dflash datagen` prints the same decode line."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from app.bench.profile import profile_table
from app.config import RunConfig
from app.datagen.local import local_decoder, render_prompt
from app.datagen.prompts import load_prompts
from app.errors import UserError


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
        device = decoder.model.device
        step = decoder.first_step.max().clone()  # the rows' state as the last call left it: no position < 0
        last = torch.zeros(decoder.shape.rows, dtype=torch.long, device=device)
        vocab = decoder.model.config.get_text_config().vocab_size
        noise = torch.zeros(decoder.shape.rows, vocab, device=device) if decoder.temperature else None

        def steps() -> None:
            for _ in range(profile_steps):
                last.copy_(
                    decoder.step(last, decoder.prompts, decoder.lengths, decoder.first_step, step, noise)
                )
                step.add_(1)

        with torch.inference_mode():
            log(profile_table(steps, device, 15, f"{profile_steps} decode steps"))
