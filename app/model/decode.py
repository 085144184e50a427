"""Batched decoding of the frozen target: many prompts answered together, at fixed shapes.

Where the target itself answers, in this process: regeneration without an inference server
(`datagen.engine = "local"`) and eval, which replays the target's greedy decode
(`app.evaluate.replay`). One call of `BatchDecoder.decode` answers up to `rows` prompts:

1. prefill: the prompts, left-padded to the longest of them, in one forward that fills a static KV
   cache of `cache_length` slots per row (pad rows see only themselves, so no row of the cache is NaN);
2. decode: one token per row per step, at one shape `[rows, 1]` over the whole cache with a mask of
   each row's own keys. That step is the only thing a GPU run compiles (`app.compile.apply.
   compile_decode_step`, CUDA graphs): its shape never changes, so it compiles once per process.
3. every row's answer ends after its first stop token or at `max_new_tokens`.

A row that has finished keeps decoding until every row of the call has (the step's shape is fixed);
the host checks for that every `STOP_CHECK_EVERY` steps, not every step, so decoding never waits on it.

Targets whose cache is not a plain attention cache (linear-attention layers of hybrid models,
sliding windows) cannot take this one mask over a static cache: they decode through transformers'
`generate`, batched the same way, eagerly (`GenerateDecoder`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from app.errors import UserError

STOP_CHECK_EVERY = 16
"""Decode steps between the host's checks that every row has finished (one tiny device read)."""

PACKED_ATTENTION = "dflash_packed_decode"
"""The attention implementation a decode call runs the target with (`packed_decode_attention`)."""

DecodeStep = Callable[..., torch.Tensor]
"""`(tokens [R, 1], first_key [R], write_index [], noise [R, V] | None) -> next tokens [R]`."""


@dataclass(frozen=True)
class DecodeShape:
    """The fixed shape of a decoder: every call decodes `rows` rows over `cache_length` cache slots."""

    rows: int
    """Prompts decoded together (a call with fewer fills the rest with copies of its first prompt)."""
    max_prompt_tokens: int
    """The longest prompt a call may hold."""
    max_new_tokens: int
    """Most tokens generated per prompt (the stop token included)."""

    @property
    def cache_length(self) -> int:
        return self.max_prompt_tokens + self.max_new_tokens


class BatchDecoder:
    """Greedy (or sampled) answers of an attention-only target to batches of prompts (module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        shape: DecodeShape,
        stop_ids: Collection[int],
        *,
        temperature: float = 0.0,
        pad_token_id: int = 0,
    ) -> None:
        if shape.rows < 1 or shape.max_prompt_tokens < 1 or shape.max_new_tokens < 1:
            raise UserError(f"decode: rows, prompt and new-token limits must be >= 1, got {shape}")
        if not supports_static_cache(model):
            raise UserError(f"decode: {type(model).__name__} has layers a static attention cache cannot hold")
        self.model = model
        self.shape = shape
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=model.device)
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self.cache = StaticCache(config=model.config, max_cache_len=shape.cache_length)
        self.step: DecodeStep = self.decode_step
        """The decode step; `app.compile.apply.compile_decode_step` replaces it with its compiled self."""
        self.key_slots = torch.arange(shape.cache_length, device=model.device)

    @torch.inference_mode()
    def decode(self, prompts: Sequence[Sequence[int]], seed: int = 0) -> list[list[int]]:
        """The answer to each prompt (at most `rows`): tokens after it, cut after the first stop token."""
        count = len(prompts)
        if not 1 <= count <= self.shape.rows:
            raise UserError(f"decode: a call takes 1 to {self.shape.rows} prompts, got {count}")
        rows = [list(p) for p in prompts] + [list(prompts[0])] * (self.shape.rows - count)
        longest = max(map(len, rows))
        if min(map(len, rows)) < 1 or longest > self.shape.max_prompt_tokens:
            raise UserError(
                f"decode: prompts must have 1 to {self.shape.max_prompt_tokens} tokens, got up to {longest}"
            )
        with packed_attention(self.model):
            return self._decode(rows, count, longest, seed)

    def _decode(self, rows: list[list[int]], count: int, longest: int, seed: int) -> list[list[int]]:
        generator = torch.Generator(device=self.model.device).manual_seed(seed)
        self.cache.reset()
        first_key = torch.tensor([longest - len(r) for r in rows], device=self.model.device)
        tokens = self._prefill(rows, first_key, longest, generator)
        answers = torch.empty(
            self.shape.rows, self.shape.max_new_tokens, dtype=torch.long, device=tokens.device
        )
        answers[:, 0] = tokens
        done = torch.isin(tokens, self.stop_ids)
        write_index = torch.tensor(longest, device=tokens.device)
        for step in range(1, self.shape.max_new_tokens):
            # the next input is a copy in `answers`, not the step's output (a CUDA graph's output
            # buffer, which its next replay overwrites)
            answers[:, step] = self.step(
                answers[:, step - 1 : step], first_key, write_index, self._noise(generator)
            )
            done |= torch.isin(answers[:, step], self.stop_ids)
            write_index += 1
            if step % STOP_CHECK_EVERY == 0 and bool(done.all()):
                answers = answers[:, : step + 1]
                break
        return [cut_at_stop(row, self.stop_ids) for row in answers[:count].tolist()]

    def decode_step(
        self,
        tokens: torch.Tensor,
        first_key: torch.Tensor,
        write_index: torch.Tensor,
        noise: torch.Tensor | None,
    ) -> torch.Tensor:
        """One token per row: each row sees its cache slots `[first_key, write_index]`, at position
        `write_index - first_key` (its own count of real tokens so far)."""
        visible = (self.key_slots >= first_key[:, None]) & (self.key_slots <= write_index)
        logits = self.model(
            input_ids=tokens,
            position_ids=(write_index - first_key)[:, None],
            attention_mask=visible[:, None, None, :],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        return self._pick(logits, noise)

    def _prefill(
        self, rows: list[list[int]], first_key: torch.Tensor, longest: int, generator: torch.Generator
    ) -> torch.Tensor:
        device = self.model.device
        ids = torch.tensor([[self.pad_token_id] * (longest - len(r)) + r for r in rows], device=device)
        query = torch.arange(longest, device=device)
        causal = self.key_slots[None, :] <= query[:, None]  # [P, L]
        own = self.key_slots[None, :] == query[:, None]  # a pad query sees itself: finite, never seen
        visible = (causal[None] & (self.key_slots >= first_key[:, None, None])) | own[None]
        logits = self.model(
            input_ids=ids,
            position_ids=(query[None, :] - first_key[:, None]).clamp(min=0),
            attention_mask=visible[:, None],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        return self._pick(logits, self._noise(generator))

    def _noise(self, generator: torch.Generator) -> torch.Tensor | None:
        """Gumbel noise for sampling, drawn outside the compiled step from the call's own generator
        (the same seed gives the same answers, compiled or not)."""
        if self.temperature == 0:
            return None
        vocab = self.model.config.get_text_config().vocab_size
        uniform = torch.rand(self.shape.rows, vocab, generator=generator, device=self.model.device)
        return -torch.log(-torch.log(uniform.clamp_(min=1e-20)))

    def _pick(self, logits: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """argmax, or a sample at `temperature` (the Gumbel-max trick)."""
        if noise is None:
            return logits.argmax(dim=-1)
        return (logits.float() / self.temperature + noise).argmax(dim=-1)


class GenerateDecoder:
    """The same calls for targets a static attention cache cannot hold: transformers' `generate`,
    left-padded batches, eager. Greedy only (eval's replay)."""

    def __init__(
        self, model: PreTrainedModel, shape: DecodeShape, stop_ids: Collection[int], pad_token_id: int = 0
    ):
        self.model, self.shape, self.pad_token_id = model, shape, pad_token_id
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=model.device)

    @torch.inference_mode()
    def decode(self, prompts: Sequence[Sequence[int]], seed: int = 0) -> list[list[int]]:
        longest = max(map(len, prompts))
        device = self.model.device
        ids = torch.tensor(
            [[self.pad_token_id] * (longest - len(p)) + list(p) for p in prompts], device=device
        )
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
        output = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=self.shape.max_new_tokens,
            do_sample=False,
            eos_token_id=self.stop_ids.tolist() or None,
            pad_token_id=self.pad_token_id,
        )
        return [cut_at_stop(row, self.stop_ids) for row in output[:, longest:].tolist()]


@contextlib.contextmanager
def packed_attention(model: PreTrainedModel) -> Iterator[None]:
    """The target's attention runs `packed_decode_attention` inside, its own implementation after."""
    AttentionInterface.register(PACKED_ATTENTION, packed_decode_attention)
    text = model.config.get_text_config()
    configs = [model.config] if text is model.config else [model.config, text]
    before = [config._attn_implementation for config in configs]
    for config in configs:
        config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        for config, implementation in zip(configs, before, strict=True):
            config._attn_implementation = implementation


def packed_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """A decode step's attention with grouped query heads read against each KV head as if they were
    that head's queries (`[rows, heads, 1, d] -> [rows, kv heads, heads / kv heads, d]`), so the cache
    is read once per KV head. transformers' SDPA path repeats the KV heads to the query heads first
    when compiled: a copy of the whole cache per layer and step, most of the step's time at 512 rows
    over 1024 slots on an H200 (BENCHMARKS.md, 2026-12-03). A prefill (several queries) is SDPA's."""
    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if length != 1 or kv_heads == heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    packed = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None


def batch_decoder(
    model: PreTrainedModel,
    shape: DecodeShape,
    stop_ids: Collection[int],
    pad_token_id: int = 0,
) -> BatchDecoder | GenerateDecoder:
    """The greedy decoder that fits the target: static-cache batches where it can, `generate` else."""
    if supports_static_cache(model):
        return BatchDecoder(model, shape, stop_ids, pad_token_id=pad_token_id)
    return GenerateDecoder(model, shape, stop_ids, pad_token_id)


def supports_static_cache(model: PreTrainedModel) -> bool:
    """Whether every layer of the target's static cache is a plain full-attention layer (no linear
    attention, no sliding window), so that one mask over all its slots is right for every layer."""
    try:
        cache = StaticCache(config=model.config, max_cache_len=1)
    except (ValueError, KeyError, NotImplementedError):
        # a layer type transformers has no static cache for (its mapping has no key for it): not plain
        return False
    return all(type(layer) is StaticLayer for layer in cache.layers)


def cut_at_stop(tokens: list[int], stop_ids: torch.Tensor) -> list[int]:
    """`tokens` up to and including the first stop token."""
    stops = set(stop_ids.tolist())
    for index, token in enumerate(tokens):
        if token in stops:
            return tokens[: index + 1]
    return tokens
