"""The decoder's fixed shape and its one decode step over a ring of static-cache slots.

Every row holds one prompt at a time in its own row of a static KV cache of `cache_length` slots,
written as a ring: step t writes slot `t % cache_length` of every row, and a row sees the slots it
wrote since its prompt began (a prompt and its answer never exceed the ring). One step feeds one token
per row, `[rows, 1]`: the row's next prompt token while it reads its prompt, else the token it chose
last. Its shape never changes, so a GPU run compiles it once per process (`app.generate.build`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask
from transformers import PreTrainedModel

from app.errors import UserError
from app.generate.attention import ring_blocks
from app.generate.transformers_internals import plain_attention_cache, static_cache, wrap_write_position

RING_BLOCK = 128
"""Slots per block of the ring that the compiled step's attention reads or skips as a whole (flex
attention's KV block); the ring is a whole number of them."""

DecodeStep = Callable[..., torch.Tensor]
"""`(last [R], prompts [R, P], prompt_lengths [R], first_step [R], step [], noise [R, V] | None) ->
the tokens chosen [R]` (`RingStep.__call__`, or its compiled self)."""


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


class RingStep:
    """One token per row through the target over its ring cache (module docstring). `block_sparse`:
    the attention reads only the ring blocks a row's slots lie in (flex attention over `ring_blocks`,
    fused only when compiled), else every slot under a dense mask (eager, a CPU)."""

    def __init__(
        self, model: PreTrainedModel, shape: DecodeShape, *, temperature: float, block_sparse: bool
    ) -> None:
        if shape.rows < 1 or shape.max_prompt_tokens < 1 or shape.max_new_tokens < 1:
            raise UserError(f"decode: rows, prompt and new-token limits must be >= 1, got {shape}")
        if not plain_attention_cache(model):
            raise UserError(f"decode: {type(model).__name__} has layers a static attention cache cannot hold")
        self.model = model
        self.shape = shape
        self.temperature = temperature
        self.block_sparse = block_sparse
        self.cache = static_cache(model, shape.cache_length)
        config = model.config.get_text_config()
        self.query_group = config.num_attention_heads // getattr(
            config, "num_key_value_heads", config.num_attention_heads
        )
        """Query heads per KV head: the queries of a row's packed attention (`packed_decode_attention`)."""
        self.key_slots = torch.arange(shape.cache_length, device=model.device)

    def __call__(
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
        wrap_write_position(self.cache, ring)
        return self.pick(logits, noise)

    def pick(self, logits: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """argmax, or a sample at `temperature` (the Gumbel-max trick)."""
        if noise is None:
            return logits.argmax(dim=-1)
        return (logits.float() / self.temperature + noise).argmax(dim=-1)
