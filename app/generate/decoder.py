"""Batched decoding of the frozen target: many prompts answered together, at fixed shapes.

Where the target itself answers, in this process: regeneration without an inference server
(`datagen.engine = "local"`) and eval, which replays the target's greedy decode
(`app.evaluate.replay`). `BatchDecoder.stream` answers any number of prompts through `rows` rows that
are refilled as they finish (continuous batching), at one shape, through one decode step over a ring
of cache slots (`app.generate.step.RingStep`, compiled or eager as it was built, `app.generate.build`).
A row's answer ends after its first stop token or at `max_new_tokens`; then the row takes the next
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

import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from app.compile.guard import eagerly
from app.errors import UserError
from app.generate.attention import packed_attention
from app.generate.step import DecodeShape, DecodeStep, RingStep

STOP_CHECK_EVERY = 16
"""Decode steps between the host's reads of the chosen tokens (finished rows idle until then)."""


@dataclass
class DecodeStats:
    """What one `stream` cost: how full its rows were and how long a step took."""

    rows: int = 0
    steps: int = 0
    """Decode steps after the prefill (each one token for every row)."""
    answer_tokens: int = 0
    prefill_tokens: int = 0
    """Answer tokens the prefill chose (the first rows' first tokens), no step's."""
    prefill_s: float = 0.0
    seconds: float = 0.0
    """Wall time of the whole stream, the prefill and the host's reads included."""

    @property
    def fill(self) -> float:
        """Answer tokens the steps chose per row-step: the rest went to reading prompts and to idle rows."""
        return (self.answer_tokens - self.prefill_tokens) / max(self.rows * self.steps, 1)

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
    """Greedy (or sampled) answers of an attention-only target to many prompts (module docstring).
    `compiled`: `ring` compiled (`app.compile.apply.compile_decode_step`), the step every call runs;
    None runs `ring` itself with every compiled function of the process eager (a training run's
    compiled target modules must not compile again for decoding's inference tensors)."""

    def __init__(
        self,
        ring: RingStep,
        stop_ids: Collection[int],
        *,
        compiled: DecodeStep | None = None,
        pad_token_id: int = 0,
    ) -> None:
        shape = ring.shape
        self.ring = ring
        self.model = ring.model
        self.shape = shape
        self.step: DecodeStep = compiled if compiled is not None else eagerly()(ring)
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.model.device)
        self.pad_token_id = pad_token_id
        self.stats = DecodeStats()
        """The last `stream`'s cost (its figures grow while it runs)."""
        rows, device = shape.rows, self.model.device
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
            stats.prefill_tokens = sum(state is not None for state in held)
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
            noise = torch.zeros(self.shape.rows, vocab, device=device) if self.ring.temperature else None

        @torch.inference_mode()
        def steps() -> None:
            with packed_attention(self.model):
                for _ in range(count):
                    last.copy_(self.step(last, self.prompts, self.lengths, self.first_step, step, noise))
                    step.add_(1)

        return steps

    # eager: a compiled function it meets (`compile_target`'s RoPE, replaced for the whole process) must
    # not compile again for these inference tensors
    @eagerly()
    def _prefill(
        self, prompts: Sequence[Sequence[int]], queue: deque[int], held: list, generator: torch.Generator
    ) -> tuple[torch.Tensor, int]:
        """The first prompts, left-padded to the longest, in one forward into the ring's first slots
        (a row with no prompt, or a pad query, sees only its own slot: finite, never seen); the token
        each row chose and the next step."""
        device = self.model.device
        self.ring.cache.reset()
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
        key_slots = self.ring.key_slots
        causal = key_slots[None, :] <= query[:, None]  # [P, L]
        own = key_slots[None, :] == query[:, None]
        visible = (causal[None] & (key_slots >= self.first_step[:, None, None])) | own[None]
        logits = self.model(
            input_ids=ids.to(device),
            position_ids=(query[None, :] - self.first_step[:, None]).clamp(min=0),
            attention_mask=visible[:, None],
            cache=self.ring.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        return self.ring.pick(logits, self._noise(generator)), longest

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

    def _noise(self, generator: torch.Generator) -> torch.Tensor | None:
        """Gumbel noise for sampling, drawn outside the compiled step from the call's own generator
        (the same seed gives the same answers, compiled or not)."""
        if self.ring.temperature == 0:
            return None
        vocab = self.model.config.get_text_config().vocab_size
        uniform = torch.rand(self.shape.rows, vocab, generator=generator, device=self.model.device)
        return -torch.log(-torch.log(uniform.clamp_(min=1e-20)))


class GenerateDecoder:
    """The same calls for targets a static attention cache cannot hold: transformers' `generate`,
    left-padded batches, every compiled function of the process eager. Greedy only (eval's replay)."""

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
    @eagerly()
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


def cut_at_stop(tokens: list[int], stop_ids: torch.Tensor) -> list[int]:
    """`tokens` up to and including the first stop token."""
    stops = set(stop_ids.tolist())
    for index, token in enumerate(tokens):
        if token in stops:
            return tokens[: index + 1]
    return tokens
