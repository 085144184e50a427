"""Batched decoding of the frozen target: many prompts answered together, at fixed shapes.

Where the target itself answers, in this process: regeneration without an inference server
(`datagen.engine = "local"`) and eval, which replays the target's greedy decode
(`app.evaluate.replay`). `BatchDecoder.stream` answers any number of prompts through `rows` rows that
are refilled as they finish (continuous batching), at one shape:

1. every row holds one prompt at a time in its own row of a static KV cache of `cache_length` slots,
   written as a ring: step t writes slot `t % cache_length` of every row, and a row sees the slots
   it wrote since its prompt began (a prompt and its answer never exceed the ring);
2. one step feeds one token per row, `[rows, 1]`: the row's next prompt token while it reads its prompt,
   else the token it chose last. That step is the only thing a GPU run compiles (`app.compile.apply.
   compile_decode_step`, CUDA graphs): its shape never changes, so it compiles once per process.
   Compiled, its attention reads only the ring blocks a row's slots lie in (flex attention over
   `ring_blocks`: a row early in its answer reads a block or two, not the whole ring); eager (eval's
   replay, a CPU), SDPA reads every slot under the same rule as a dense mask;
3. a row's answer ends after its first stop token or at `max_new_tokens`; then the row takes the next
   prompt. The host reads the chosen tokens every `STOP_CHECK_EVERY` steps (one small device read), so
   decoding never waits on it: a finished row idles until then.

Prompts are read at one token per step rather than in a prefill: every step keeps its one shape, and
no row waits for the longest answer of a batch (what fixed batches idled: docs/architecture.md,
Batched decoding).

Targets whose cache is not a plain attention cache (linear-attention layers of hybrid models,
sliding windows) cannot take this one mask over a static cache: they decode through transformers'
`generate`, in batches of `rows`, eagerly (`GenerateDecoder`).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from app.errors import UserError

STOP_CHECK_EVERY = 16
"""Decode steps between the host's reads of the chosen tokens (finished rows idle until then)."""

PACKED_ATTENTION = "dflash_packed_decode"
"""The attention implementation a decode call runs the target with (`packed_decode_attention`)."""

RING_BLOCK = 128
"""Slots per block of the ring that the compiled step's attention reads or skips as a whole (flex
attention's KV block); the ring is a whole number of them."""

DecodeStep = Callable[..., torch.Tensor]
"""`(last [R], prompts [R, P], prompt_lengths [R], first_step [R], step [], noise [R, V] | None) ->
the tokens chosen [R]` (`BatchDecoder.decode_step`)."""


@dataclass(frozen=True)
class DecodeShape:
    """The fixed shape of a decoder: `rows` rows over `cache_length` cache slots each."""

    rows: int
    """Prompts decoded at once (a row that finds no prompt left idles)."""
    max_prompt_tokens: int
    """The longest prompt a call may hold."""
    max_new_tokens: int
    """Most tokens generated per prompt (the stop token included)."""
    ring_block: int = RING_BLOCK
    """Slots per ring block (the ring is a whole number of them)."""

    @property
    def cache_length(self) -> int:
        """The ring's slots: a prompt and its answer, rounded up to whole `ring_block`s."""
        return -(-(self.max_prompt_tokens + self.max_new_tokens) // self.ring_block) * self.ring_block


@dataclass
class DecodeStats:
    """What one `stream` cost: how full its rows were and how long a step took."""

    rows: int = 0
    steps: int = 0
    """Decode steps after the prefill (each one token for every row)."""
    answer_tokens: int = 0
    prefill_s: float = 0.0
    seconds: float = 0.0
    """Wall time of the whole stream, the prefill and the host's reads included."""

    @property
    def fill(self) -> float:
        """Answer tokens per row-step: the rest went to reading prompts and to idle rows."""
        return self.answer_tokens / max(self.rows * self.steps, 1)

    @property
    def step_ms(self) -> float:
        """Milliseconds a step after the prefill, the host's reads and refills included."""
        return 1e3 * (self.seconds - self.prefill_s) / max(self.steps, 1)

    def describe(self) -> str:
        return (
            f"decode: {self.answer_tokens} answer tokens in {self.seconds:.1f} s "
            f"({self.answer_tokens / max(self.seconds, 1e-9):.0f} tok/s); prefill {self.prefill_s:.1f} s, then "
            f"{self.steps} steps of {self.rows} rows, {self.step_ms:.2f} ms a step; answers filled {self.fill:.0%} "
            f"of the row-steps (the rest read prompts or idled)"
        )


@dataclass
class _Row:
    """What the host knows of one row: the prompt it answers and its answer so far."""

    prompt: int
    answer_from: int
    """The step whose chosen token is the answer's first (the step that reads the prompt's last)."""
    answer: list[int]

    def take(self, token: int, stops: set[int], limit: int) -> bool:
        """Add the next answer token; whether the answer ended with it."""
        self.answer.append(token)
        return token in stops or len(self.answer) == limit


class BatchDecoder:
    """Greedy (or sampled) answers of an attention-only target to many prompts (module docstring)."""

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
        self.stats = DecodeStats()
        """The last `stream`'s cost (its figures grow while it runs)."""
        self.step: DecodeStep = self.decode_step
        """The decode step; `app.compile.apply.compile_decode_step` replaces it with its compiled self."""
        self.block_sparse = False
        """Whether the step's attention reads only the ring blocks a row uses (flex attention, set by
        `compile_decode_step`: fused only when compiled) rather than every slot under a dense mask."""
        config = model.config.get_text_config()
        self.query_group = config.num_attention_heads // getattr(
            config, "num_key_value_heads", config.num_attention_heads
        )
        """Query heads per KV head: the queries of a row's packed attention (`packed_decode_attention`)."""
        self.key_slots = torch.arange(shape.cache_length, device=model.device)
        rows, device = shape.rows, model.device
        self.prompts = torch.zeros(rows, shape.max_prompt_tokens, dtype=torch.long, device=device)
        """Each row's prompt, read one token per step from `first_step` on."""
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.first_step = torch.zeros(rows, dtype=torch.long, device=device)
        """The step from which each row's prompt is in the ring (its position 0)."""

    def decode(self, prompts: Sequence[Sequence[int]], seed: int = 0) -> list[list[int]]:
        """The answer to each prompt, in order: tokens after it, cut after the first stop token."""
        answers: list[list[int]] = [[] for _ in prompts]
        for index, answer in self.stream(prompts, seed):
            answers[index] = answer
        return answers

    def stream(self, prompts: Sequence[Sequence[int]], seed: int = 0) -> Iterator[tuple[int, list[int]]]:
        """`(index, answer)` of each prompt as its answer ends (not in order). Sampling draws from a
        generator seeded by `seed`: the same prompts and seed give the same answers."""
        longest = max(map(len, prompts), default=0)
        if min(map(len, prompts), default=1) < 1 or longest > self.shape.max_prompt_tokens:
            raise UserError(
                f"decode: prompts must have 1 to {self.shape.max_prompt_tokens} tokens, got up to {longest}"
            )
        return self._stream(prompts, seed) if prompts else iter(())

    @torch.inference_mode()
    def _stream(self, prompts: Sequence[Sequence[int]], seed: int) -> Iterator[tuple[int, list[int]]]:
        """The first `rows` prompts in one prefill, then steps of one token per row, each row taking
        the next prompt once its answer ends."""
        device = self.model.device
        generator = torch.Generator(device=device).manual_seed(seed)
        stops, limit = set(self.stop_ids.tolist()), self.shape.max_new_tokens
        queue = deque(range(len(prompts)))
        held: list[_Row | None] = [None] * self.shape.rows
        chosen = torch.zeros(self.shape.rows, STOP_CHECK_EVERY, dtype=torch.long, device=device)
        self.stats = stats = DecodeStats(rows=self.shape.rows)
        started = time.monotonic()
        with packed_attention(self.model):
            last, steps = self._prefill(prompts, queue, held, generator)
            stats.prefill_s = stats.seconds = time.monotonic() - started
            for row, (state, token) in enumerate(zip(held, last.tolist(), strict=True)):
                if state is not None and state.take(token, stops, limit):
                    held[row] = None
                    stats.answer_tokens += len(state.answer)
                    yield state.prompt, state.answer
            step = torch.tensor(steps, device=device)
            while True:
                self._refill(prompts, queue, held, steps)
                if not any(held):
                    return
                for column in range(STOP_CHECK_EVERY):
                    # the next input is a copy, not the step's output (a CUDA graph's output buffer,
                    # which its next replay overwrites)
                    chosen[:, column] = self.step(
                        last, self.prompts, self.lengths, self.first_step, step, self._noise(generator)
                    )
                    last.copy_(chosen[:, column])
                    step += 1
                for index, answer in self._collect(chosen.tolist(), held, steps, stops):
                    stats.answer_tokens += len(answer)
                    stats.seconds = time.monotonic() - started
                    yield index, answer
                steps += STOP_CHECK_EVERY
                stats.steps += STOP_CHECK_EVERY
                stats.seconds = time.monotonic() - started

    def warm_up(self) -> float:
        """A prefill of one token, then one step: a compiled step compiles and captures its graph here
        (on the cache as a stream's prefill leaves it), not in the stream's first steps, whose timing
        would carry it; seconds."""
        started = time.monotonic()
        with torch.inference_mode(), packed_attention(self.model):
            generator = torch.Generator(device=self.model.device)
            self._prefill([[self.pad_token_id]], deque([0]), [None] * self.shape.rows, generator)
        self.replayed_steps(1)()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.monotonic() - started

    def replayed_steps(self, count: int) -> Callable[[], None]:
        """`count` decode steps from the rows' state as the last call left it (no position < 0), each
        step's token the next one's input, as the stream feeds them: the stream's own graph (its packed
        attention, inference tensors; anything else would be a second graph compiled for the occasion)."""
        device = self.model.device
        vocab = self.model.config.get_text_config().vocab_size
        with torch.inference_mode():
            step = self.first_step.max().clone()
            last = torch.zeros(self.shape.rows, dtype=torch.long, device=device)
            noise = torch.zeros(self.shape.rows, vocab, device=device) if self.temperature else None

        @torch.inference_mode()
        def steps() -> None:
            with packed_attention(self.model):
                for _ in range(count):
                    last.copy_(self.step(last, self.prompts, self.lengths, self.first_step, step, noise))
                    step.add_(1)

        return steps

    # eager: a compiled function it meets (`compile_target`'s RoPE, replaced for the whole process) must
    # not compile again for these inference tensors
    @torch.compiler.set_stance("force_eager")
    def _prefill(
        self, prompts: Sequence[Sequence[int]], queue: deque[int], held: list, generator: torch.Generator
    ) -> tuple[torch.Tensor, int]:
        """The first prompts, left-padded to the longest, in one forward into the ring's first slots
        (a row with no prompt, or a pad query, sees only its own slot: finite, never seen); the token
        each row chose and the next step."""
        device = self.model.device
        self.cache.reset()
        wave = [queue.popleft() for _ in range(min(len(queue), self.shape.rows))]
        longest = max(len(prompts[index]) for index in wave)
        ids = torch.full((self.shape.rows, longest), self.pad_token_id)
        lengths = torch.zeros(self.shape.rows, dtype=torch.long)
        for row, index in enumerate(wave):
            tokens = prompts[index]
            ids[row, longest - len(tokens) :] = torch.tensor(tokens)
            lengths[row] = len(tokens)
            held[row] = _Row(index, longest - 1, [])
        self.lengths.copy_(lengths)
        self.first_step.copy_(longest - lengths)  # a row with no prompt starts after the prefill
        query = torch.arange(longest, device=device)
        causal = self.key_slots[None, :] <= query[:, None]  # [P, L]
        own = self.key_slots[None, :] == query[:, None]
        visible = (causal[None] & (self.key_slots >= self.first_step[:, None, None])) | own[None]
        logits = self.model(
            input_ids=ids.to(device),
            position_ids=(query[None, :] - self.first_step[:, None]).clamp(min=0),
            attention_mask=visible[:, None],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        return self._pick(logits, self._noise(generator)), longest

    def _refill(self, prompts: Sequence[Sequence[int]], queue: deque[int], held: list, steps: int) -> None:
        """The next prompts into the free rows from step `steps` on; a row left free restarts its
        count there too, so that its positions stay small."""
        free = [row for row, state in enumerate(held) if state is None]
        if not free:
            return
        ids = torch.full((len(free), self.shape.max_prompt_tokens), self.pad_token_id)
        lengths = torch.zeros(len(free), dtype=torch.long)
        for position, row in enumerate(free):
            if queue:
                index = queue.popleft()
                tokens = prompts[index]
                ids[position, : len(tokens)] = torch.tensor(tokens)
                lengths[position] = len(tokens)
                held[row] = _Row(index, steps + len(tokens) - 1, [])
        target = torch.tensor(free, device=self.model.device)
        self.prompts[target] = ids.to(self.model.device)
        self.lengths[target] = lengths.to(self.model.device)
        self.first_step[target] = steps

    def _collect(
        self, chosen: list[list[int]], held: list, steps: int, stops: set[int]
    ) -> Iterator[tuple[int, list[int]]]:
        """Each held row's answer tokens among the choices of steps `steps ..`; a row whose answer
        ended gives it up and is free."""
        for row, state in enumerate(held):
            if state is None:
                continue
            for token in chosen[row][max(state.answer_from - steps, 0) :]:
                if state.take(token, stops, self.shape.max_new_tokens):
                    held[row] = None
                    yield state.prompt, state.answer
                    break

    def decode_step(
        self,
        last: torch.Tensor,
        prompts: torch.Tensor,
        lengths: torch.Tensor,
        first_step: torch.Tensor,
        step: torch.Tensor,
        noise: torch.Tensor | None,
    ) -> torch.Tensor:
        """One token per row at step `step`: the row's prompt token at its position (`step -
        first_step`) while it reads its prompt, else `last`; it sees the ring's slots written since
        `first_step`, and the token chosen after it comes back."""
        position = step - first_step
        reading = position < lengths
        prompt_token = prompts.gather(1, position.clamp(max=prompts.shape[1] - 1)[:, None])[:, 0]
        tokens = torch.where(reading, prompt_token, last)
        ring = self.shape.cache_length

        def written_since_first_step(row: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
            """Whether `slot` was last written at or after the row's `first_step` (the row's own)."""
            return step - torch.remainder(step - slot, ring) >= first_step[row]

        if self.block_sparse:
            visible: torch.Tensor | BlockMask = ring_blocks(
                first_step, step, ring, self.shape.ring_block, written_since_first_step, self.query_group
            )
        else:
            rows = torch.arange(first_step.shape[0], device=first_step.device)
            visible = written_since_first_step(rows[:, None], self.key_slots[None, :])[:, None, None, :]
        logits = self.model(
            input_ids=tokens[:, None],
            position_ids=position[:, None],
            attention_mask=visible,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        for layer in self.cache.layers:  # the cache writes at its own count: keep it on the ring
            layer.cumulative_length.remainder_(ring)
        return self._pick(logits, noise)

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

    def decode(self, prompts: Sequence[Sequence[int]], seed: int = 0) -> list[list[int]]:
        """The answer to each prompt, in order, `rows` prompts per `generate` call."""
        rows = self.shape.rows
        return [
            answer
            for start in range(0, len(prompts), rows)
            for answer in self._batch(prompts[start : start + rows])
        ]

    @torch.inference_mode()
    def _batch(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
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
    when compiled: a copy of the whole cache per layer and step, which reading it in place saves (BENCHMARKS.md,
    2026-12-03, second session). A prefill (several queries) is SDPA's."""
    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if isinstance(attention_mask, BlockMask):
        # packed as below, not flex's own GQA handling: 3.5x faster (BENCHMARKS.md, 2026-12-03, fifth session)
        packed = query.reshape(rows, kv_heads, heads // kv_heads, dim)
        out = flex_attention(packed, key, value, block_mask=attention_mask, scale=scaling)
        return out.reshape(rows, heads, 1, dim).transpose(1, 2), None
    if length != 1 or kv_heads == heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    packed = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None


def ring_blocks(
    first_step: torch.Tensor,
    step: torch.Tensor,
    ring: int,
    block: int,
    visible: Callable[..., torch.Tensor],
    queries: int = 1,
) -> BlockMask:
    """The flex block mask of one decode step: each row reads only the blocks of `block` slots its arc
    of the ring covers (the slots written from its `first_step` to `step`, wrapping at `ring`), and
    inside them the slots `visible(row, slot)` allows, for each of its `queries` (the query heads
    packed onto one KV head, `packed_decode_attention`). The arc starts in the block of slot
    `first_step % ring`; it covers its offset in that block plus `step - first_step + 1` slots, at
    most the ring."""
    rows, blocks = first_step.shape[0], ring // block
    start = torch.remainder(first_step, ring)
    count = torch.clamp((start % block + step - first_step + block) // block, max=blocks)
    order = torch.remainder(start[:, None] // block + torch.arange(blocks, device=step.device), blocks)

    def mask_mod(
        row: torch.Tensor, head: torch.Tensor, query: torch.Tensor, slot: torch.Tensor
    ) -> torch.Tensor:
        return visible(row, slot)

    return BlockMask.from_kv_blocks(
        count.to(torch.int32).view(rows, 1, 1),
        order.to(torch.int32).view(rows, 1, 1, blocks),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(queries, ring),
    )


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
