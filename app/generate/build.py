"""The one place a decoder is made: compiled (datagen's local engine, `dflash bench decode`: the step
as CUDA graphs, its attention over the ring blocks in use) or eager (eval, a CPU: every slot under a
dense mask, and `generate` for targets a static attention cache cannot hold)."""

from __future__ import annotations

from collections.abc import Callable, Collection

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from app.config.schema import RunConfig
from app.generate.decoder import BatchDecoder, GenerateDecoder
from app.generate.step import DecodeShape, RingStep
from app.generate.transformers_internals import plain_attention_cache


def batch_decoder(
    model: PreTrainedModel,
    shape: DecodeShape,
    stop_ids: Collection[int],
    *,
    compiled: bool,
    temperature: float = 0.0,
    pad_token_id: int = 0,
) -> BatchDecoder:
    """A continuous-batching decoder of `model` at `shape`; `compiled` (CUDA only): its step compiled
    into CUDA graphs (`app.compile.apply.compile_decode_step`) with the block-sparse attention that
    only a compiled graph fuses."""
    ring = RingStep(model, shape, temperature=temperature, block_sparse=compiled)
    step = None
    if compiled:
        from app.compile.apply import compile_decode_step  # torch.compile's machinery: only where it runs

        step = compile_decode_step(ring, model.device)
    return BatchDecoder(ring, stop_ids, compiled=step, pad_token_id=pad_token_id)


def greedy_decoder(
    model: PreTrainedModel, shape: DecodeShape, stop_ids: Collection[int], pad_token_id: int = 0
) -> BatchDecoder | GenerateDecoder:
    """Eval's eager greedy decoder: continuous batching where the target's cache allows, `generate`
    else."""
    if plain_attention_cache(model):
        return batch_decoder(model, shape, stop_ids, compiled=False, pad_token_id=pad_token_id)
    return GenerateDecoder(model, shape, stop_ids, pad_token_id)


def local_decoder(
    config: RunConfig,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    log: Callable[[str], None],
) -> BatchDecoder:
    """The run's target and its batched decoder for `prompts` (`datagen.local_rows` rows, the longest
    prompt, `datagen.max_tokens`; on CUDA its step compiled and warmed up before any prompt, so that
    the stream's figures are its own: the kernels in the run's inductor directory, `log` told how
    long it took)."""
    from app.model.loading import pick_device, stop_token_ids
    from app.model.target import load_target

    datagen = config.datagen
    device = pick_device(config.train.device)
    compiled = device.type == "cuda" and datagen.local_decode == "compiled"
    if compiled:  # the decode step's kernels persist where training's do, never /tmp
        from app.compile.environment import resolve_inductor_dir, use_compile_dirs

        use_compile_dirs(resolve_inductor_dir(config.compile))
    target = load_target(config, device)
    shape = DecodeShape(
        rows=min(datagen.local_rows, len(prompts)),
        max_prompt_tokens=max(map(len, prompts)),
        max_new_tokens=datagen.max_tokens,
    )
    decoder = batch_decoder(
        target.model,
        shape,
        stop_token_ids(tokenizer, target),
        compiled=compiled,
        temperature=datagen.temperature,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
    )
    if compiled:
        log(
            f"the decode step compiled and captured in {decoder.warm_up():.1f} s "
            f"(rows {shape.rows}, ring {shape.cache_length} slots; once per process, its kernels cached)"
        )
    elif device.type == "cuda":
        log(f"the decode step runs eager on {device} (datagen.local_decode = eager)")
    return decoder
