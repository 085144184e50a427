"""`dflash bench decode CONFIG`: the local engine's decoder (`datagen.engine = "local"`) at the config's
datagen shape, on the config's own prompts: answer tokens/s, how full its rows were, the time of a step
in the stream against the same step alone (the difference is what the stream adds around it), and where
a step's time goes. Nothing is written; `dflash datagen` prints the same decode line."""

from __future__ import annotations

import time
from collections.abc import Callable

from app.bench.profile import profile_table
from app.compile.warmup import synchronize
from app.config import RunConfig
from app.datagen.local import render_prompt
from app.datagen.prompts import load_prompts
from app.errors import UserError
from app.generate.build import local_decoder


def run_decode_bench(config: RunConfig, count: int, profile_steps: int, log: Callable[[str], None]) -> None:
    """Decode the first `count` prompts of `datagen.prompts` (the step warmed up first), then profile
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
    decoder = local_decoder(config, tokenizer, prompts, lambda message: log(f"bench decode: {message}"))
    log(f"bench decode: {len(prompts)} prompts of {len(records)}, shape {decoder.shape}")
    decoder.decode(prompts)
    log(decoder.stats.describe())
    if profile_steps:
        steps = decoder.replayed_steps(profile_steps)
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
